"""IPython extension loaded into every ipybox kernel: shell approval, shell-escape guard, working directory.

The kernel spec loads it at start (``--IPKernelApp.extensions``); what it does is set by
the kernel's environment, which `CodeExecutor` fills:

- ``IPYBOX_APPROVE_SHELL=1``: ``!cmd``, ``x = !cmd`` and script cells (``%%bash``, ``%%sh``,
  ``%%script``) ask the application first, through the tool server's ``POST /approve``
  (``tool_name`` ``"shell"`` with the expanded command, or ``"shell_magic"`` with the cell).
- ``IPYBOX_EXEC_WALL=1`` (a sandboxed kernel with ``IPYBOX_APPROVE_SHELL=1``, started by the
  launcher `_exec_wall`, which stops it and all it forks from starting a program): ``!cmd``,
  ``x = !cmd`` and script cells go to the tool server's ``POST /shell``, which asks the
  application and runs an accepted command in a sandbox of its own.
- ``IPYBOX_REQUIRE_SHELL_ESCAPE=1``: cell code that starts a process itself (``subprocess``,
  ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*``, ``pty.spawn``) gets an error
  telling it to use ``!``. Only direct calls from cell code are refused: libraries the cell
  calls, and IPython's own ``!``, still start processes. This is a Python-level
  guard: code can undo it, so it corrects an agent's habits and does not stop hostile code.
- ``IPYBOX_START_DIR=path``: the kernel starts there (the gateway that launches it runs in a
  folder of its own, so that no trusted process has a kernel-writable working directory).
- ``IPYBOX_WORKING_DIR=path``: the kernel starts there, and after every cell that left it the
  working directory is put back (with a note in the cell's output).
- ``IPYBOX_WARM_IMPORTS=a,b.c``: modules imported in a background thread once the kernel is in use
  and idle (`ipybox.kernel._warm`), so that the first cell needing them (a first plot) finds them loaded.

Whatever the environment: the folder of the kernel's own Python goes first on ``PATH`` (with a
``pip`` that is uv's pip interface for it when it has no pip), so that ``!python``, ``!pip`` and
``%pip`` reach it; tracebacks leave out every frame marked ``__tracebackhide__`` and show a
cell's own lines right; figures a cell left open under a backend that only draws to files
(``Agg``) come back as PNGs, as the inline backend's do. And output is kept free of colour
codes, which an agent pays for in tokens: ipykernel asks programs for colour (``FORCE_COLOR``,
``CLICOLOR_FORCE``, ``TERM=xterm-color``); the extension asks for none (``NO_COLOR``,
``TERM=dumb``).

Without those variables the extension changes nothing else. Only the standard library and
``ipybox``'s kernel-side client are imported, so it adds little to a kernel's start. The shell
parts (approval, the walled commands, the escape guard) live in `ipybox.kernel._ext_shell`,
imported only by a kernel that turns one on.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from ipybox._wire import KernelEnv


def load_ipython_extension(ip: Any) -> None:
    """Set up the kernel as its environment asks (IPython's extension hook)."""
    environ = os.environ
    for name in _COLOUR_FORCING:
        environ.pop(name, None)
    environ.update(NO_COLOR="1", CLICOLOR="0", TERM="dumb")
    start_dir = environ.pop(KernelEnv.START_DIR, "")
    if start_dir:
        os.chdir(start_dir)
    # The working directory is importable (generated `mcptools` live there), where IPython puts it
    # (before site-packages), but only now: ipybox itself, this extension included, was imported
    # from the environment, never from a package planted in the workspace.
    if "" not in sys.path:
        site = next((i for i, path in enumerate(sys.path) if path.endswith("site-packages")), len(sys.path))
        sys.path.insert(site, "")
    _hide_marked_frames(ip)
    _count_cell_lines()
    _bound_output_messages()
    _keep_no_output_history(ip)
    _reply_to_every_interrupt(ip)
    _show_figures_of_file_backends(ip)
    _own_python_first(ip)
    working_dir = environ.pop(KernelEnv.WORKING_DIR, "")
    approve_shell = environ.pop(KernelEnv.APPROVE_SHELL, "") == "1"
    require_escape = environ.pop(KernelEnv.REQUIRE_SHELL_ESCAPE, "") == "1"
    if working_dir:
        _keep_working_dir(ip, working_dir)
    exec_wall = environ.pop(KernelEnv.EXEC_WALL, "") == "1"
    # The shell half is imported only by a kernel that uses it, so that others start no slower.
    if exec_wall:
        from ipybox.kernel._ext_shell import _wall_shell_commands

        _wall_shell_commands(ip)
    elif approve_shell:
        from ipybox.kernel._ext_shell import _approve_shell_commands

        _approve_shell_commands(ip)
    if require_escape:
        from ipybox.kernel._ext_shell import _require_shell_escape

        _require_shell_escape(ip)
    warm_imports = environ.pop(KernelEnv.WARM_IMPORTS, "")
    if warm_imports:
        from ipybox.kernel import _warm

        _warm.start(warm_imports, ip)


def _reply_to_every_interrupt(ip: Any) -> None:
    """Answer every execution, wherever an interrupt lands in it.

    ipykernel takes SIGINT as ``KeyboardInterrupt`` for the whole time it handles a request. One
    that lands outside the cell's own code (just after the request was announced, in IPython's
    hooks, while Python compiles the cell, where CPython 3.11 turns it into a ``SystemError``, or
    while the reply is flushed) escapes the handler, which ipykernel logs and drops: the request
    got no reply, and the client waited until its timeout (a cancel right after submitting hung
    this way under load). Here an interrupt outside `do_execute` is only noted, one noted before
    the cell starts stops it at once, and whatever escapes `do_execute` becomes the request's
    error reply, named ``KeyboardInterrupt`` when an interrupt arrived. IPython's hooks
    (``pre_execute``, ``pre_run_cell``, ...) run after the request was announced and swallow a
    ``KeyboardInterrupt`` raised in one ("Error in callback"), then ran the cell anyway; an
    interrupt landing in a hook is held until the hooks are done and raised then, outside them.
    """
    kernel = getattr(ip, "kernel", None)
    execute = getattr(kernel, "do_execute", None)
    if kernel is None or execute is None or not hasattr(kernel, "pre_handler_hook"):
        return
    replies = _InterruptReplies(kernel, execute, ip.events.trigger)
    kernel.pre_handler_hook = replies.pre_handler_hook
    kernel.do_execute = replies.do_execute
    ip.events.trigger = replies.trigger_then_interrupt


class _InterruptReplies:
    """The handlers `_reply_to_every_interrupt` puts in a kernel, and the state they share."""

    def __init__(self, kernel: Any, execute: Any, trigger: Any) -> None:
        self.kernel, self.execute, self.trigger = kernel, execute, trigger
        self.noted = False  # an interrupt arrived after the request was announced
        self.in_hooks = False  # IPython's event hooks are running
        self.held = False  # an interrupt arrived in a hook, raised once the hooks are done

    def trigger_then_interrupt(self, event: str, *args: Any, **kwargs: Any) -> None:
        if self.in_hooks:  # a hook that triggers another event
            self.trigger(event, *args, **kwargs)
            return
        self.in_hooks, self.held = True, False
        try:
            self.trigger(event, *args, **kwargs)
        finally:
            self.in_hooks = False
        if self.held:
            self.held = False
            raise KeyboardInterrupt

    def note(self, signum: int, frame: FrameType | None) -> None:
        self.noted = True

    def pre_handler_hook(self) -> None:
        self.noted = False
        self.kernel.saved_sigint_handler = signal.signal(signal.SIGINT, self.note)

    async def do_execute(self, *args: Any, **kwargs: Any) -> Any:
        interrupted = False

        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            nonlocal interrupted
            interrupted = True
            if self.in_hooks:
                self.held = True
                return
            raise KeyboardInterrupt

        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.signal(signal.SIGINT, on_interrupt)
        try:
            if self.noted:  # arrived after the request was announced, before the cell started
                interrupted = True
                raise KeyboardInterrupt
            return await self.execute(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as exc:  # broad: a request must never go unanswered
            return _stopped_reply(self.kernel, exc, interrupted)
        finally:
            if main:
                signal.signal(signal.SIGINT, self.note)


def _stopped_reply(kernel: Any, exc: BaseException, interrupted: bool) -> dict[str, Any]:
    """The error reply of an execution that `exc` stopped outside the cell's code."""
    name = "KeyboardInterrupt" if interrupted or isinstance(exc, KeyboardInterrupt) else type(exc).__name__
    return {
        "status": "error",
        "execution_count": getattr(kernel, "execution_count", None),
        "ename": name,
        "evalue": f"the execution was stopped outside the cell's code ({type(exc).__name__})",
        "traceback": [f"{name}: the execution was stopped outside the cell's code"],
        "user_expressions": {},
        "payload": [],
    }


# Output a cell writes is sent at least every this many characters, whatever the load.
_OUTPUT_FLUSH_CHARS = 1 << 20


def _bound_output_messages() -> None:
    """Keep each output message of stdout and stderr near `_OUTPUT_FLUSH_CHARS`.

    ipykernel collects what a cell writes and sends it from its IO thread 0.2 s later; a cell that
    writes in a tight loop on a busy machine keeps that thread from running, and one message grew
    past the 64 MiB the application reads (and took the kernel's state with it); so did one print of
    that size. Writes go out in pieces of at most that size, flushed once that much is pending,
    so the application reads each whole and keeps the cell's head and tail. (Kernel code can undo
    this; the application then refuses the oversized message unread, as it must.)
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "pub_thread") and hasattr(stream, "flush"):
            _flush_every(stream)


def _flush_every(stream: Any) -> None:
    write = stream.write
    pending = 0

    def bounded_write(text: str) -> Any:
        nonlocal pending
        if not isinstance(text, str):
            return write(text)  # ipykernel's own TypeError
        if pending + len(text) < _OUTPUT_FLUSH_CHARS:  # most writes: no piece fills up
            write(text)
            pending += len(text)
            return len(text)
        # One large write goes out in pieces too: the application keeps a cell's head and tail.
        for start in range(0, len(text), _OUTPUT_FLUSH_CHARS):
            piece = text[start : start + _OUTPUT_FLUSH_CHARS]
            write(piece)
            pending += len(piece)
            if pending >= _OUTPUT_FLUSH_CHARS:
                pending = 0
                stream.flush()
        return len(text)

    stream.write = bounded_write


def _keep_no_output_history(ip: Any) -> None:
    """Keep no copy of what cells print or display in the kernel.

    IPython 9 records every write to stdout and stderr, and every result and display, of every
    cell in its history manager's ``outputs`` (for ``%history -o``), history database or not: a
    session's kernel held all the output it ever sent (40 MiB after 20 cells of 2 MiB), which a
    memory limit then charged to the kernel, and the recording wrapper ran on each write. The
    wrapper of stdout and stderr is left out, and what is recorded otherwise (results and
    displays) is dropped after each execution. Older IPythons have neither and are left as they are.
    """
    import contextlib

    history = getattr(ip, "history_manager", None)
    outputs = getattr(history, "outputs", None)
    if not hasattr(ip, "_tee") or not isinstance(outputs, dict):
        return
    ip._tee = lambda channel: contextlib.nullcontext()
    ip.events.register("post_execute", lambda: ip.history_manager.outputs.clear())


_COLOUR_FORCING = ("FORCE_COLOR", "CLICOLOR_FORCE", "PY_COLORS", "TTY_COMPATIBLE")


def _hide_marked_frames(ip: Any) -> None:
    """Leave every frame marked ``__tracebackhide__`` out of tracebacks, the innermost one too.

    IPython leaves out marked frames but always shows the innermost one, so an error raised on
    purpose by ipybox (a rejected tool call) or by Pydantic (a ``Params`` that does not validate,
    raised in ``BaseModel.__init__``) came with a frame of library code, which tells an agent
    nothing and costs it tokens. The cell's own frames are never marked, so at least the cell's
    line stays; the exception object itself is left as it is.
    """
    formatter = ip.InteractiveTB
    structured_traceback = formatter.structured_traceback

    def without_marked_frames(
        etype: Any, evalue: Any = None, etb: Any = None, tb_offset: int | None = None, context: int = 5
    ) -> Any:
        if isinstance(etb, TracebackType):
            etb = _trim(etb, formatter.tb_offset if tb_offset is None else tb_offset)
        return structured_traceback(etype, evalue, etb, tb_offset, context)

    formatter.structured_traceback = without_marked_frames


def _own_python_first(ip: Any) -> None:
    """Make ``!python``, ``!pip`` and ``%pip`` reach this kernel's own Python.

    The kernel gets the application's ``PATH``, on which ``python`` and ``pip`` may well be
    another interpreter's (the application's environment need not be activated): a package
    ``!pip`` installed there cannot be imported here. The folder of the kernel's interpreter
    goes first. An environment made by uv has no pip: then ``pip`` (``!pip``, ``%pip``) is uv's
    pip interface aimed at this Python, or, without uv, a command that says so.
    """
    from importlib.machinery import PathFinder

    folder = os.path.dirname(sys.executable)
    first = [folder]
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""
    installed = [entry for entry in sys.path if entry and entry != cwd]  # not a pip.py in the working dir
    if PathFinder.find_spec("pip", installed) is None:
        try:
            first.append(_pip_shim())
        except OSError:  # no writable temporary folder: `pip` stays whatever PATH finds
            pass

        def pip(line: str) -> None:
            """Run pip for this kernel's Python (uv's pip interface: this Python has no pip)."""
            ip.system(f"pip {line}")

        ip.register_magic_function(pip, "line", "pip")
    rest = [entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry and entry not in first]
    os.environ["PATH"] = os.pathsep.join(first + rest)


_PIP_SHIM = """#!{python} -I
# pip for the kernel's Python, which has no pip of its own: uv's pip interface, aimed at it.
import os
import sys

