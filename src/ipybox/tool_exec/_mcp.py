"""MCP client sessions for the tool server and the code generator (application side only).

Each MCP server connection is an :class:`MCPSession` whose MCP SDK ``Client`` is entered and
exited by one long-lived owner task, so no anyio scope of the connection is ever left by
another task. Its parameters are resolved beforehand by :mod:`ipybox.tool_exec._params`.
This module is never imported inside a kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import anyio
import httpx2
from mcp.client import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, TextContent, Tool
from mcp_types import CONNECTION_CLOSED, UNSUPPORTED_PROTOCOL_VERSION

from ipybox.errors import MCPServerError
from ipybox.tool_exec._params import HttpParams, StdioParams, resolve_params

__all__ = ["MCPSession", "list_tools"]

logger = logging.getLogger(__name__)

# Marks a stdio server's process so the session can find its process group afterwards.
_SESSION_MARKER_ENV = "IPYBOX_MCP_SESSION"
_GROUP_KILL_GRACE = 2.0
_HTTP_TIMEOUT = 30.0
_HTTP_READ_TIMEOUT = 300.0
_END_REASON_WAIT = 1.0
# A tool result of the tool server's default limit (32 MiB) fits, with room for the JSON-RPC
# envelope; the tool server checks its own limit once the result has arrived.
DEFAULT_MAX_MESSAGE_SIZE = 33 * 1024 * 1024


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
        max_message_size: Bytes one message from a streamable HTTP server may have when it
            comes as a server-sent event (the SDK's default is 1 MiB); ``None`` for no limit.
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
                        "(connect_timeout): check its parameters, or raise connect_timeout if it starts slowly.",
                        self.server_name,
                    ),
                )
        except Exception as exc:
            if not ready.done():
                error = MCPServerError(
                    f"MCP server {self.server_name!r} could not be started or connected to: {_describe(exc)}",
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
                if isinstance(self.params, StdioParams):
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
            if pgid is not None:
                # The SDK stopped the server; descendants it left in its process group go too.
                with anyio.CancelScope(shield=True):
                    await _kill_process_group(pgid)

    def _transport(self, cwd: str | None) -> contextlib.AbstractAsyncContextManager[Any]:
        params = self.params
        if isinstance(params, StdioParams):
            env = {**(params.env or {}), _SESSION_MARKER_ENV: self._marker}
            server = StdioServerParameters(
                command=params.command, args=list(params.args), env=env, cwd=params.cwd or cwd
            )
            return stdio_client(server, errlog=sys.stderr)
        if params.transport == "sse":
            return sse_client(params.url, headers=dict(params.headers), timeout=self.connect_timeout)
        return _streamable_http(params.url, params.headers, self.max_message_size)


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
    url: str, headers: Mapping[str, str], max_message_size: int | None
) -> AsyncIterator[Any]:
    # The MCP SDK's own defaults: a server may hold a response stream open for minutes.
    timeout = httpx2.Timeout(_HTTP_TIMEOUT, read=_HTTP_READ_TIMEOUT)
    async with httpx2.AsyncClient(headers=dict(headers), timeout=timeout) as http_client:
        async with streamable_http_client(
            url, http_client=http_client, max_sse_event_size=max_message_size
        ) as streams:
            yield streams


def _find_process_group(marker: str) -> int | None:
    """Find the stdio server process we spawned (in its own session) by the marker in its environment."""
    import psutil

    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.environ().get(_SESSION_MARKER_ENV) == marker:
                return int(child.pid)
    return None


async def _kill_process_group(pgid: int) -> None:
    """Stop whatever is left of a stdio server's process group (descendants the server left behind)."""
    if sys.platform == "win32":  # pragma: no cover
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    with anyio.move_on_after(_GROUP_KILL_GRACE):
        while True:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            await anyio.sleep(0.01)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _text(result: CallToolResult) -> str | None:
    texts = [item.text for item in result.content if isinstance(item, TextContent)]
    return "\n".join(texts) if texts else None


def _size_hint(exc: BaseException) -> str:
    if "byte limit" not in _describe(exc):
        return ""
    return (
        " (the result is larger than one MCP message may be on this transport: up to the tool "
        "server's max_result_size plus 1 MiB over streamable HTTP, 1 MiB over SSE, which the MCP SDK fixes)"
    )


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
