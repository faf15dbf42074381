"""MCP client sessions for the tool server and the code generator (application side only).

Each MCP server connection is an :class:`MCPSession` whose MCP SDK ``Client`` is entered and
exited by one long-lived owner task, so no anyio scope of the connection is ever left by
another task. Its parameters are resolved beforehand by :mod:`ipybox.app.mcp_client._params`; its
transports are ``_stdio.py`` and ``_transport.py``, the wording of its failures
``_errors.py``. This module is never imported inside a kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from typing import Any

import anyio
import httpx2
from mcp.client import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, TextContent, Tool
from mcp_types import CONNECTION_CLOSED, UNSUPPORTED_PROTOCOL_VERSION

from ipybox._infra import kill_tree
from ipybox.app.mcp_client._errors import _SIZE_HINT, _describe, _find_mcp_error, _gone_error, _what
from ipybox.app.mcp_client._oauth_flow import OAuthConnection, oauth_connection
from ipybox.app.mcp_client._params import HttpParams, StdioParams, resolve_params
from ipybox.app.mcp_client._stdio import (
    _SESSION_MARKER_ENV,
    _find_process_group,
    _ServerStderr,
    _stdio_transport,
    resolve_command,
    server_environment,
)
from ipybox.app.mcp_client._transport import (
    _bounded_client,
    _EnteredTransport,
    _EofWatchingStream,
    _Refusals,
    _Refused,
    _streamable_http,
)
from ipybox.errors import MCPServerError

__all__ = ["MCPSession", "list_tools"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec._mcp")
_GROUP_KILL_GRACE = 2.0
_END_REASON_WAIT = 1.0

# A tool result of the tool server's default limit (32 MiB) fits, with room for the JSON-RPC
# envelope; the tool server checks its own limit once the result has arrived.
DEFAULT_MAX_MESSAGE_SIZE = 33 * 1024 * 1024


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
        # The answers the transport refused for their size (see _translate).
        self._refusals = _Refusals()

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
            # Shielded so that a cancelled caller still waits for the process to be gone; broad:
            # the owner task reported its end already (to start() or the calls in flight).
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
        except Exception as exc:  # broad: the boundary to the SDK; _translate makes it an MCPServerError
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
        except Exception as exc:  # broad: the boundary to the SDK; _translate makes it an MCPServerError
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
        # The MCP SDK turns the transport's refusal of an answer over the size limit
        # (_BoundedStream's or _bounded_stdio's) into an MCPError carrying only text; the
        # transport recorded the refusal, and the error that fails the request carries a _Refused.
        if isinstance(exc, MCPError) and isinstance(exc.data, _Refused):
            # One answer was over the limit; the session is fine.
            return MCPServerError(
                f"MCP server {self.server_name!r} answered {_what(tool_name)} with a message too large to "
                f"receive: {exc.message}{_SIZE_HINT}.",
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
            return _gone_error(
                self.server_name, tool_name, self._broken, self._end_error, self._restart_hint()
            )
        return MCPServerError(
            f"{_what(tool_name).capitalize()} on MCP server {self.server_name!r} failed: {_describe(exc)}",
            self.server_name,
            tool_name or None,
        )

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
                except Exception as exc:  # broad: the refusal may come wrapped in an exception group
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
        except Exception as exc:  # broad: the boundary to the SDK and the server's process; reported below
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
                streams = _EofWatchingStream(read_stream, self._mark_broken, self._refusals), write_stream
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
        self._refusals = _Refusals()
        if isinstance(params, StdioParams):
            env = {**server_environment(), **(params.env or {}), _SESSION_MARKER_ENV: self._marker}
            command = resolve_command(params.command, env.get("PATH", os.environ.get("PATH", os.defpath)))
            server = StdioServerParameters(
                command=command, args=list(params.args), env=env, cwd=params.cwd or cwd
            )
            self._stderr = _ServerStderr(params.secrets)
            return _stdio_transport(server, self._stderr, self.max_message_size)
        if params.transport == "sse":
            limit, refusals = self.max_message_size, self._refusals

            def client_factory(
                headers: dict[str, str] | None = None,
                timeout: httpx2.Timeout | None = None,
                auth: httpx2.Auth | None = None,
            ) -> httpx2.AsyncClient:
                return _bounded_client(limit, headers, timeout, auth, refusals)

            return sse_client(
                params.url,
                headers=dict(params.headers),
                timeout=self.connect_timeout,
                auth=self._auth(),
                httpx_client_factory=client_factory,
            )
        return _streamable_http(
            params.url, params.headers, self.max_message_size, self._refusals, self._auth()
        )

    def _auth(self) -> httpx2.Auth | None:
        """The OAuth login of an HTTP server whose parameters ask for one (see `ipybox.app.mcp_client._oauth`)."""
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


def _text(result: CallToolResult) -> str | None:
    texts = [item.text for item in result.content if isinstance(item, TextContent)]
    return "\n".join(texts) if texts else None


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
