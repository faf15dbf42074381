"""Shell commands in the kernel: approval of ``!cmd`` and script cells, and the shell-escape guard.

Inside the kernel, beside the agent's code: standard library only (and the kernel's own
IPython). `ipybox.kernel._ext` puts these in place at the kernel's start, as its environment
asks: ``IPYBOX_APPROVE_SHELL=1`` (`_approve_shell_commands`: ask the tool server, then run
here), ``IPYBOX_EXEC_WALL=1`` (`_wall_shell_commands`: the tool server runs each command once
approved) and ``IPYBOX_REQUIRE_SHELL_ESCAPE=1`` (`_require_shell_escape`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from ipybox._wire import ShellAnswerFields, ShellFields


def _escape(text: str) -> str:
    """Make `text` come out of IPython's variable expansion unchanged."""
    return text.replace("{", "{{").replace("}", "}}").replace("$", "$$")


def _ask(tool_name: str, tool_args: dict[str, Any]) -> None:
    __tracebackhide__ = True
    from ipybox.errors import ToolRunnerError
    from ipybox.kernel._tool_client import request_approval

    what = "shell command" if tool_name == ShellFields.SHELL else f"%%{tool_args.get('magic', 'script')} cell"
    try:
        request_approval(tool_name, tool_args)
    except ToolRunnerError as exc:
        raise _not_run(exc, what, tool_name) from None


def _not_run(exc: Any, what: str, tool_name: str) -> Exception:
    """The error for a shell command that did not run, from the tool server's `exc`."""
    from ipybox.errors import ToolRunnerError

    _, refused, by = str(exc).partition(" was refused by ")
    if exc.kind == "rejected" and refused and by.startswith(("policy ", "the policy's ")):
        message = f"The {what} was refused by {by.rstrip('.')}, so it did not run."
    elif exc.kind == "rejected":
        message = f"The {what} was rejected by the application, so it did not run."
    elif exc.kind == "expired":
        message = f"The {what} expired: the application made no approval decision in time, so it did not run."
    else:
        message = f"The {what} did not run: {exc}"
    return ToolRunnerError(message, exc.kind, "ipybox", tool_name)


def _approve_shell_commands(ip: Any) -> None:
    from IPython.utils._process_common import arg_split

    system, getoutput = ip.system, ip.getoutput

    def approved_system(cmd: str) -> None:
        __tracebackhide__ = True
        expanded = ip.var_expand(cmd, depth=1)
        _ask(ShellFields.SHELL, {"cmd": expanded})
        system(_escape(expanded))

    def approved_getoutput(cmd: str, split: bool = True, depth: int = 0) -> Any:
        __tracebackhide__ = True
        expanded = ip.var_expand(cmd, depth=depth + 1)
        _ask(ShellFields.SHELL, {"cmd": expanded})
        return getoutput(_escape(expanded), split=split)

    ip.system = approved_system
    ip.system_piped = approved_system
    ip.getoutput = approved_getoutput

    script_magics = ip.magics_manager.registry["ScriptMagics"]
    shebang = script_magics.shebang

    @functools.wraps(shebang)  # it parses its arguments with the parser attached to self.shebang
    def approved_shebang(line: str, cell: str) -> Any:
        __tracebackhide__ = True
        # The program and every argument it gets (`%%script bash -c '...'` runs the -c, not the cell).
        argv = shebang.parser.parse_known_args(arg_split(line, posix=True))[1] or ["script"]
        tool_args: dict[str, Any] = {"magic": argv[0], "cmd": cell}
        if argv[1:]:
            tool_args["args"] = argv[1:]
        _ask(ShellFields.SHELL_MAGIC, tool_args)
        return shebang(line, cell)

    # %%bash, %%sh and the other named script magics call self.shebang; %%script is registered
    # as the bound method itself.
    script_magics.shebang = approved_shebang
    ip.magics_manager.magics["cell"]["script"] = approved_shebang


def _run_walled(tool_name: str, cmd: str, argv: list[str] | None = None) -> dict[str, Any]:
    """Run `cmd` on the tool server, once approved; its answer (see ``ipybox.tool_exec.client.run_shell``)."""
    __tracebackhide__ = True
    from ipybox.errors import ToolRunnerError
    from ipybox.kernel._tool_client import run_shell

    what = "shell command" if argv is None else f"%%{os.path.basename(argv[0])} cell"
    try:
        result = run_shell(tool_name, cmd, argv)
    except ToolRunnerError as exc:
        raise _not_run(exc, what, tool_name) from None
    if stopped := result.get(ShellAnswerFields.STOPPED):
        print(f"[ipybox] The {what} was stopped: {stopped}.", file=sys.stderr)
    return result


def _wall_shell_commands(ip: Any) -> None:
    """``!cmd``, ``x = !cmd`` and script cells, for a kernel that cannot start programs: each runs on
    the tool server once approved, and its output comes back when it ends (not while it runs)."""
    import subprocess

    from IPython.core.error import UsageError
    from IPython.utils._process_common import arg_split
    from IPython.utils.text import LSString, SList

    def walled_system(cmd: str) -> None:
        __tracebackhide__ = True
        result = _run_walled(ShellFields.SHELL, ip.var_expand(cmd, depth=1))
        sys.stdout.write(result[ShellAnswerFields.STDOUT])
        sys.stdout.flush()
        ip.user_ns["_exit_code"] = result[ShellAnswerFields.EXIT_CODE]

    def walled_getoutput(cmd: str, split: bool = True, depth: int = 0) -> Any:
        __tracebackhide__ = True
        output = _run_walled(ShellFields.SHELL, ip.var_expand(cmd, depth=depth + 1))[ShellAnswerFields.STDOUT]
        return SList(output.splitlines()) if split else LSString(output)

    ip.system = walled_system
    ip.system_piped = walled_system
    ip.getoutput = walled_getoutput

    script_magics = ip.magics_manager.registry["ScriptMagics"]
    shebang = script_magics.shebang

    @functools.wraps(shebang)  # it parses its arguments with the parser attached to self.shebang
    def walled_shebang(line: str, cell: str) -> Any:
        __tracebackhide__ = True
        args, argv = shebang.parser.parse_known_args(arg_split(line, posix=True))
        if args.bg or args.proc:
            raise UsageError(
                "--bg and --proc are not available in this kernel: its shell commands run, once approved, "
                "outside it; run the cell without them."
            )
        if not argv:
            raise UsageError("%%script needs the program to run the cell with, e.g. `%%script bash`.")
        result = _run_walled(ShellFields.SHELL_MAGIC, cell if cell.endswith("\n") else cell + "\n", argv)
        if args.out:
            ip.user_ns[args.out] = result[ShellAnswerFields.STDOUT]
        else:
            sys.stdout.write(result[ShellAnswerFields.STDOUT])
            sys.stdout.flush()
        if args.err:
            ip.user_ns[args.err] = result[ShellAnswerFields.STDERR]
        else:
            sys.stderr.write(result[ShellAnswerFields.STDERR])
            sys.stderr.flush()
        if args.raise_error and result[ShellAnswerFields.EXIT_CODE] != 0:
            raise subprocess.CalledProcessError(result[ShellAnswerFields.EXIT_CODE] or -9, cell)

    script_magics.shebang = walled_shebang
    ip.magics_manager.magics["cell"]["script"] = walled_shebang


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
