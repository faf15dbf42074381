"""MCP client sessions for the tool server and the code generator (application side only).

Each MCP server connection is an :class:`MCPSession` whose MCP SDK ``Client`` is entered and
exited by one long-lived owner task, so no anyio scope of the connection is ever left by
another task. Its parameters are resolved beforehand by :mod:`ipybox.app._params`.
This module is never imported inside a kernel.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import httpx2
from anyio.streams.memory import MemoryObjectSendStream
from mcp.client import Client
from mcp.client import stdio as sdk_stdio
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.os.win32.utilities import ServerProcess
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, TextContent, Tool
from mcp_types import CONNECTION_CLOSED, UNSUPPORTED_PROTOCOL_VERSION

from ipybox._infra import kill_tree
from ipybox._wire import McpServerEnv
from ipybox.app._oauth import OAuthConnection, oauth_connection
from ipybox.app._params import HttpParams, StdioParams, resolve_params
from ipybox.errors import MCPServerError

__all__ = ["MCPSession", "list_tools"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec._mcp")

# Marks a stdio server's process so the session can find its process group afterwards.
_SESSION_MARKER_ENV = McpServerEnv.SESSION
_GROUP_KILL_GRACE = 2.0
_HTTP_TIMEOUT = 30.0
_HTTP_READ_TIMEOUT = 300.0
_END_REASON_WAIT = 1.0
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

# A tool result of the tool server's default limit (32 MiB) fits, with room for the JSON-RPC
# envelope; the tool server checks its own limit once the result has arrived.
DEFAULT_MAX_MESSAGE_SIZE = 33 * 1024 * 1024
# An HTTP server's answer must arrive whole within this many seconds (a JSON answer, or one
# event of an event stream), however slowly it trickles.
_ANSWER_DEADLINE = 300.0


class _AnswerTooLarge(httpx2.StreamError, httpx2.SSEError):
    """An HTTP answer over the size limit or past its deadline, raised while it is read.

    Both a ``StreamError`` (the SDK fails that one JSON answer's request with it) and an
    ``SSEError`` (the SDK fails the request whose event stream it was).
    """


class _BoundedStream(httpx2.AsyncByteStream):
    """An HTTP answer's body, read with a size limit and a deadline while it arrives.

    A JSON answer is bounded as a whole; an event stream per event (an event ends at a blank
    line), so a stream that stays open for many events is not cut off.
    """

    def __init__(self, inner: Any, limit: int | None, events: bool) -> None:
        self._inner = inner
        self._limit = limit
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        size = 0
        started: float | None = None if self._events else anyio.current_time()
        tail = b""
        chunks = aiter(self._inner)
        while True:
            if started is None:
                chunk = await anext(chunks, None)
            else:
                remaining = started + _ANSWER_DEADLINE - anyio.current_time()
                with anyio.move_on_after(remaining) as scope:
                    chunk = await anext(chunks, None)
                if scope.cancelled_caught:
                    raise _AnswerTooLarge(
                        f"the answer did not arrive whole within {_ANSWER_DEADLINE:g} s (it trickled), so it "
                        "was abandoned"
                    )
            if chunk is None:
                return
            size += len(chunk)
            if self._events:
                joined = tail + chunk
                end = max(joined.rfind(b"\n\n") + 2, joined.rfind(b"\r\r") + 2, joined.rfind(b"\r\n\r\n") + 4)
                if end > 1:
                    size = len(joined) - end
                tail = joined[-3:]
                started = (started or anyio.current_time()) if size else None
            if self._limit is not None and size > self._limit:
                raise _AnswerTooLarge(
                    f"the answer is over the byte limit of {self._limit} bytes per message (the tool server's "
                    "max_result_size plus 1 MiB), so it was not read further"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _bounded_client(
    limit: int | None,
    headers: Mapping[str, str] | None = None,
    timeout: httpx2.Timeout | None = None,
    auth: httpx2.Auth | None = None,
) -> httpx2.AsyncClient:
    """An HTTP client for MCP whose every answer is read through `_BoundedStream`."""

    async def bound(response: httpx2.Response) -> None:
        events = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        response.stream = _BoundedStream(response.stream, limit, events)

    return httpx2.AsyncClient(
        headers=dict(headers or {}),
        timeout=timeout or httpx2.Timeout(_HTTP_TIMEOUT, read=_HTTP_READ_TIMEOUT),
        auth=auth,
        event_hooks={"response": [bound]},
    )


class _EofWatchingStream:
    """Wraps a transport's read stream and reports when the server side has gone away."""

    def __init__(self, inner: Any, on_eof: Any) -> None:
        self._inner = inner
        self._on_eof = on_eof

    def __getattr__(self, name: str) -> Any:
        # Forwards ``last_context`` and whatever else the SDK reads off its own streams.
        return getattr(self._inner, name)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_eof()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _EofWatchingStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _EofWatchingStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class MCPSession:
    """A connection to one MCP server, owned by one task for its whole life.

    ``start()`` spawns the owner task, which enters the MCP SDK ``Client`` (starting a stdio
    server process or connecting over HTTP) and keeps it open until ``close()`` or until the
    server goes away (its end of the connection closes). Several calls, from any tasks, can be
    in flight at once; when the session ends they fail with ``MCPServerError``.

    Args:
        server_name: The application's name for the server (used in messages).
        params: The resolved server parameters.
        connect_timeout: Seconds the server has to start and complete the MCP handshake.
        max_message_size: Bytes one message from an HTTP server may have (a JSON answer, or one
            server-sent event), enforced while it is read; ``None`` for no limit. An answer must
            also arrive whole within 300 s, however slowly it trickles.
    """

    def __init__(
        self,
        server_name: str,
        params: StdioParams | HttpParams,
        connect_timeout: float = 30,
        max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE,
    ) -> None:
        self.server_name = server_name
        self.params = params
        self.connect_timeout = connect_timeout
        self.max_message_size = max_message_size
        self._owner: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop = anyio.Event()
        self._client: Client | None = None
        self._broken = False
        self._closing = False
        self._marker = uuid.uuid4().hex
        # Why an established connection ended, when it ended with an error.
        self._end_error: BaseException | None = None
        self._connect_scope = anyio.CancelScope()
        self._stderr: _ServerStderr | None = None
        self._oauth: OAuthConnection | None = None

    @property
    def alive(self) -> bool:
        """Whether the session is connected and accepts calls."""
        return self._client is not None and not self._broken and not self._stop.is_set()

    async def start(self) -> None:
        """Start the server (or connect to it) and complete the MCP handshake.

        Raises:
            RuntimeError: The session was already started.
            MCPServerError: The server could not be started, refused the connection, or did not
                answer within ``connect_timeout`` seconds.
        """
        if self._owner is not None:
            raise RuntimeError(f"The session to MCP server {self.server_name!r} was already started.")
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._connect_scope.deadline = anyio.current_time() + self.connect_timeout
        self._owner = loop.create_task(self._own(), name=f"mcp-session-{self.server_name}")
        try:
            await asyncio.shield(self._ready)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the connection and stop the server process with its whole process tree.

        Calls still in flight fail with ``MCPServerError``. Idempotent.
        """
        self._closing = True
        self._stop.set()
        if self._ready is not None and not self._ready.done():
            self._connect_scope.cancel()
        owner = self._owner
        if owner is not None and not owner.done():
            # Shielded so that a cancelled caller still waits for the process to be gone.
            with contextlib.suppress(Exception):
                await asyncio.shield(owner)

    async def call_tool(self, tool_name: str, tool_args: dict[str, Any]) -> dict[str, Any] | str | None:
        """Call a tool and return its result.

        Args:
            tool_name: The tool's name.
            tool_args: Its arguments.

        Returns:
            The structured content as a ``dict`` if the tool returned any, else its text content
            joined by newlines, or ``None`` when the tool returned neither.

        Raises:
            MCPServerError: The tool reported an error (with the server's message), the server
                answered with a protocol error, or it went away while the call was running.
        """
        result = await self.call_tool_content(tool_name, tool_args)
        if result.structured_content is not None:
            return dict(result.structured_content)
        return _text(result)

    async def call_tool_content(self, tool_name: str, tool_args: dict[str, Any]) -> CallToolResult:
        """Call a tool and return its whole result: every content part and the structured content.

        Args:
            tool_name: The tool's name.
            tool_args: Its arguments.

        Raises:
            MCPServerError: As for `call_tool`.
        """
        client = self._connected(tool_name)
        try:
            result = await client.call_tool(tool_name, tool_args)
        except Exception as exc:
            error = self._translate(exc, tool_name)
            if self._broken and self._end_error is None and self._owner is not None:
                # The connection broke: the owner task is ending with the reason (e.g. a message
                # over the transport's size limit); wait briefly so the error can say it.
                await asyncio.wait({self._owner}, timeout=_END_REASON_WAIT)
                error = self._translate(exc, tool_name)
                if self._end_error is None and self._stderr is not None and self._owner.done():
                    # It crashed or exited: how, and what it said last, tells the user why.
                    ending = await self._stderr.describe(exited=True)
                    if ending:
                        error = MCPServerError(
                            f"{error} {ending[0].upper()}{ending[1:]}", self.server_name, tool_name
                        )
            raise error from exc
        if result.is_error:
            message = _text(result) or "the tool reported an error without a message"
            raise MCPServerError(message, self.server_name, tool_name)
        return result

    async def list_tools(self) -> list[Tool]:
        """List every tool the server offers (all pages).

        Raises:
            MCPServerError: The server answered with an error or went away.
        """
        client = self._connected("")
        tools: list[Tool] = []
        cursor: str | None = None
        try:
            while True:
                page = await client.list_tools(cursor=cursor, cache_mode="refresh")
                tools.extend(page.tools)
                cursor = page.next_cursor
                if not cursor:
                    return tools
        except Exception as exc:
            raise self._translate(exc, "") from exc

    def _connected(self, tool_name: str) -> Client:
        # Calls are awaited in the caller's task rather than handed to the owner task: the SDK
        # session takes concurrent requests from any task and every scope a request opens is
        # entered and left in that task, while the session itself is entered and exited only by
        # the owner. A hop through the owner costs ~0.1 ms, about 8 % of a whole tool call.
        client = self._client
        if client is None or not self.alive:
            raise MCPServerError(
                f"The session to MCP server {self.server_name!r} is closed; {self._restart_hint()}.",
                self.server_name,
                tool_name or None,
            )
        return client

    def _translate(self, exc: Exception, tool_name: str) -> MCPServerError:
        if self._oauth is not None and (refused := self._oauth.explain(exc)) is not None:
            self._mark_broken()
            return refused
        if isinstance(exc, MCPError) and "byte limit" in exc.message:
            # Streamable HTTP: one answer was over the SSE event limit; the session is fine.
            return MCPServerError(
                f"MCP server {self.server_name!r} answered {_what(tool_name)} with a message too large to "
                f"receive: {exc.message}{_size_hint(exc)}.",
                self.server_name,
                tool_name or None,
            )
        if isinstance(exc, MCPError) and exc.code != CONNECTION_CLOSED:
            return MCPServerError(
                f"MCP server {self.server_name!r} answered {_what(tool_name)} with an error: {exc.message}",
                self.server_name,
                tool_name or None,
            )
        if isinstance(
            exc,
            MCPError
            | OSError
            | httpx2.TransportError
            | anyio.BrokenResourceError
            | anyio.ClosedResourceError,
        ):
            self._mark_broken()
            return self._gone_error(tool_name)
        return MCPServerError(
            f"{_what(tool_name).capitalize()} on MCP server {self.server_name!r} failed: {_describe(exc)}",
            self.server_name,
            tool_name or None,
        )

    def _gone_error(self, tool_name: str) -> MCPServerError:
        if self._broken and self._end_error is not None:
            message = (
                f"The connection to MCP server {self.server_name!r} failed while {_what(tool_name)} was running: "
                f"{_describe(self._end_error)}{_size_hint(self._end_error)}; {self._restart_hint()}."
            )
        elif self._broken:
            message = (
                f"MCP server {self.server_name!r} went away while {_what(tool_name)} was running (it crashed, "
                f"exited or closed the connection); {self._restart_hint()}."
            )
        else:
            message = (
                f"The session to MCP server {self.server_name!r} was closed (reset or stop) while "
                f"{_what(tool_name)} was running."
            )
        return MCPServerError(message, self.server_name, tool_name or None)

    def _restart_hint(self) -> str:
        if isinstance(self.params, StdioParams):
            return "it is started again on the next call"
        return "the next call connects to it again"

    def _mark_broken(self) -> None:
        # The end of the connection during close() is expected, not a crash.
        if not self._broken and not self._closing:
            self._broken = True
            self._stop.set()

    async def _own(self) -> None:
        assert self._ready is not None
        ready = self._ready
        try:
            with self._connect_scope:
                # The initialize handshake first: every server speaks it and it is the cheaper
                # protocol per call; a server that speaks only the 2026 protocol says so with
                # -32022, and gets a second connection negotiated by the SDK.
                try:
                    await self._connect_and_serve("legacy", ready)
                except Exception as exc:
                    refusal = _find_mcp_error(exc)
                    if ready.done() or refusal is None or refusal.code != UNSUPPORTED_PROTOCOL_VERSION:
                        raise
                    await self._connect_and_serve("auto", ready)
            if self._connect_scope.cancelled_caught and not ready.done() and not self._stop.is_set():
                _fail(
                    ready,
                    MCPServerError(
                        f"MCP server {self.server_name!r} did not answer within {self.connect_timeout:g} s "
                        "(connect_timeout): check its parameters, or raise connect_timeout if it starts slowly"
                        f"{await self._server_output(exited=False)}.",
                        self.server_name,
                    ),
                )
        except Exception as exc:
            refused = self._oauth.explain(exc) if self._oauth is not None else None
            if not ready.done() and refused is not None:
                _fail(ready, refused)
            elif not ready.done():
                error = MCPServerError(
                    f"MCP server {self.server_name!r} could not be started or connected to: {_describe(exc)}"
                    f"{await self._server_output(exited=True)}",
                    self.server_name,
                )
                error.__cause__ = exc
                _fail(ready, error)
            else:
                self._end_error = exc
                logger.warning(
                    "Session to MCP server %r ended with an error: %s", self.server_name, _describe(exc)
                )
        finally:
            self._client = None
            self._broken = True
            _fail(
                ready,
                MCPServerError(
                    f"The session to MCP server {self.server_name!r} was closed.", self.server_name
                ),
            )

    async def _server_output(self, exited: bool) -> str:
        """What a stdio server that failed to start said: its exit code and last lines on stderr."""
        if self._stderr is None:
            return ""
        description = await self._stderr.describe(exited)
        return f"; {description}" if description else ""

    async def _connect_and_serve(self, mode: str, ready: asyncio.Future[None]) -> None:
        pgid: int | None = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                cwd = None
                if isinstance(self.params, StdioParams) and self.params.cwd is None:
                    # A private, empty working directory: the workspace may hold a planted
                    # node_modules, Python module or tool configuration that npx, python -m or
                    # uvx would pick up from their working directory.
                    cwd = tempfile.mkdtemp(prefix="ipybox-mcp-")
                    stack.callback(shutil.rmtree, cwd, True)
                read_stream, write_stream = await stack.enter_async_context(self._transport(cwd))
                if self._stderr is not None and self._stderr.process is not None:
                    pgid = self._stderr.process.pid  # the SDK starts it in a session of its own
                elif isinstance(self.params, StdioParams):
                    pgid = _find_process_group(self._marker)
                streams = _EofWatchingStream(read_stream, self._mark_broken), write_stream
                client = await stack.enter_async_context(Client(_EnteredTransport(streams), mode=mode))
                # Up and running: the connect deadline no longer applies.
                self._connect_scope.deadline = math.inf
                self._client = client
                ready.set_result(None)
                await self._stop.wait()
        finally:
            self._client = None
            if self._oauth is not None:
                self._oauth.close()
            if pgid is not None:
                # The SDK stopped the server; descendants it left in its process group go too.
                with anyio.CancelScope(shield=True):
                    await kill_tree(pgid, _GROUP_KILL_GRACE, group=True)

    def _transport(self, cwd: str | None) -> contextlib.AbstractAsyncContextManager[Any]:
        params = self.params
        if isinstance(params, StdioParams):
            env = {**server_environment(), **(params.env or {}), _SESSION_MARKER_ENV: self._marker}
            command = resolve_command(params.command, env.get("PATH", os.environ.get("PATH", os.defpath)))
            server = StdioServerParameters(
                command=command, args=list(params.args), env=env, cwd=params.cwd or cwd
            )
            self._stderr = _ServerStderr(params.secrets)
            return _stdio_transport(server, self._stderr, self.max_message_size)
        if params.transport == "sse":
            limit = self.max_message_size

            def client_factory(
                headers: dict[str, str] | None = None,
                timeout: httpx2.Timeout | None = None,
                auth: httpx2.Auth | None = None,
            ) -> httpx2.AsyncClient:
                return _bounded_client(limit, headers, timeout, auth)

            return sse_client(
                params.url,
                headers=dict(params.headers),
                timeout=self.connect_timeout,
                auth=self._auth(),
                httpx_client_factory=client_factory,
            )
        return _streamable_http(params.url, params.headers, self.max_message_size, self._auth())

    def _auth(self) -> httpx2.Auth | None:
        """The OAuth login of an HTTP server whose parameters ask for one (see `ipybox.app._oauth`)."""
        params = self.params
        if not isinstance(params, HttpParams) or params.oauth is None:
            return None

        def waiting_on_person(waiting: bool) -> None:
            # The browser step is the person's time, not the server's: the connect deadline pauses.
            if self._ready is not None and not self._ready.done():
                self._connect_scope.deadline = (
                    math.inf if waiting else anyio.current_time() + self.connect_timeout
                )

        self._oauth = oauth_connection(self.server_name, params.url, params.oauth, on_wait=waiting_on_person)
        return self._oauth.auth


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
    searched = [entry for entry in path.split(os.pathsep) if entry] + extra
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


class _EnteredTransport(contextlib.AbstractAsyncContextManager[Any]):
    """Hands streams of a transport that the session entered itself to the SDK ``Client``."""

    def __init__(self, streams: tuple[Any, Any]) -> None:
        self._streams = streams

    async def __aenter__(self) -> tuple[Any, Any]:
        return self._streams

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


@contextlib.asynccontextmanager
async def _streamable_http(
    url: str, headers: Mapping[str, str], max_message_size: int | None, auth: httpx2.Auth | None = None
) -> AsyncIterator[Any]:
    # The MCP SDK's own timeouts (a server may hold a response stream open for minutes), and
    # every answer read with the message size limit and a deadline.
    async with _bounded_client(max_message_size, headers, auth=auth) as http_client:
        async with streamable_http_client(
            url, http_client=http_client, max_sse_event_size=max_message_size
        ) as streams:
            yield streams


# The id of a JSON-RPC answer that names it before its result or error (as the SDKs write them).
_ID = re.compile(rb'^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d+|"[^"\\]*")')


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
        found = _ID.match(head)
        if found is None:
            return False
        reply = mcp_types.JSONRPCError(
            jsonrpc="2.0",
            id=json.loads(found.group(1)),
            error=mcp_types.ErrorData(code=mcp_types.INTERNAL_ERROR, message=error),
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


def _text(result: CallToolResult) -> str | None:
    texts = [item.text for item in result.content if isinstance(item, TextContent)]
    return "\n".join(texts) if texts else None


def _size_hint(exc: BaseException) -> str:
    if "byte limit" not in _describe(exc):
        return ""
    return " (one MCP message may have up to the tool server's max_result_size plus 1 MiB)"


def _what(tool_name: str) -> str:
    return f"tool {tool_name!r}" if tool_name else "the tool listing"


def _find_mcp_error(exc: BaseException) -> MCPError | None:
    if isinstance(exc, MCPError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_mcp_error(inner)
            if found is not None:
                return found
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.message
    return str(exc) or type(exc).__name__


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        if isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error)


async def list_tools(
    server_name: str, server_params: Mapping[str, Any], connect_timeout: float = 30
) -> list[Tool]:
    """Start (or connect to) an MCP server, list all its tools, and stop it again.

    Args:
        server_name: The application's name for the server (used in messages).
        server_params: The server parameters, ``${VAR}`` placeholders included.
        connect_timeout: Seconds the server has to start and complete the MCP handshake.

    Returns:
        The server's tools, every page.

    Raises:
        ServerParamsError: The parameters are malformed or name a variable that is not set.
        MCPServerError: The server could not be started, did not answer in time, or failed the listing.
    """
    session = MCPSession(server_name, resolve_params(server_params), connect_timeout)
    await session.start()
    try:
        return await session.list_tools()
    finally:
        await session.close()
