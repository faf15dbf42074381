"""Approved shell commands of a walled kernel, run by the tool server in a sandbox of their own.

A sandboxed kernel whose shell commands need approval cannot start a program itself (its
seccomp filter, ``ipybox.kernel._exec_wall``). It sends each ``!cmd``, ``x = !cmd`` and
``%%bash`` cell to the tool server (``POST /shell``); once the application accepts it, the
command runs here in a new ``srt`` sandbox with the kernel's settings, in the kernel's current
folder, with the kernel's starting environment, its program found by absolute path on the
runner's own ``PATH``, and with temporary, IPython, Jupyter and cache folders of its own that
no other command (of this executor or another) can see. srt itself runs
in the gateway's private folder with an environment the application chose: nothing the kernel
sends reaches srt, bwrap or node, only the shell inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive

from ipybox._infra import disconnected, kill_tree
from ipybox._wire import ShellFields
from ipybox.gateway import _kernel_launch

__all__ = [
    "KernelConfinement",
    "ShellProgramError",
    "ShellRequest",
    "ShellResult",
    "ShellRunner",
    "run_while_connected",
    "shell_call",
]

DEFAULT_SHELL_TIMEOUT = 3600.0
DEFAULT_MAX_SHELL_OUTPUT = 4 * 1024 * 1024


_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
# A shell reads its whole script cell from stdin, then runs it.
_READ_WHOLE = 'eval "$(cat)"'


class ShellProgramError(ValueError):
    """An approved command's program cannot be run as given (a path the kernel chose, or unknown)."""


