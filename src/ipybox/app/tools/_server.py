"""The tool server: runs MCP tools for code in a kernel, after the application approves each call.

Endpoints:

- ``POST /run`` with ``{"server_name", "tool_name", "tool_args", "server_params"?,
  "content"?}`` answers ``{"result": ...}`` (the structured content, else the text parts
  joined), or with ``"content": true`` ``{AnswerFields.CONTENT: [MCP content blocks], "structured": ...}``;
  or an error with a real status code and the body
  ``{"error": {"kind": "rejected" | "expired" | "failed", "message": "..."}}``: 400 malformed
  request or parameters, 401 missing or wrong token, 403 rejected by the application,
  ``server_params`` refused (secured mode) or a server the sandboxed kernel could change,
  404 server not registered, 502 the MCP server failed (could not start, tool error, crash)
  or the result is over ``max_result_size``, 503 no approval client, 504 approval expired.
- ``POST /approve`` with ``{"server_name": "ipybox", "tool_name", "tool_args"}`` only asks the
  application for a decision, for what the kernel runs itself (shell commands); it answers
  ``{"result": null}`` once accepted, or an error as ``/run`` does.
- ``POST /shell`` with ``{"kind": "shell" | "shell_magic", "cmd", "argv"?, "cwd"}`` asks
  the application as ``/approve`` does and, once accepted, runs the command in a sandbox of its
  own (``shell_runner``, for a kernel that cannot start programs); it answers ``{"stdout",
  "stderr", "exit_code", "stopped"}``, or an error as ``/run`` does (400 when this tool server
  runs no shell commands). The command is killed when the kernel closes the connection.
- ``PUT /reset`` closes every MCP session (they start again on the next call).
- ``WS /approval`` is where the application's ``ApprovalClient`` connects.
- ``GET /status`` answers ``{"status": "ok"}``.

``/run`` is served by the base `_ToolCalls` (``_calls.py``), ``/approve`` and ``/shell`` by
`_ShellRoutes` (``_shell_routes.py``); this module holds the lifecycle and the routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcp.types import Tool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from ipybox._infra import BearerToken, Uvicorn, listen
from ipybox._wire import ToolServerPaths
from ipybox.app._settings import DEFAULT_MAX_RESULT_SIZE
from ipybox.app.approval import POLICY_VIOLATION, ApprovalChannel
from ipybox.app.mcp_client import MCPSession, ServerRegistry, default_registry
from ipybox.app.sandbox import KernelConfinement, ShellRunner
from ipybox.app.tools._http import (
    _UNAUTHORIZED,
    _BoundedHttp,
    _Charge,
    _error,
    _error_response,
    _InflightBudget,
    _log_to_stderr_unless_configured,
    _QueuedWebSocket,
)
from ipybox.app.tools._shell_routes import _ShellRoutes
from ipybox.errors import ToolServerError

__all__ = ["DEFAULT_MAX_INFLIGHT_SIZE", "DEFAULT_MAX_REQUEST_SIZE", "DEFAULT_MAX_RESULT_SIZE", "ToolServer"]

DEFAULT_MAX_REQUEST_SIZE = 32 * 1024 * 1024
"""The default `max_request_size` of `ToolServer`: bytes one request body may have (32 MiB)."""
DEFAULT_MAX_INFLIGHT_SIZE = 128 * 1024 * 1024
"""The default `max_inflight_size` of `ToolServer`: bytes all calls in flight may hold (128 MiB)."""
# An answer up to this size is sent in one message (asyncio's default write buffer limit).
_SMALL_ANSWER = 64 * 1024

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec.server")


class ToolServer(_ShellRoutes):
    """HTTP server that runs MCP tools for code in a kernel, once the application approves each call.

    MCP servers are started (or connected to) on their first tool call and kept for later
    calls; calls to different servers run concurrently. With ``approval_required`` each call
    waits for the decision of the application's ``ApprovalClient``.

    Secure by default: it starts only MCP servers the application recorded in ``registry`` (this
    user's registry unless one is given), looked up by ``server_name`` among those whose API lies
    in ``scope``; a request carrying ``server_params`` is refused. ``/run``, ``/approve``,
    ``/shell`` and ``/reset`` require ``Authorization: Bearer <token>`` and the approval WebSocket
    ``Authorization: Bearer <approval_secret>`` (each generated when not given; read them from
    :attr:`token` and :attr:`approval_secret`); every tool call waits for approval; the port is a
    free one (:attr:`port`). Give the kernel the token, never the approval secret.

    ``trust_all_clients=True`` is the open mode, for trusted local use only: anybody who can reach
    the port may run tools (no token or approval secret unless given), and a ``/run`` request may
    carry the ``server_params`` of the MCP server to start; a request without them names a server
    of the registry, or one already running.

    Example:
        ```python
        async with ToolServer() as server:
            async with ApprovalClient(
                callback=on_approval_request, port=server.port, secret=server.approval_secret
            ):
                ...  # code that calls MCP tools gets server.port and server.token
        ```

    Args:
        host: Hostname the server binds to.
        port: Port the server listens on; ``0`` (the default) picks a free port (see :attr:`port`).
        approval_required: Whether tool calls need the application's approval (the default).
        approval_timeout: Seconds to wait for an approval decision.
        connect_timeout: Seconds an MCP server has to start and complete the MCP handshake.
        log_to_stderr: Where the application configured no logging, show the tool server's
            log records on stderr. Records always go through the ``logging`` module (loggers
            ``ipybox.tool_exec`` and ``uvicorn.error``) to the application's own handlers.
        log_level: Level of the stderr output of ``log_to_stderr``; otherwise the application's
            logging configuration decides what is shown.
        registry: The trusted server registry; by default this user's (``default_registry()``).
        token: Bearer token required by ``/run``, ``/approve``, ``/shell`` and ``/reset``;
            generated when ``None`` (none in the open mode).
        approval_secret: Bearer secret required to connect to ``/approval``; generated when
            ``None`` (none in the open mode).
        trust_all_clients: The open mode (see above); only where every client is trusted.
        approve_tool_calls: With ``approval_required``, whether ``/run`` asks for approval;
            ``False`` lets tool calls through unasked while ``/approve`` still asks.
        uds: Also listen on a Unix socket at this path (a sandboxed kernel has no network
            to reach the TCP port through); the file is created with mode ``0600`` and removed
            on `stop()`.
        max_result_size: Bytes one tool result may have as the JSON answer to the kernel (binary
            content counts as its base64); a larger result fails that call with an error naming
            the limit, and the tool server and the kernel carry on.
        max_request_size: Bytes one request body (a tool call with its arguments) may have; a
            larger call fails alone with an error naming the limit. The body is read only after
            the token was checked, and must arrive within 60 s.
        max_inflight_size: Bytes of request bodies and answers all calls in flight may hold
            together (each counted by its size on the wire). A request waits for room before its
            body is read (up to 60 s, then it fails with an error naming the limit); an answer
            that does not fit when its result arrives fails that call alone. One call is counted
            at most this size, so a call of any size up to the limits is run when it is alone.
        kernel_writable: Folders a sandboxed kernel can write (also given by `confine` once the
            kernel's sandbox is known): a stdio server whose program, arguments or working
            directory lie there is refused (see the README's sandbox section).
        scope: The folders the application put on the kernel's import path (a `CodeExecutor`'s
            working directory and its ``kernel_env`` ``PYTHONPATH``): a registered server is run
            only when its API was generated in one of them or a folder directly in one
            (``None``: any registered server).
        shell_runner: Runs the approved shell commands of a kernel that cannot start programs
            (``POST /shell``); also given by `confine` once the kernel's sandbox is known.
            ``None``: ``/shell`` is refused.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 0,
        approval_required: bool = True,
        approval_timeout: float = 60,
        connect_timeout: float = 30,
        log_to_stderr: bool = False,
        log_level: str = "INFO",
        *,
        registry: ServerRegistry | None = None,
        token: str | None = None,
        approval_secret: str | None = None,
        approve_tool_calls: bool = True,
        uds: Path | str | None = None,
        max_result_size: int = DEFAULT_MAX_RESULT_SIZE,
        max_request_size: int = DEFAULT_MAX_REQUEST_SIZE,
        max_inflight_size: int = DEFAULT_MAX_INFLIGHT_SIZE,
        kernel_writable: tuple[Path, ...] = (),
        scope: Path | Sequence[Path] | None = None,
        shell_runner: ShellRunner | None = None,
        trust_all_clients: bool = False,
    ) -> None:
        sizes = {
            "max_result_size": max_result_size,
            "max_request_size": max_request_size,
            "max_inflight_size": max_inflight_size,
        }
        for name, size in sizes.items():
            if size <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, not {size!r}.")
        self.max_request_size = max_request_size
        self.max_inflight_size = max_inflight_size
        self._inflight = _InflightBudget(max_inflight_size)
        self.host = host
        self.uds = Path(uds) if uds is not None else None
        self.max_result_size = max_result_size
        self._port = port
        self.approval_required = approval_required
        self.approval_timeout = approval_timeout
        self.connect_timeout = connect_timeout
        self.log_to_stderr = log_to_stderr
        self.log_level = log_level.upper()
        self.trust_all_clients = trust_all_clients
        self._registry = registry if registry is not None else default_registry()
        self._confinement = KernelConfinement(writable=kernel_writable, shell_runner=shell_runner)
        self.scope = (scope,) if isinstance(scope, Path) else tuple(scope) if scope is not None else None
        self.approve_tool_calls = approve_tool_calls
        self.gate = None
        self.tracing = None
        if not trust_all_clients:
            token = token if token is not None else secrets.token_urlsafe(32)
            approval_secret = approval_secret if approval_secret is not None else secrets.token_urlsafe(32)
        self._token_value, self._approval_secret_value = token, approval_secret
        self._token = BearerToken(token) if token is not None else None
        self._approval_secret = BearerToken(approval_secret) if approval_secret is not None else None
        self._channel = ApprovalChannel(
            approval_required=approval_required, approval_timeout=approval_timeout
        )
        self._sessions: dict[str, tuple[MCPSession, dict[str, Any]]] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        # Each session's tools by name, listed before the first call of it that is asked about.
        self._tools: weakref.WeakKeyDictionary[MCPSession, dict[str, Tool]] = weakref.WeakKeyDictionary()
        self._server: Uvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._app = Starlette(
            routes=[
                Route(ToolServerPaths.RESET, self._reset_endpoint, methods=["PUT"]),
                Route(ToolServerPaths.APPROVE, self._approve_endpoint, methods=["POST"]),
                Route(ToolServerPaths.SHELL, self._shell_endpoint, methods=["POST"]),
                Route("/status", self._status, methods=["GET"]),
                WebSocketRoute("/approval", self._approval),
            ]
        )

    @property
    def port(self) -> int:
        """The port the server listens on (the bound one once started, also for port ``0``)."""
        return self._port

    @property
    def token(self) -> str | None:
        """The bearer token calls need (``None``: none, in the open mode without one)."""
        return self._token_value

    @property
    def approval_secret(self) -> str | None:
        """The bearer secret of the approval WebSocket (``None``: none, in the open mode without one)."""
        return self._approval_secret_value

    @property
    def registry(self) -> ServerRegistry:
        """The trusted registry the server's MCP servers are looked up in."""
        return self._registry

    @property
    def running(self) -> bool:
        """Whether the HTTP server is running."""
        return self._serve_task is not None and not self._serve_task.done()

    @property
    def confinement(self) -> KernelConfinement:
        """Where the kernels write and how their approved shell commands run, as last confined."""
        return self._confinement

    def confine(self, confinement: KernelConfinement) -> None:
        """Take the kernels' confinement, as their gateway just started them.

        Args:
            confinement: Where the kernels write, what stays read-only there, and the runner of
                their approved shell commands; it replaces the one given before.
        """
        self._confinement = confinement

    async def start(self) -> None:
        """Bind the socket and start the HTTP server; returns once it accepts requests.

        Raises:
            RuntimeError: The server is already running.
            OSError: The address could not be bound (e.g. the port is in use).
            ToolServerError: The HTTP server stopped before it was ready.
        """
        if self._serve_task is not None:
            raise RuntimeError(f"The tool server is already running on {self.host}:{self._port}.")
        if self.log_to_stderr:
            _log_to_stderr_unless_configured(self.log_level)
        # Calls gathered in a kernel open their connections all at once; a full backlog drops
        # connection attempts, which the client's TCP retries only after a second.
        sock = listen(self.host, self._port, backlog=1024)
        self._port = sock.getsockname()[1]
        sockets = [sock]
        if self.uds is not None:
            try:
                # Only the application's user may connect (a sandboxed kernel runs as that user).
                sockets.append(listen(self.uds))
            except BaseException:
                sock.close()
                raise
        server = Uvicorn(
            self,
            # No log_config or log_level: uvicorn then leaves the logging configuration alone.
            log_config=None,
            log_level=None,
            access_log=False,
            lifespan="off",
            http=_BoundedHttp,
            ws=_QueuedWebSocket,
            timeout_keep_alive=300,
            timeout_graceful_shutdown=5,
            # Callers are kernels on this machine, never behind a proxy; each of these is work
            # on every request that nobody reads.
            proxy_headers=False,
            server_header=False,
            date_header=False,
        )
        try:
            serve_task = await server.start(sockets)
        except BaseException as exc:  # cancelled too: nothing is left listening
            for bound in sockets:
                bound.close()
            self._unlink_uds()
            if isinstance(exc, RuntimeError):  # uvicorn's failure, from Uvicorn.start
                raise ToolServerError(
                    f"The tool server could not start on {self.host}:{self._port}: {exc}"
                ) from exc
            raise
        self._server, self._serve_task = server, serve_task
        logger.info("Tool server listening on %s:%d", self.host, self._port)

    async def stop(self) -> None:
        """Stop the HTTP server and close every MCP session (stdio servers with their process trees).

        Idempotent.
        """
        server, serve_task = self._server, self._serve_task
        self._server = self._serve_task = None
        await self._channel.disconnect()
        await self.reset()
        if server is not None and serve_task is not None:
            server.request_exit()
            # Broad: how uvicorn's task ended does not change that the server is stopped.
            with contextlib.suppress(Exception):
                await serve_task
        # Sessions started by requests that were still running while the server shut down.
        await self.reset()
        self._unlink_uds()

    def _unlink_uds(self) -> None:
        if self.uds is not None:
            with contextlib.suppress(FileNotFoundError):
                self.uds.unlink()

    async def join(self) -> None:
        """Wait until the HTTP server stops."""
        if self._serve_task is not None:
            # Broad: join() waits for the end, however uvicorn's task ended.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._serve_task)

    async def reset(self) -> None:
        """Close every MCP session; each is started again by its next tool call."""
        sessions = [session for session, _ in self._sessions.values()]
        self._sessions.clear()
        if sessions:
            await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)

    async def __aenter__(self) -> ToolServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _status(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _reset_endpoint(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization", "").encode()):
            return _error_response(401, "failed", _UNAUTHORIZED)
        await self.reset()
        return JSONResponse({"status": "ok"})

        # ---- end of the policy and audit hook for shell commands ----

    async def _approval(self, websocket: WebSocket) -> None:
        if self._approval_secret is not None:
            if not self._approval_secret.accepts(websocket.headers.get("authorization", "")):
                logger.warning("Refused an approval connection without the approval secret.")
                await websocket.close(code=POLICY_VIOLATION)
                return
        await self._channel.connect(websocket)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # POST /run is the hot path (one request per tool call from a kernel): it is served
        # straight from the ASGI messages, everything else goes through Starlette.
        if scope["type"] == "http" and scope["path"] == ToolServerPaths.RUN and scope["method"] == "POST":
            authorization = b""
            length: bytes | None = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value
                elif name == b"content-length":
                    length = value
            # The token is checked before a byte of the body is read: a client without it is
            # answered at once and holds nothing.
            charge = _Charge(self._inflight)
            try:
                if not self._authorized(authorization):
                    status, content = _error(401, "failed", _UNAUTHORIZED)
                else:
                    answer = await self._run(length, receive, charge)
                    if answer is None:
                        return
                    status, content = answer
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(content)).encode()),
                ]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                if len(content) <= _SMALL_ANSWER:
                    await send({"type": "http.response.body", "body": content})
                else:
                    # A large answer stays counted until the client has taken most of it: the
                    # last, empty message waits while the connection's write buffer is full.
                    await send({"type": "http.response.body", "body": content, "more_body": True})
                    del content
                    await send({"type": "http.response.body", "body": b""})
            finally:
                charge.release()
        else:
            await self._app(scope, receive, send)