UV, PYTHON = {uv!r}, {python!r}
args = sys.argv[1:]
if UV is None:
    sys.exit(
        f"pip: this kernel's Python ({{PYTHON}}) has no pip, and uv was not found; install uv "
        "(https://docs.astral.sh/uv/), or packages with the application (install_package)."
    )
if args and args[0] in ("--version", "-V"):  # uv's pip has no such option; say what pip is here
    import subprocess

    uv = subprocess.run([UV, "--version"], capture_output=True, text=True).stdout.strip() or UV
    version = "{{}}.{{}}".format(*sys.version_info[:2])
    print(f"{{uv}} (its pip interface) for {{PYTHON}} (python {{version}}); this Python has no pip of its own")
    sys.exit(0)
if not args or args[0].startswith("-"):
    os.execv(UV, [UV, "pip", *args])
if args[0] == "uninstall":  # uv never asks
    args = [arg for arg in args if arg not in ("-y", "--yes")]
os.execv(UV, [UV, "pip", args[0], "--python", PYTHON, *args[1:]])
"""


def _pip_shim() -> str:
    """A private folder with ``pip`` and ``pip3`` for this kernel's Python; removed at exit."""
    import atexit
    import shutil
    import tempfile

    home = os.path.expanduser("~")
    candidates = [
        shutil.which("uv"),
        os.path.join(os.path.dirname(sys.executable), "uv"),
        os.path.join(home, ".local", "bin", "uv"),
        os.path.join(home, ".cargo", "bin", "uv"),
    ]
    uv = next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
    folder = tempfile.mkdtemp(prefix="ipybox-pip-")
    atexit.register(shutil.rmtree, folder, True)
    script = _PIP_SHIM.format(python=sys.executable, uv=uv)
    for name in ("pip", "pip3"):
        path = os.path.join(folder, name)
        with open(path, "w") as file:
            file.write(script)
        os.chmod(path, 0o755)
    return folder