def _remove(folder: Path, settings_file: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    settings_file.unlink(missing_ok=True)


@dataclass(frozen=True)
class ShellResult:
    """What a command wrote (each stream cut at the runner's limit) and how it ended."""

    stdout: bytes
    stderr: bytes
    exit_code: int
    # Why the command was stopped before it ended by itself, if it was.
    stopped: str | None = None


@dataclass(frozen=True)
class ShellRunner:
    """How to run a kernel's approved commands: the kernel's sandbox, started anew for each.

    Args:
        srt: The ``srt`` command.
        settings_file: The kernel's srt settings.
        tmp_dir: The kernels' shared temporary folder: each command gets a new folder beside it
            instead (``TMPDIR`` and every variable that named it point there), removed when it ends.
        start_dir: Where srt starts: a folder the kernel cannot write.
        env: srt's environment (the kernel's starting one), chosen by the application.
        path: ``PATH`` inside the sandbox: folders the kernel cannot write.
        timeout: Seconds a command may run; then it is killed.
        max_output: Bytes kept of each of stdout and stderr; a command that writes more is stopped.
    """

    srt: str
    settings_file: Path
    tmp_dir: Path
    start_dir: Path
    env: dict[str, str]
    path: str
    timeout: float = DEFAULT_SHELL_TIMEOUT
    max_output: int = DEFAULT_MAX_SHELL_OUTPUT

    def resolve(self, argv: list[str], stdin: bytes | None) -> tuple[list[str], bytes | None]:
        """The program line to run, its program given by an absolute path found on the runner's
        ``PATH``, and what it reads on stdin.

        A program the kernel names by a path is refused unless it lies in one of those folders: a
        ``%%script ./bash`` would otherwise run whatever the kernel put there. A shell reads a script
        cell whole before running it (``eval "$(cat)"``), not line by line from stdin, where a
        command of the cell could read the rest of the script (``head -c 4``) and make the shell run
        another command than the one approved.

        Raises:
            ShellProgramError: The program is given by a path elsewhere, or is not on ``PATH``.
        """
        program, folders = argv[0], self.path.split(os.pathsep)
        if "/" in program:
            if not os.path.isabs(program) or os.path.dirname(os.path.normpath(program)) not in folders:
                raise ShellProgramError(
                    f"The program {program!r} is given by a path outside the folders approved commands run "
                    f"programs from ({self.path}); name it instead (e.g. `%%script bash`)."
                )
            found: str | None = os.path.normpath(program)
        else:
            found = shutil.which(program, path=self.path)
        if found is None:
            raise ShellProgramError(
                f"The program {program!r} is not in any of {self.path}; name one that is."
            )
        if stdin is not None and len(argv) == 1 and os.path.basename(program) in _SHELLS:
            # The whole cell is read before any of it runs, then run as `-c` would run it; its
            # commands find their stdin at its end (any argument could be too long for -c).
            return [found, "-c", _READ_WHOLE], stdin
        return [found, *argv[1:]], stdin

    def command(
        self, argv: list[str], cwd: str, settings_file: Path | None = None, tmp_dir: Path | None = None
    ) -> list[str]:
        """The srt command that runs `argv` in `cwd` inside the sandbox.

        `cwd` comes from the kernel: the shell inside the sandbox changes to it, and can do no
        more there than the kernel could. ``PATH`` is the runner's, never the kernel's: an
        approved ``ls`` is not a program the kernel planted in a folder of its own.
        """
        tmp = tmp_dir or self.tmp_dir
        inner = f"cd {shlex.quote(cwd)} && TMPDIR={shlex.quote(str(tmp))} PATH={shlex.quote(self.path)}"
        inner += f" exec {shlex.join(argv)}"
        # In an IPC namespace of its own, like the kernel's (srt's bwrap shares the host's).
        return _kernel_launch.in_own_ipc_namespace(
            [self.srt, "--settings", str(settings_file or self.settings_file), "-c", inner]
        )

    def _own_folder(self) -> tuple[Path, Path, dict[str, str]]:
        """A new folder for one command, beside the shared temporary folder: its srt settings (that
        folder writable instead of the shared one) and srt's environment (every variable that
        named the shared folder pointed into it: TMPDIR, IPYTHONDIR, the Jupyter folders, caches).

        No approved command writes where another executor's (or its own next) command reads:
        an IPython startup file written by one would otherwise run in the other's ``python -m IPython``.
        """
        folder = Path(tempfile.mkdtemp(prefix="sh-", dir=self.tmp_dir.parent))
        (folder / "tmp").mkdir(mode=0o700)
        shared = str(self.tmp_dir)
        settings = json.loads(self.settings_file.read_text())
        filesystem = settings["filesystem"]
        kept = [p for p in filesystem["allowWrite"] if Path(p).resolve() != self.tmp_dir.resolve()]
        filesystem["allowWrite"] = [*kept, str(folder)]
        own = folder.with_name(folder.name + ".json")  # beside the folder, out of the command's reach
        partial = own.with_name(own.name + ".partial")
        partial.write_text(json.dumps(settings))
        partial.replace(own)
        tmp = str(folder / "tmp")
        env = {
            key: tmp + value[len(shared) :] if value == shared or value.startswith(shared + os.sep) else value
            for key, value in self.env.items()
        }
        env["TMPDIR"] = str(folder)  # srt's own sockets; the command's TMPDIR is `tmp` inside
        return folder, own, env

    async def run(self, argv: list[str], *, cwd: str, stdin: bytes | None, merge: bool) -> ShellResult:
        """Run `argv` to its end (or its timeout, or its output limit) and return what it wrote.

        Each command runs with folders of its own (`_own_folder`), removed when it ends.

        Args:
            argv: The program and its arguments.
            cwd: The folder to run it in, inside the sandbox.
            stdin: What the program reads (a ``%%bash`` cell), or ``None`` for nothing.
            merge: Whether stderr goes to stdout, interleaved (as ``!cmd`` shows them).

        Raises:
            ShellProgramError: See `resolve`.
        """
        argv, stdin = self.resolve(argv, stdin)
        folder, settings_file, env = await asyncio.to_thread(self._own_folder)
        try:
            return await self._run(argv, cwd, stdin, merge, (folder, settings_file, env))
        finally:
            await asyncio.shield(asyncio.to_thread(_remove, folder, settings_file))

    async def _run(
        self,
        argv: list[str],
        cwd: str,
        stdin: bytes | None,
        merge: bool,
        own: tuple[Path, Path, dict[str, str]],
    ) -> ShellResult:
        folder, settings_file, env = own
        process = await asyncio.create_subprocess_exec(
            *self.command(argv, cwd, settings_file, folder / "tmp"),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge else asyncio.subprocess.PIPE,
            env=env,
            cwd=self.start_dir,
            start_new_session=True,
        )
        over = asyncio.Event()

        async def read(stream: asyncio.StreamReader | None) -> bytes:
            # Read to the end (the pipe closes once the command is killed); keep up to the limit.
            if stream is None:
                return b""
            parts: list[bytes] = []
            size = 0
            while chunk := await stream.read(65536):
                if size + len(chunk) > self.max_output:
                    over.set()
                kept = chunk[: max(0, self.max_output - size)]
                parts.append(kept)
                size += len(kept)
            return b"".join(parts)

        async def feed() -> None:
            if process.stdin is None or stdin is None:
                return
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(stdin)
                await process.stdin.drain()
            process.stdin.close()

        readers: asyncio.Future[Any] = asyncio.gather(read(process.stdout), read(process.stderr), feed())
        stopped: str | None = None
        waiter: asyncio.Future[Any] = asyncio.ensure_future(over.wait())
        try:
            done, _ = await asyncio.wait(
                {readers, waiter}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if over.is_set() or readers not in done:
                stopped = (
                    f"it wrote more than {self.max_output} bytes"
                    if over.is_set()
                    else f"it ran longer than {self.timeout:g} s"
                )
                # srt, bwrap and what runs inside: the command leads a session of its own.
                await kill_tree(process.pid, group=True)
            stdout, stderr, _ = await readers
            exit_code = await process.wait()
        finally:
            waiter.cancel()
            if process.returncode is None:  # cancelled: the kernel went away, or the server stops
                await kill_tree(process.pid, group=True)
                with contextlib.suppress(ProcessLookupError):
                    await asyncio.shield(process.wait())
        return ShellResult(stdout, stderr, exit_code, stopped)


@dataclass(frozen=True)
class KernelConfinement:
    """What the trusted side must know of a gateway's sandboxed kernels, as the gateway started them.

    The gateway makes one at each start (`KernelGateway.confinement`); the tool server is handed it
    (`ToolServer.confine`) and refuses to run a stdio MCP server from where a kernel writes.

    Attributes:
        writable: Folders a sandboxed kernel can write (empty: not sandboxed).
        readonly: Paths inside those that the kernel's sandbox keeps read-only.
        shell_runner: Runs the approved shell commands of a kernel that cannot start programs
            (``None``: the kernel starts its own, or none at all).
    """

    writable: tuple[Path, ...] = ()
    readonly: tuple[Path, ...] = ()
    shell_runner: ShellRunner | None = None


class ShellRequest(BaseModel):
    """The body of ``POST /shell``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["shell", "shell_magic"]
    # The command line (``shell``), or the cell fed to the program on stdin (``shell_magic``).
    cmd: str
    # The cell magic's program and its arguments (``shell_magic`` only).
    argv: list[str] | None = None
    cwd: str = Field(min_length=1)


def shell_call(body: ShellRequest) -> tuple[dict[str, Any], list[str]]:
    """The arguments a shell request is approved with, and the program line it runs."""
    if body.kind == ShellFields.SHELL:
        return {"cmd": body.cmd}, ["sh", "-c", body.cmd]  # sh as found on the runner's PATH
    assert body.argv is not None
    tool_args: dict[str, Any] = {"magic": body.argv[0], "cmd": body.cmd}
    if body.argv[1:]:
        tool_args["args"] = body.argv[1:]
    return tool_args, body.argv


async def run_while_connected(
    runner: ShellRunner, body: ShellRequest, argv: list[str], receive: Receive
) -> asyncio.Future[ShellResult]:
    """Run an approved shell request; it is cancelled if the kernel closes the connection first."""
    cell = body.cmd.encode() if body.kind == ShellFields.SHELL_MAGIC else None
    running = asyncio.ensure_future(
        runner.run(argv, cwd=body.cwd, stdin=cell, merge=body.kind == ShellFields.SHELL)
    )
    # The kernel closes the connection when its cell is interrupted: the command stops with it.
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({running, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    return running
