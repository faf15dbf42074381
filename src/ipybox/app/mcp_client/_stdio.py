"""The stdio transport of MCP sessions: the server's environment, command, stderr and bounded messages.

Application side only: :class:`ipybox.app.mcp_client._session.MCPSession` starts a stdio server through
`_stdio_transport` and finds its process group with `_find_process_group`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from mcp.client import stdio as sdk_stdio
from mcp.client.stdio import StdioServerParameters
from mcp.os.win32.utilities import ServerProcess

from ipybox._wire import McpServerEnv
from ipybox.app.mcp_client._transport import _message_id, _Refused

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec._mcp")

# Marks a stdio server's process so the session can find its process group afterwards.
_SESSION_MARKER_ENV = McpServerEnv.SESSION
# What a stdio server's error names of its stderr: the last lines, each cut to a length.
_STDERR_TAIL_LINES = 20
_STDERR_LINE_CHARS = 500
_STDERR_EOF_WAIT = 1.0

# What a stdio server gets of this process's environment, besides its own ``env`` and what the
# MCP SDK passes (HOME, LOGNAME, PATH, SHELL, TERM, USER): what it needs to reach the network,
# download its package and read and write text as in the user's own shell. Nothing else passes:
# API keys and tokens reach a server only when its ``env`` names them (``"${VAR}"``).
_PASSED_ENV = frozenset(
    {
        # certificates of a custom CA or a TLS-intercepting proxy
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
        "PIP_CERT",
        "UV_NATIVE_TLS",
        # proxies, both spellings
        *(
            name
            for base in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
            for name in (base, base.lower())
        ),
        # package indexes, for servers that download themselves (uvx, npx)
        "UV_INDEX_URL",
        "UV_DEFAULT_INDEX",
        "UV_INDEX",
        "UV_EXTRA_INDEX_URL",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "NPM_CONFIG_REGISTRY",
        "npm_config_registry",
        # where temporary files and caches go
        "TMPDIR",
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        "XDG_DATA_HOME",
        "XDG_STATE_HOME",
        "UV_CACHE_DIR",
        "UV_TOOL_DIR",
        "UV_PYTHON_INSTALL_DIR",
        "NPM_CONFIG_CACHE",
        "npm_config_cache",
        # language and time
        "LANG",
        "LANGUAGE",
        "TZ",
    }
)


def server_environment() -> dict[str, str]:
    """The variables of this process's environment that a stdio MCP server gets besides its own ``env``.

    The MCP SDK adds ``HOME``, ``LOGNAME``, ``PATH``, ``SHELL``, ``TERM`` and ``USER``; see
    ``_PASSED_ENV`` for the rest (certificates, proxies, package indexes, caches, locale).
    """
    return {
        name: value
        for name, value in os.environ.items()
        if (name in _PASSED_ENV or name.startswith("LC_")) and not value.startswith("()")
    }


def resolve_command(command: str, path: str) -> str:
    """Find a stdio server's command as its process will, or in the per-user folders installers use.

    A bare name is looked up in ``path`` (the ``PATH`` the server gets); when it is not there,
    in ``$XDG_BIN_HOME``, ``~/.local/bin`` and ``~/.cargo/bin``, where ``scripts/setup.sh`` and
    uv's and pipx's installers put commands (``uv``, ``uvx``) but where an application started
    from a desktop or a service often has no ``PATH``. A command with a folder in it is left as is.

    Raises:
        FileNotFoundError: The command is in none of these folders; the message names them.
    """
    if os.sep in command or (os.altsep and os.altsep in command):
        return command
    if shutil.which(command, path=path) is not None:
        return command
    extra = [str(folder) for folder in _user_bin_folders()]
    found = shutil.which(command, path=os.pathsep.join(extra))
    if found is not None:
        return found
    # Each folder once: a PATH often names one several times, and the per-user folders again.
    searched = list(
        dict.fromkeys(os.path.normpath(entry) for entry in [*path.split(os.pathsep), *extra] if entry)
    )
    raise FileNotFoundError(
        f"the command {command!r} was not found; searched {', '.join(searched) or '(an empty PATH)'}. "
        "Install it, give its full path as 'command', or add its folder to PATH "
        "(in the environment of the process that starts the server, or in the server's 'env')"
    )


def _user_bin_folders() -> list[Path]:
    folders = []
    if os.environ.get("XDG_BIN_HOME"):
        folders.append(Path(os.environ["XDG_BIN_HOME"]))
    home = Path.home()
    folders += [home / ".local" / "bin", home / ".cargo" / "bin"]
    return folders


class _ServerStderr:
    """The stderr of a stdio server: passed on to this process's stderr, its last lines kept.

    The MCP SDK reports a server that exits during start-up only as a closed connection; the
    lines kept here (and its exit code) are what tells the user why. A thread pumps the pipe, so
    a server writing much stderr waits on our stderr as before, never on the event loop.
    """

    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        self._secrets = secrets
        read_fd, write_fd = os.pipe()
        # Handed to the SDK as ``errlog``; closed once the server has been started.
        self.writer = os.fdopen(write_fd, "w")
        self.process: Any = None
        self._tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._thread = threading.Thread(
            target=self._pump, args=(read_fd,), name="mcp-server-stderr", daemon=True
        )
        self._thread.start()

    def _pump(self, read_fd: int) -> None:
        try:
            target: int | None = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            target = None
        partial = b""
        with open(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                if target is not None:
                    with contextlib.suppress(OSError):
                        os.write(target, chunk)
                *lines, partial = (partial + chunk).split(b"\n")
                partial = partial[-_STDERR_LINE_CHARS * 4 :]
                self._tail.extend(self._clip(line) for line in lines if line.strip())
        if partial.strip():
            self._tail.append(self._clip(partial))

    def _clip(self, line: bytes) -> str:
        text = line.decode(errors="replace").rstrip()
        # The message may reach the kernel: values of ${VAR} placeholders never do (S3).
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text if len(text) <= _STDERR_LINE_CHARS else text[:_STDERR_LINE_CHARS] + " ..."

    async def describe(self, exited: bool) -> str:
        """Say how the server ended (when ``exited``) and what it last wrote to stderr."""
        await asyncio.to_thread(self._thread.join, _STDERR_EOF_WAIT)
        parts = []
        code = getattr(self.process, "returncode", None)
        if exited and code is not None:
            parts.append(f"it exited with code {code}" if code >= 0 else f"it was ended by signal {-code}")
        if self._tail:
            lines = "\n".join(f"  {line}" for line in self._tail)
            parts.append(f"its last lines on stderr:\n{lines}")
        elif exited and code is not None:
            parts.append("it wrote nothing to stderr")
        return "; ".join(parts)


@contextlib.asynccontextmanager
async def _stdio_transport(
    server: StdioServerParameters, stderr: _ServerStderr, max_message_size: int | None
) -> AsyncIterator[Any]:
    try:
        async with _bounded_stdio(server, max_message_size, stderr) as streams:
            yield streams
    finally:
        stderr.writer.close()


@contextlib.asynccontextmanager
async def _bounded_stdio(
    server: StdioServerParameters, max_message_size: int | None, stderr: _ServerStderr
) -> AsyncIterator[Any]:
    """The MCP SDK's stdio transport (``stdio_client``), with a size limit on each message while it is read.

    Process start and stop are the SDK's own. A line over the limit is not kept: its request
    (whose id is read from the line's start) fails with an error naming the limit, and the
    rest of the line is skipped; the session carries on. A line without a readable id ends
    the session (its calls fail, the next call starts the server again).
    """
    import mcp_types
    from mcp.shared.message import SessionMessage

    command = await sdk_stdio._get_executable_command(server.command)
    process = await sdk_stdio._create_platform_compatible_process(
        command=command,
        args=server.args,
        env=sdk_stdio.get_default_environment() | (server.env or {}),
        errlog=stderr.writer,
        cwd=server.cwd,
    )
    # The server holds the pipe's write end now; ours must go, or its end is never seen.
    stderr.process = process
    stderr.writer.close()
    read_writer, read_stream = anyio.create_memory_object_stream[Any](0)
    write_stream, write_reader = anyio.create_memory_object_stream[Any](0)
    writer_done = anyio.Event()

    async def deliver(line: bytes | bytearray) -> None:
        try:
            message: Any = SessionMessage(
                mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
            )
        except ValueError as exc:
            message = exc
        await read_writer.send(message)

    async def refuse(head: bytes, size: int) -> bool:
        """Fail the request of a line over the limit; whether its id was found."""
        error = (
            f"the answer is over the byte limit of {max_message_size} bytes per message (the tool server's "
            "max_result_size plus 1 MiB), so it was not read further"
        )
        logger.warning("An MCP server sent a message of %d bytes; refused: %s", size, error)
        request_id = _message_id(head)
        if request_id is None:
            return False
        reply = mcp_types.JSONRPCError(
            jsonrpc="2.0",
            id=request_id,
            error=mcp_types.ErrorData(code=mcp_types.INTERNAL_ERROR, message=error, data=_Refused(size)),
        )
        await read_writer.send(SessionMessage(reply))
        return True

    async def write() -> None:
        assert process.stdin is not None
        try:
            async with write_reader:
                async for session_message in write_reader:
                    data = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((data + "\n").encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()
        finally:
            writer_done.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_read_bounded, process, max_message_size, read_writer, deliver, refuse)
        tasks.start_soon(write)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                read_stream.close()
                write_stream.close()
                with anyio.move_on_after(sdk_stdio._WRITER_FLUSH_TIMEOUT):
                    await writer_done.wait()
                await sdk_stdio._stop_server_process(process)
                for stream in (read_stream, write_stream, read_writer, write_reader):
                    await stream.aclose()
            tasks.cancel_scope.cancel()


async def _read_bounded(
    process: ServerProcess,
    max_message_size: int | None,
    read_writer: MemoryObjectSendStream[Any],
    deliver: Callable[[bytes | bytearray], Awaitable[None]],
    refuse: Callable[[bytes, int], Awaitable[bool]],
) -> None:
    """Read the server's stdout for `_bounded_stdio`: `deliver` each line, `refuse` each one over the limit."""
    assert process.stdout is not None
    buffer = bytearray()
    head = b""  # the start of a line being skipped (over the limit), for its request id
    skipped = 0
    try:
        async with read_writer:
            try:
                async for chunk in process.stdout:
                    start = 0
                    while (end := chunk.find(b"\n", start)) >= 0:
                        if skipped:
                            if not await refuse(head, skipped + end - start):
                                return  # no request to fail: the session ends instead
                            head, skipped = b"", 0
                        else:
                            buffer += chunk[start:end]
                            await deliver(buffer)  # parsed before the first await: no copy
                            buffer.clear()
                        start = end + 1
                    rest = len(chunk) - start
                    if skipped:
                        skipped += rest
                    elif max_message_size is not None and len(buffer) + rest > max_message_size:
                        head = (bytes(buffer) + chunk[start : start + 4096])[:4096]
                        skipped = len(buffer) + rest
                        buffer.clear()
                    else:
                        buffer += chunk[start:]
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            finally:
                await sdk_stdio._drain_stdout(process)
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
        pass


def _find_process_group(marker: str) -> int | None:
    """Find the stdio server process we spawned (in its own session) by the marker in its environment."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.environ().get(_SESSION_MARKER_ENV) == marker:
                return int(child.pid)
    return None