# matplotlib's backends that draw to files only: plt.show() does nothing with them.
_FILE_BACKENDS = frozenset({"agg", "cairo", "pdf", "pgf", "ps", "svg", "template"})


def _show_figures_of_file_backends(ip: Any) -> None:
    """Return the figures a cell left open, as PNGs, when it picked a backend that cannot show them.

    The kernel's own backend (inline) shows every figure still open when a cell ends, and closes
    it. Code often picks ``matplotlib.use("Agg")`` instead, and then its ``plt.show()`` shows
    nothing; the agent expects its figure back whatever backend it picked, so the same is done
    for these backends. Nothing is imported until a cell has imported pyplot.
    """

    def show_open_figures(result: object = None) -> None:
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            backend = str(pyplot.get_backend()).lower()
            numbers = list(pyplot.get_fignums())
        except Exception:  # broad: a broken matplotlib set-up in the kernel must not fail the cell
            return
        if backend not in _FILE_BACKENDS or not numbers:
            return
        import io

        from IPython.display import Image, display

        for number in numbers:
            png = io.BytesIO()
            try:
                pyplot.figure(number).savefig(png, format="png", bbox_inches="tight")
            except Exception as exc:  # a figure that cannot be drawn must not hide the others
                print(f"[ipybox] Figure {number} could not be drawn: {exc}")
                continue
            display(Image(data=png.getvalue(), format="png"))  # type: ignore[no-untyped-call]  # IPython is untyped
        pyplot.close("all")

    ip.events.register("post_run_cell", show_open_figures)


