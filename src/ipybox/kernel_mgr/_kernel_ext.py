"""IPython extension loaded into every ipybox kernel: shell approval, shell-escape guard, working directory.

The kernel spec loads it at start (``--IPKernelApp.extensions``); what it does is set by
the kernel's environment, which `CodeExecutor` fills:

- ``IPYBOX_APPROVE_SHELL=1``: ``!cmd``, ``x = !cmd`` and script cells (``%%bash``, ``%%sh``,
  ``%%script``) ask the application first, through the tool server's ``POST /approve``
  (``tool_name`` ``"shell"`` with the expanded command, or ``"shell_magic"`` with the cell).
- ``IPYBOX_REQUIRE_SHELL_ESCAPE=1``: cell code that starts a process itself (``subprocess``,
  ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*``, ``pty.spawn``) gets an error
  telling it to use ``!``. Only direct calls from cell code are refused: libraries the cell
  calls, and IPython's own ``!``, still start processes. This is a Python-level
  guard: code can undo it, so it corrects an agent's habits and does not stop hostile code.
- ``IPYBOX_WORKING_DIR=path``: the kernel starts there, and after every cell that left it the
  working directory is put back (with a note in the cell's output).
- ``IPYBOX_EXIT_WITH_GATEWAY=path`` (sandboxed kernels): the kernel exits when the gateway that
  started it is gone, seen as the release of the lock the gateway holds on that file for its
  whole life. ipykernel's own parent check cannot work in the sandbox, where the gateway is
  out of sight.

Whatever the environment, output is kept free of colour codes, which an agent pays for in
tokens: ipykernel asks programs for colour (``FORCE_COLOR``, ``CLICOLOR_FORCE``,
``TERM=xterm-color``); the extension asks for none (``NO_COLOR``, ``TERM=dumb``).

Without those variables the extension changes nothing. Only the standard library and
``ipybox``'s kernel-side client are imported, so it adds little to a kernel's start.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any


def load_ipython_extension(ip: Any) -> None:
    """Set up the kernel as its environment asks (IPython's extension hook)."""
    environ = os.environ
    for name in _COLOUR_FORCING:
        environ.pop(name, None)
    environ.update(NO_COLOR="1", CLICOLOR="0", TERM="dumb")
    # The working directory is importable (generated `mcptools` live there), where IPython puts it
    # (before site-packages), but only now: ipybox itself, this extension included, was imported
    # from the environment, never from a package planted in the workspace.
    if "" not in sys.path:
        site = next((i for i, path in enumerate(sys.path) if path.endswith("site-packages")), len(sys.path))
        sys.path.insert(site, "")
    _hide_ipybox_frames(ip)
    working_dir = environ.pop("IPYBOX_WORKING_DIR", "")
    approve_shell = environ.pop("IPYBOX_APPROVE_SHELL", "") == "1"
    require_escape = environ.pop("IPYBOX_REQUIRE_SHELL_ESCAPE", "") == "1"
    gateway_lock = environ.pop("IPYBOX_EXIT_WITH_GATEWAY", "")
    if gateway_lock:
        _exit_with_gateway(gateway_lock)
    if working_dir:
        _keep_working_dir(ip, working_dir)
    if approve_shell:
        _approve_shell_commands(ip)
    if require_escape:
        _require_shell_escape(ip)


def _exit_with_gateway(lock_file: str) -> None:
    import fcntl
    import threading

    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return

    def watch() -> None:
        fcntl.flock(fd, fcntl.LOCK_SH)  # granted once the gateway's exclusive lock is gone
        os._exit(1)

    threading.Thread(target=watch, name="ipybox-gateway-watch", daemon=True).start()


_COLOUR_FORCING = ("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS", "TTY_COMPATIBLE")


def _hide_ipybox_frames(ip: Any) -> None:
    """Show an ipybox error (a rejected tool call, say) as the cell's line and the error.

    IPython leaves out frames marked ``__tracebackhide__`` but always shows the innermost
    one; for errors ipybox raises on purpose its own frames, innermost included, are only
    tokens an agent pays for. The exception object itself (its type, message and fields) is
    left as it is.
    """
    from ipybox.errors import IpyboxError

    def render(error: BaseException) -> Any:
        kept = []
        tb = error.__traceback__
        while tb is not None:
            if not tb.tb_frame.f_locals.get("__tracebackhide__"):
                kept.append(tb)
            tb = tb.tb_next
        trimmed = None
        for entry in reversed(kept):
            trimmed = TracebackType(trimmed, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        return ip.InteractiveTB.structured_traceback(type(error), error, trimmed)

    # IPython's hook for exceptions that format their own traceback.
    IpyboxError._render_traceback_ = render  # type: ignore[attr-defined]


def _keep_working_dir(ip: Any, working_dir: str) -> None:
    os.makedirs(working_dir, exist_ok=True)
    os.chdir(working_dir)

    def restore(result: object = None) -> None:
        try:
            current = os.getcwd()
        except FileNotFoundError:
            current = None
        if current == working_dir:
            return
        os.makedirs(working_dir, exist_ok=True)
        os.chdir(working_dir)
        where = "a directory that no longer exists" if current is None else current
        print(f"[ipybox] The cell left the working directory in {where}; it is back in {working_dir}.")

    ip.events.register("post_run_cell", restore)


def _escape(text: str) -> str:
    """Make `text` come out of IPython's variable expansion unchanged."""
    return text.replace("{", "{{").replace("}", "}}").replace("$", "$$")


def _ask(tool_name: str, tool_args: dict[str, str]) -> None:
    __tracebackhide__ = True
    from ipybox.errors import ToolRunnerError
    from ipybox.tool_exec.client import request_approval

    what = "shell command" if tool_name == "shell" else f"%%{tool_args.get('magic', 'script')} cell"
    try:
        request_approval(tool_name, tool_args)
    except ToolRunnerError as exc:
        if exc.kind == "rejected":
            message = f"The {what} was rejected by the application, so it did not run."
        elif exc.kind == "expired":
            message = (
                f"The {what} expired: the application made no approval decision in time, so it did not run."
            )
        else:
            message = f"The {what} did not run: {exc}"
        raise ToolRunnerError(message, exc.kind, "ipybox", tool_name) from None


def _approve_shell_commands(ip: Any) -> None:
    system, getoutput = ip.system, ip.getoutput

    def approved_system(cmd: str) -> None:
        __tracebackhide__ = True
        expanded = ip.var_expand(cmd, depth=1)
        _ask("shell", {"cmd": expanded})
        system(_escape(expanded))

    def approved_getoutput(cmd: str, split: bool = True, depth: int = 0) -> Any:
        __tracebackhide__ = True
        expanded = ip.var_expand(cmd, depth=depth + 1)
        _ask("shell", {"cmd": expanded})
        return getoutput(_escape(expanded), split=split)

    ip.system = approved_system
    ip.system_piped = approved_system
    ip.getoutput = approved_getoutput

    script_magics = ip.magics_manager.registry["ScriptMagics"]
    shebang = script_magics.shebang

    @functools.wraps(shebang)  # it parses its arguments with the parser attached to self.shebang
    def approved_shebang(line: str, cell: str) -> Any:
        __tracebackhide__ = True
        _ask("shell_magic", {"magic": line.split(maxsplit=1)[0] if line else "script", "cmd": cell})
        return shebang(line, cell)

    # %%bash, %%sh and the other named script magics call self.shebang; %%script is registered
    # as the bound method itself.
    script_magics.shebang = approved_shebang
    ip.magics_manager.magics["cell"]["script"] = approved_shebang


def _require_shell_escape(ip: Any) -> None:
    import asyncio
    import pty
    import subprocess

    cell_files = _CellFiles(ip)

    def guard(module: Any, name: str) -> None:
        original: Callable[..., Any] | None = getattr(module, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if cell_files.is_cell(sys._getframe(1)):
                raise _escape_error(f"{module.__name__}.{name}")
            return original(*args, **kwargs)

        setattr(module, name, guarded)

    for name in ("run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        guard(subprocess, name)
    for name in (
        "system", "popen", "posix_spawn", "posix_spawnp",
        "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
        "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    ):  # fmt: skip
        guard(os, name)
    guard(pty, "spawn")
    guard(asyncio, "create_subprocess_exec")
    guard(asyncio, "create_subprocess_shell")

    popen_init = subprocess.Popen.__init__

    @functools.wraps(popen_init)
    def guarded_popen_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        if cell_files.is_cell(sys._getframe(1)):
            raise _escape_error("subprocess.Popen")
        popen_init(self, *args, **kwargs)

    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]  # the guard wraps it


class _CellFiles:
    """Tells code compiled from a cell (or defined in one) from library code, by its file name."""

    def __init__(self, ip: Any) -> None:
        self._prefix = os.path.dirname(ip.compile.get_code_name("", "", 0)) + os.sep

    def is_cell(self, frame: FrameType | None) -> bool:
        if frame is None:
            return False
        filename = frame.f_code.co_filename
        return filename.startswith(self._prefix) or filename.startswith("<ipython-input-")


def _escape_error(what: str) -> Exception:
    from ipybox.errors import ShellEscapeRequiredError

    return ShellEscapeRequiredError(
        f"{what} is turned off in this kernel: run shell commands with IPython's shell escape "
        "instead, e.g. `!ls -l`, `files = !ls`, or a `%%bash` cell."
    )
