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

The server is composed of parts that receive what they need when they are made: the decision
chain (``app/approval/_chain.py``) decides every call, ``/run`` is served by `ToolCalls`
(``_calls.py``) with the MCP sessions of `ServerSessions` (``_sessions.py``), ``/approve`` and
``/shell`` by `ShellRoutes` (``_shell_routes.py``); this module holds the lifecycle and the routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket
from typing_extensions import Unpack

from ipybox._infra import Uvicorn, listen
from ipybox._wire import ToolServerPaths
from ipybox.app.approval import POLICY_VIOLATION, ApprovalChannel, DecisionChain, Gate
from ipybox.app.mcp_client import MCPSession, ServerRegistry, default_registry
from ipybox.app.sandbox import KernelConfinement
from ipybox.app.tools._calls import ToolCalls, _RunRequest
from ipybox.app.tools._http import (
    _UNAUTHORIZED,
    BodyReader,
    _BoundedHttp,
    _Charge,
    _error,
    _error_response,
    _InflightBudget,
    _log_to_stderr_unless_configured,
    _QueuedWebSocket,
)
from ipybox.app.tools._options import (
    DEFAULT_MAX_INFLIGHT_SIZE,
    DEFAULT_MAX_REQUEST_SIZE,
    DEFAULT_MAX_RESULT_SIZE,
    Access,
    CallSpans,
    FlatOptions,
    Limits,
    gather,
)
from ipybox.app.tools._sessions import ServerSessions
from ipybox.app.tools._shell_routes import ShellRoutes
from ipybox.errors import ToolServerError

__all__ = [
    "DEFAULT_MAX_INFLIGHT_SIZE",
    "DEFAULT_MAX_REQUEST_SIZE",
    "DEFAULT_MAX_RESULT_SIZE",
    "Access",
    "Limits",
    "ToolServer",
]

# An answer up to this size is sent in one message (asyncio's default write buffer limit).
_SMALL_ANSWER = 64 * 1024

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec.server")


class ToolServer:
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
        scope: The folders the application put on the kernel's import path (a `CodeExecutor`'s
            working directory and its ``kernel_env`` ``PYTHONPATH``): a registered server is run
            only when its API was generated in one of them or a folder directly in one
            (``None``: any registered server).
        approve_tool_calls: With ``approval_required``, whether ``/run`` asks for approval;
            ``False`` lets tool calls through unasked while ``/approve`` still asks.
        uds: Also listen on a Unix socket at this path (a sandboxed kernel has no network
            to reach the TCP port through); the file is created with mode ``0600`` and removed
            on `stop()`.
        limits: The size limits of requests and results (`Limits`).
        access: The token, the approval secret and the open mode (`Access`; see above).
        confinement: Where a sandboxed kernel writes (a stdio server whose program, arguments or
            working directory lie there is refused; see the README's sandbox section) and the
            runner of the approved shell commands of a kernel that cannot start programs
            (``POST /shell``; ``None``: refused); also given by `confine` once the kernel's sandbox
            is known.
        gate: The policy rules, what the session accepted to remember and the audit trail of the
            executor's session (``None``: every call asks, none is recorded).
        tracing: Spans of calls, approval waits and server starts (``None``: none).
        **flat: The settings of `limits`, `access` and `confinement` one by one, as keywords
            (``max_result_size``, ``max_request_size``, ``max_inflight_size``, ``token``,
            ``approval_secret``, ``trust_all_clients``, ``kernel_writable``, ``shell_runner``).

    Raises:
        TypeError: A setting was given both as a keyword and in its option object.
        ValueError: A size limit is not a positive number of bytes.
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
        scope: Path | Sequence[Path] | None = None,
        approve_tool_calls: bool = True,
        uds: Path | str | None = None,
        limits: Limits | None = None,
        access: Access | None = None,
        confinement: KernelConfinement | None = None,
        gate: Gate | None = None,
        tracing: CallSpans | None = None,
        **flat: Unpack[FlatOptions],
    ) -> None:
        limits, access, confinement = gather(limits, access, confinement, flat)
        access = access.secured()
        self.limits = limits
        self.max_result_size = limits.max_result_size
        self.max_request_size = limits.max_request_size
        self.max_inflight_size = limits.max_inflight_size
        self._inflight = _InflightBudget(limits.max_inflight_size)
        self.host = host
        self.uds = Path(uds) if uds is not None else None
        self._port = port
        self.approval_required = approval_required
        self.approval_timeout = approval_timeout
        self.connect_timeout = connect_timeout
        self.log_to_stderr = log_to_stderr
        self.log_level = log_level.upper()
        self.trust_all_clients = access.trust_all_clients
        self.approve_tool_calls = approve_tool_calls
        self._registry = registry if registry is not None else default_registry()
        self._confinement = confinement
        self._access = access
        self._token, self._approval_secret = access.bearers()
        self._channel = ApprovalChannel(
            approval_required=approval_required, approval_timeout=approval_timeout
        )
        chain = DecisionChain(self._channel, gate, tracing)
        reader = BodyReader(limits.max_request_size, limits.max_inflight_size)
        self._servers = ServerSessions(
            self._registry,
            scope,
            trust_all_clients=access.trust_all_clients,
            connect_timeout=connect_timeout,
            max_result_size=limits.max_result_size,
            confinement=lambda: self._confinement,
            tracing=tracing,
        )
        self.scope = self._servers.scope
        self._calls = ToolCalls(
            chain,
            self._servers,
            limits,
            reader,
            ask=approve_tool_calls and approval_required,
            tracing=tracing,
        )
        self._shell = ShellRoutes(chain, reader, self._inflight, self._authorized, lambda: self._confinement)
        self._server: Uvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._app = Starlette(
            routes=[
                Route(ToolServerPaths.RESET, self._reset_endpoint, methods=["PUT"]),
                Route(ToolServerPaths.APPROVE, self._shell.approve_endpoint, methods=["POST"]),
                Route(ToolServerPaths.SHELL, self._shell.shell_endpoint, methods=["POST"]),
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
        return self._access.token

    @property
    def approval_secret(self) -> str | None:
        """The bearer secret of the approval WebSocket (``None``: none, in the open mode without one)."""
        return self._access.approval_secret

    @property
    def inflight(self) -> _InflightBudget:
        """The in-flight budget of request and answer bytes every call counts toward."""
        return self._inflight

    @property
    def _sessions(self) -> dict[str, tuple[MCPSession, dict[str, Any]]]:
        # The running MCP sessions by server name (tests read them to see a reset's end).
        return self._servers.running

    async def run_call(self, body: _RunRequest, charge: _Charge) -> tuple[int, bytes]:
        """The answer to one tool call (``POST /run``'s, or a kernel's stdin channel's); see `ToolCalls.run_call`."""
        return await self._calls.run_call(body, charge)

    async def approve_only(self, body: _RunRequest) -> tuple[int, bytes]:
        """The answer to an ask-only request (``POST /approve``'s, or the stdin channel's); see `ShellRoutes.approve_only`."""
        return await self._shell.approve_only(body)

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
        await self._servers.close_all()

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

    def _authorized(self, authorization: bytes) -> bool:
        return self._token is None or self._token.accepts(authorization)

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
                    answer = await self._calls.run(length, receive, charge)
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