def _count_cell_lines() -> None:
    """Show a cell's frames from the cell's source, as IPython does outside a kernel.

    ipykernel names a cell's code after a ``.py`` file that is never written; IPython then fails
    to count that file's lines and formats the frame on its fast path, which finds a frame's
    source with ``inspect`` and, for a comprehension, shows the lines of the ``def`` above it
    numbered as the comprehension's. The cell's source is in ``linecache``: counted from there,
    the frame goes through ``stack_data``, which shows the right lines.
    """
    import linecache

    from IPython.core import ultratb

    count = getattr(ultratb, "get_line_number_of_frame", None)
    if count is None:
        return

    def count_with_cells(frame: FrameType) -> int:
        entry = linecache.cache.get(frame.f_code.co_filename)
        if entry is not None and len(entry) == 4 and entry[1] is None:  # IPython's cells have no mtime
            return len(entry[2])
        result: int = count(frame)
        return result

    # Replaced where ultratb looks it up (it imports the name from IPython.core.tbtools).
    setattr(ultratb, "get_line_number_of_frame", count_with_cells)  # noqa: B010


def _trim(etb: TracebackType, offset: int) -> TracebackType:
    entries = []
    tb: TracebackType | None = etb
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    # The first `offset` frames are IPython's own, which the formatter skips by count.
    head, rest = entries[:offset], entries[offset:]
    kept = [entry for entry in rest if not entry.tb_frame.f_locals.get("__tracebackhide__")]
    if not kept or len(kept) == len(rest):
        return etb
    trimmed = None
    for entry in reversed(head + kept):
        trimmed = TracebackType(trimmed, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    assert trimmed is not None
    return trimmed


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
