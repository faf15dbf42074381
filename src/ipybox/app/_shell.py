"""Approved shell commands of a walled kernel, run by the tool server in a sandbox of their own.

A sandboxed kernel whose shell commands need approval cannot start a program itself (its
seccomp filter, ``ipybox.kernel._exec_wall``). It sends each ``!cmd``, ``x = !cmd`` and
``%%bash`` cell to the tool server (``POST /shell``); once the application accepts it, the
command runs here in a new ``srt`` sandbox with the kernel's own settings file and temporary
folder, in the kernel's current folder, with the kernel's starting environment. srt itself runs
in the gateway's private folder with an environment the application chose: nothing the kernel
sends reaches srt, bwrap or node, only the shell inside the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive

from ipybox._infra import kill_tree
from ipybox._wire import ShellFields
from ipybox.app._tool_http import _disconnected
from ipybox.gateway import _kernel_launch

__all__ = ["KernelConfinement", "ShellResult", "ShellRunner"]

DEFAULT_SHELL_TIMEOUT = 3600.0
DEFAULT_MAX_SHELL_OUTPUT = 4 * 1024 * 1024


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
        tmp_dir: The kernel's temporary folder (``TMPDIR`` inside).
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

    def command(self, argv: list[str], cwd: str) -> list[str]:
        """The srt command that runs `argv` in `cwd` inside the sandbox.

        `cwd` comes from the kernel: the shell inside the sandbox changes to it, and can do no
        more there than the kernel could. ``PATH`` is the runner's, never the kernel's: an
        approved ``ls`` is not a program the kernel planted in a folder of its own.
        """
        inner = (
            f"cd {shlex.quote(cwd)} && TMPDIR={shlex.quote(str(self.tmp_dir))} PATH={shlex.quote(self.path)}"
        )
        inner += f" exec {shlex.join(argv)}"
        # In an IPC namespace of its own, like the kernel's (srt's bwrap shares the host's).
        return _kernel_launch.in_own_ipc_namespace(
            [self.srt, "--settings", str(self.settings_file), "-c", inner]
        )

    async def run(self, argv: list[str], *, cwd: str, stdin: bytes | None, merge: bool) -> ShellResult:
        """Run `argv` to its end (or its timeout, or its output limit) and return what it wrote.

        Args:
            argv: The program and its arguments.
            cwd: The folder to run it in, inside the sandbox.
            stdin: What the program reads (a ``%%bash`` cell), or ``None`` for nothing.
            merge: Whether stderr goes to stdout, interleaved (as ``!cmd`` shows them).
        """
        process = await asyncio.create_subprocess_exec(
            *self.command(argv, cwd),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT if merge else asyncio.subprocess.PIPE,
            env=self.env,
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


class _ShellRequest(BaseModel):
    """The body of ``POST /shell``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["shell", "shell_magic"]
    # The command line (``shell``), or the cell fed to the program on stdin (``shell_magic``).
    cmd: str
    # The cell magic's program and its arguments (``shell_magic`` only).
    argv: list[str] | None = None
    cwd: str = Field(min_length=1)


def _shell_call(body: _ShellRequest) -> tuple[dict[str, Any], list[str]]:
    """The arguments a shell request is approved with, and the program line it runs."""
    if body.kind == ShellFields.SHELL:
        return {"cmd": body.cmd}, ["/bin/sh", "-c", body.cmd]
    assert body.argv is not None
    tool_args: dict[str, Any] = {"magic": body.argv[0], "cmd": body.cmd}
    if body.argv[1:]:
        tool_args["args"] = body.argv[1:]
    return tool_args, body.argv


async def _run_while_connected(
    runner: ShellRunner, body: _ShellRequest, argv: list[str], receive: Receive
) -> asyncio.Future[ShellResult]:
    """Run an approved shell request; it is cancelled if the kernel closes the connection first."""
    cell = body.cmd.encode() if body.kind == ShellFields.SHELL_MAGIC else None
    running = asyncio.ensure_future(
        runner.run(argv, cwd=body.cwd, stdin=cell, merge=body.kind == ShellFields.SHELL)
    )
    # The kernel closes the connection when its cell is interrupted: the command stops with it.
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({running, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    return running
