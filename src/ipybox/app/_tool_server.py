"""The tool server: runs MCP tools for code in a kernel, after the application approves each call.

Endpoints:

- ``POST /run`` with ``{"server_name", "tool_name", "tool_args", "server_params"?,
  "content"?}`` answers ``{"result": ...}`` (the structured content, else the text parts
  joined), or with ``"content": true`` ``{"content": [MCP content blocks], "structured": ...}``;
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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from pathlib import Path
from typing import Any, Literal

from mcp.types import (
    AudioContent,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    TextContent,
    TextResourceContents,
    Tool,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ipybox._infra import BearerToken, Uvicorn, listen
from ipybox.app._approval_server import (
    POLICY_VIOLATION,
    ApprovalChannel,
    ApprovalClientDisconnected,
    NoApprovalClientError,
)
from ipybox.app._mcp import MCPSession
from ipybox.app._params import StdioParams, confine, resolve_params
from ipybox.app._registry import ServerRegistry
from ipybox.app._shell import KernelConfinement, ShellResult, ShellRunner
from ipybox.errors import MCPServerError, ServerParamsError, ToolCallOutcome

__all__ = ["DEFAULT_MAX_INFLIGHT_SIZE", "DEFAULT_MAX_REQUEST_SIZE", "DEFAULT_MAX_RESULT_SIZE", "ToolServer"]

DEFAULT_MAX_RESULT_SIZE = 32 * 1024 * 1024
DEFAULT_MAX_REQUEST_SIZE = 32 * 1024 * 1024
DEFAULT_MAX_INFLIGHT_SIZE = 128 * 1024 * 1024
# What a client may hold of the server: a request head (request line and headers) of this many
# bytes, arriving within this many seconds of the connection (or of its previous request); a
# body within _BODY_TIMEOUT; and this many open connections at once.
_MAX_HEAD_SIZE = 64 * 1024
_HEAD_TIMEOUT = 10.0
_BODY_TIMEOUT = 60.0
_MAX_CONNECTIONS = 512
# How long a request waits for room in the tool server's max_inflight_size before it fails.
_INFLIGHT_WAIT = 60.0
# An answer up to this size is sent in one message (asyncio's default write buffer limit).
_SMALL_ANSWER = 64 * 1024
# What an MCP message may carry besides the result itself (JSON-RPC envelope, escapes).
_ENVELOPE_ALLOWANCE = 1024 * 1024

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec.server")


class _RunRequest(BaseModel):
    """The body of ``POST /run``."""

    model_config = ConfigDict(extra="forbid")

    server_name: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    tool_args: dict[str, Any] = Field(default_factory=dict)
    server_params: dict[str, Any] | None = None
    # Whether the answer carries every content part and the structured content (``run_content``).
    content: bool = False


class _ShellRequest(BaseModel):
    """The body of ``POST /shell``."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["shell", "shell_magic"]
    # The command line (``shell``), or the cell fed to the program on stdin (``shell_magic``).
    cmd: str
    # The cell magic's program and its arguments (``shell_magic`` only).
    argv: list[str] | None = None
    cwd: str = Field(min_length=1)


class _ToolCallError(Exception):
    """A ``/run`` request ends with this HTTP status, outcome kind and message."""

    def __init__(self, status: int, kind: ToolCallOutcome, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class _BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on what one client can hold of the server.

    A request head over ``_MAX_HEAD_SIZE`` bytes is refused with 400 (uvicorn's own answer to a
    request it cannot parse), a connection whose request head has not arrived within
    ``_HEAD_TIMEOUT`` seconds is closed, and a connection beyond ``_MAX_CONNECTIONS`` open ones
    is closed at once: a client that connects and stalls holds neither memory nor descriptors
    for long. Idle keep-alive connections are closed after ``timeout_keep_alive``.
    """

    _head_timer: asyncio.TimerHandle | None = None
    _head_size = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > _MAX_CONNECTIONS:
            logger.debug("Closed a connection over the limit of %d open connections.", _MAX_CONNECTIONS)
            transport.abort()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def _count_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > _MAX_HEAD_SIZE:
            # Raised inside the parser: uvicorn answers 400 and closes the connection.
            raise ValueError(f"request head over {_MAX_HEAD_SIZE} bytes")

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(_HEAD_TIMEOUT, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class _BodyTooLarge(Exception):
    """A request body over the tool server's ``max_request_size``."""


class _InflightBudget:
    """Bytes of requests and results held for the calls in flight, with a total limit.

    A charge is cut to the limit, so that one call of any size is admitted when it is alone.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: list[asyncio.Future[None]] = []

    def try_take(self, size: int) -> int | None:
        """Take ``size`` bytes (cut to the limit) if they fit now; the bytes taken, else ``None``."""
        size = min(size, self.limit)
        if self.held + size > self.limit:
            return None
        self.held += size
        return size

    async def take(self, size: int) -> int:
        """Take ``size`` bytes (cut to the limit), waiting for room; ``TimeoutError`` after ``_INFLIGHT_WAIT``."""
        taken = self.try_take(size)
        if taken is not None:
            return taken
        async with asyncio.timeout(_INFLIGHT_WAIT):
            while (taken := self.try_take(size)) is None:
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                finally:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
        return taken

    def give(self, size: int) -> None:
        """Give back bytes taken; every waiter checks again whether its call fits."""
        self.held -= size
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class _Charge:
    """The bytes of the in-flight budget one request holds: its body, then its answer."""

    def __init__(self, budget: _InflightBudget) -> None:
        self.budget = budget
        self.size = 0

    async def take(self, size: int) -> None:
        self.size = await self.budget.take(size)

    def swap(self, size: int) -> bool:
        """Hold ``size`` bytes instead of what is held, if they fit now; otherwise hold nothing."""
        self.release()
        taken = self.budget.try_take(size)
        self.size = taken or 0
        return taken is not None

    def release(self) -> None:
        if self.size:
            self.budget.give(self.size)
            self.size = 0


class ToolServer:
    """HTTP server that runs MCP tools for code in a kernel, with optional approval.

    MCP servers are started (or connected to) on their first tool call and kept for later
    calls; calls to different servers run concurrently. With ``approval_required`` each call
    waits for the decision of the application's ``ApprovalClient``.

    Two ways to use it:

    - **Trusted local use** (``ToolServer()`` as in the API reference): a ``/run`` request
      may carry the ``server_params`` of the MCP server to start, and anybody who can reach the
      port may run tools. Use it only where every client is trusted. A request without
      ``server_params`` (what code generated by ``generate_mcp_sources`` sends) names a server
      of the default trusted registry, which ``generate_mcp_sources`` filled.
    - **Secured mode** (what ``CodeExecutor`` uses), enabled by ``registry``: the tool server
      starts only MCP servers the application recorded in the registry, looked up by
      ``server_name``; a request carrying ``server_params`` is refused. ``token`` makes ``/run``
      and ``/reset`` require ``Authorization: Bearer <token>``; ``approval_secret`` makes the
      approval WebSocket require ``Authorization: Bearer <approval_secret>``. Give the kernel the
      token, never the approval secret.

    Example:
        .. code-block:: python

            async with ToolServer(approval_required=True) as server:
                async with ApprovalClient(callback=on_approval_request, port=server.port):
                    ...  # execute code that calls MCP tools

    Args:
        host: Hostname the server binds to.
        port: Port the server listens on; ``0`` picks a free port (see :attr:`port`).
        approval_required: Whether tool calls need the application's approval.
        approval_timeout: Seconds to wait for an approval decision.
        connect_timeout: Seconds an MCP server has to start and complete the MCP handshake.
        log_to_stderr: Where the application configured no logging, show the tool server's
            log records on stderr. Records always go through the ``logging`` module (loggers
            ``ipybox.tool_exec`` and ``uvicorn.error``) to the application's own handlers.
        log_level: Level of the stderr output of ``log_to_stderr``; otherwise the application's
            logging configuration decides what is shown.
        registry: The trusted server registry; enables the secured mode.
        token: Bearer token required by ``/run`` and ``/reset``.
        approval_secret: Bearer secret required to connect to ``/approval``.
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
        scope: The executor's working directory: a registered server is run only when its API was
            generated in this folder or a folder directly in it (``None``: any registered server).
        shell_runner: Runs the approved shell commands of a kernel that cannot start programs
            (``POST /shell``); also given by `confine` once the kernel's sandbox is known.
            ``None``: ``/shell`` is refused.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 8900,
        approval_required: bool = False,
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
        scope: Path | None = None,
        shell_runner: ShellRunner | None = None,
    ) -> None:
        if max_result_size <= 0:
            raise ValueError(f"max_result_size must be a positive number of bytes, not {max_result_size!r}.")
        if max_request_size <= 0:
            raise ValueError(
                f"max_request_size must be a positive number of bytes, not {max_request_size!r}."
            )
        if max_inflight_size <= 0:
            raise ValueError(
                f"max_inflight_size must be a positive number of bytes, not {max_inflight_size!r}."
            )
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
        self._registry = registry
        self._confinement = KernelConfinement(writable=kernel_writable, shell_runner=shell_runner)
        self.scope = scope
        self._fallback_registry: ServerRegistry | None = None
        self.approve_tool_calls = approve_tool_calls
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
                Route("/reset", self._reset_endpoint, methods=["PUT"]),
                Route("/approve", self._approve_endpoint, methods=["POST"]),
                Route("/shell", self._shell_endpoint, methods=["POST"]),
                Route("/status", self._status, methods=["GET"]),
                WebSocketRoute("/approval", self._approval),
            ]
        )

    @property
    def port(self) -> int:
        """The port the server listens on (the bound one once started, also for port ``0``)."""
        return self._port

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
            ws="websockets-sansio",
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
            if isinstance(exc, RuntimeError):
                raise RuntimeError(
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

    async def _approve_endpoint(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization", "").encode()):
            return _error_response(401, "failed", _UNAUTHORIZED)
        charge = _Charge(self._inflight)
        try:
            return await self._approve_body(request, charge)
        finally:
            charge.release()

    async def _approve_body(self, request: Request, charge: _Charge) -> Response:
        raw = await self._read_body(request.headers.get("content-length"), request.receive, charge)
        if raw is None:
            return Response(status_code=400)  # the client left; nobody reads this
        if isinstance(raw, tuple):
            status, content = raw
            return Response(content, status_code=status, media_type="application/json")
        try:
            body = _RunRequest.model_validate_json(raw)
        except ValidationError as exc:
            return _error_response(400, "failed", f"The approval request is malformed: {_summarise(exc)}")
        del raw
        if body.server_params:
            return _error_response(400, "failed", "An approval request cannot carry server_params.")
        try:
            await self._approve(body, f"{body.server_name}.{body.tool_name}")
        except _ToolCallError as exc:
            return _error_response(exc.status, exc.kind, exc.message)
        return JSONResponse({"result": None})

    async def _shell_endpoint(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization", "").encode()):
            return _error_response(401, "failed", _UNAUTHORIZED)
        # The body (a command line) counts toward the in-flight budget only while it is read.
        charge = _Charge(self._inflight)
        try:
            raw = await self._read_body(request.headers.get("content-length"), request.receive, charge)
        finally:
            charge.release()
        if raw is None:
            return Response(status_code=400)  # the client left; nobody reads this
        if isinstance(raw, tuple):
            status, content = raw
            return Response(content, status_code=status, media_type="application/json")
        try:
            body = _ShellRequest.model_validate_json(raw)
        except ValidationError as exc:
            return _error_response(
                400, "failed", f"The shell command request is malformed: {_summarise(exc)}"
            )
        runner = self._confinement.shell_runner
        if runner is None:
            return _error_response(
                400,
                "failed",
                "This tool server runs no shell commands: only a sandboxed kernel whose shell commands need "
                "approval sends them here (CodeExecutor(sandbox=True, approve_shell_cmds=True)).",
            )
        if body.kind == "shell_magic" and not body.argv:
            return _error_response(400, "failed", "A shell_magic request needs argv, the program to run.")
        tool_args, argv = _shell_call(body)
        approval = _RunRequest(server_name="ipybox", tool_name=body.kind, tool_args=tool_args)
        try:
            await self._approve(approval, f"ipybox.{body.kind}")
        except _ToolCallError as exc:
            return _error_response(exc.status, exc.kind, exc.message)
        running = await _run_while_connected(runner, body, argv, request.receive)
        if running.cancelled():
            return Response(status_code=400)  # the client left; nobody reads this
        try:
            result = running.result()
        except OSError as exc:
            return _error_response(502, "failed", f"The shell command could not be started: {exc}")
        return Response(
            _json(
                {
                    "stdout": result.stdout.decode(errors="replace"),
                    "stderr": result.stderr.decode(errors="replace"),
                    "exit_code": result.exit_code,
                    "stopped": result.stopped,
                }
            ),
            media_type="application/json",
        )

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
        if scope["type"] == "http" and scope["path"] == "/run" and scope["method"] == "POST":
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

    async def _run(self, length: bytes | None, receive: Receive, charge: _Charge) -> tuple[int, bytes] | None:
        """The answer to a ``/run`` request whose token was checked; ``None`` if the client left."""
        raw = await self._read_body(length, receive, charge)
        if raw is None or isinstance(raw, tuple):
            return raw
        try:
            body = _RunRequest.model_validate_json(raw)
        except ValidationError as exc:
            return _error(400, "failed", f"The tool call request is malformed: {_summarise(exc)}")
        del raw  # the parsed request is all that is kept of it
        return await self._handle_run(body, charge)

    async def _read_body(
        self, length: bytes | str | None, receive: Receive, charge: _Charge
    ) -> bytes | bytearray | tuple[int, bytes] | None:
        """A request's body; an error answer if it is too large or too slow; ``None`` if the client left.

        Before the body is read, ``charge`` takes its size (its Content-Length, else
        ``max_request_size``) of the in-flight budget, waiting for room. A body refused (over
        ``max_request_size``, or no room) is read to its end without being kept, so that an honest
        client gets the answer rather than a connection reset while it is still sending.
        """
        try:
            expected = int(length) if length is not None else None
        except ValueError:
            return _error(400, "failed", "The request's Content-Length is not a number.")
        if expected is not None and expected > self.max_request_size:
            return await self._refuse_body(receive, 413, self._request_too_large())
        try:
            await charge.take(self.max_request_size if expected is None else expected)
        except TimeoutError:
            return await self._refuse_body(
                receive,
                503,
                f"The tool call was not run: it waited {_INFLIGHT_WAIT:g} s for room in the tool server's limit "
                f"of {_size(self.max_inflight_size)} for the requests and answers of all calls in flight "
                "(ToolServer max_inflight_size); make fewer large calls at once.",
            )
        buffer = bytearray()
        try:
            async with asyncio.timeout(_BODY_TIMEOUT):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(buffer) + len(chunk) > self.max_request_size:
                        break
                    if not more and not buffer:
                        return bytes(chunk)  # the whole body in one message (bytes(b) is b: no copy)
                    buffer += chunk
                    if not more:
                        return buffer
        except TimeoutError:
            return _error(408, "failed", f"The request body did not arrive within {_BODY_TIMEOUT:g} s.")
        del buffer
        return await self._refuse_body(receive, 413, self._request_too_large())

    async def _refuse_body(self, receive: Receive, status: int, message: str) -> tuple[int, bytes] | None:
        """Read the rest of a refused body without keeping it, then the error answer; ``None`` if the client left."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_BODY_TIMEOUT):
                more = True
                while more:
                    received = await receive()
                    if received["type"] == "http.disconnect":
                        return None
                    more = received.get("more_body", False)
        return _error(status, "failed", message)

    def _request_too_large(self) -> str:
        return (
            f"The tool call is over the tool server's limit of {_size(self.max_request_size)} per request "
            "(ToolServer max_request_size) and was not run; pass large data another way (write it to a "
            "file and pass its path), or in smaller parts."
        )

    async def _handle_run(self, body: _RunRequest, charge: _Charge) -> tuple[int, bytes]:
        call = f"{body.server_name}.{body.tool_name}"
        try:
            params = self._server_params(body)
            if self.approve_tool_calls and self.approval_required:
                # What the person is asked about must be a call the server can take as shown.
                session = await self._session(body.server_name, params, call)
                await self._check_call(session, body, call)
                await self._approve(body, call)
            else:
                session = await self._session(body.server_name, params, call)
            result = await session.call_tool_content(body.tool_name, body.tool_args)
            body.tool_args = {}  # no longer needed: not held while the answer is made
        except _ToolCallError as exc:
            return _error(exc.status, exc.kind, exc.message)
        except MCPServerError as exc:
            return _error(502, "failed", f"Tool call {call} failed: {exc}")
        if body.content and (least := _least_size(result.content)) > self.max_result_size:
            # Refused before it is serialised: no copies of a blob far over the limit.
            return self._too_large(call, least, "at least ")
        if body.content:
            answer = _json(
                {
                    "content": [
                        block.model_dump(mode="json", by_alias=True, exclude_none=True)
                        for block in result.content
                    ],
                    "structured": result.structured_content,
                }
            )
        elif result.structured_content is not None:
            answer = _json({"result": result.structured_content})
        else:
            texts = [block.text for block in result.content if isinstance(block, TextContent)]
            answer = _json({"result": "\n".join(texts) if texts else None})
        if len(answer) > self.max_result_size:
            return self._too_large(call, len(answer))
        del result
        # The answer is counted instead of the request from here until it is sent.
        if not charge.swap(len(answer)):
            return _error(
                503,
                "failed",
                f"Tool call {call} failed: its result of {_size(len(answer))} did not fit in the tool server's "
                f"limit of {_size(self.max_inflight_size)} for the requests and answers of all calls in flight "
                "(ToolServer max_inflight_size) while other calls held it; make fewer large calls at once, "
                "or ask the tool for less at a time.",
            )
        return 200, answer

    async def _check_call(self, session: MCPSession, body: _RunRequest, call: str) -> None:
        """Refuse a call of a tool the server does not list, or with arguments its schema does not declare."""
        tools = self._tools.get(session)
        if tools is None or body.tool_name not in tools:
            # Listed again when a tool is not found: the server's tool list may have changed.
            tools = {tool.name: tool for tool in await session.list_tools()}
            self._tools[session] = tools
        tool = tools.get(body.tool_name)
        if tool is None:
            names = ", ".join(repr(name) for name in sorted(tools)[:30])
            raise _ToolCallError(
                404,
                "failed",
                f"Tool call {call} failed: MCP server {body.server_name!r} has no tool {body.tool_name!r} "
                f"(its tools: {names or 'none'}); nothing was asked or run.",
            )
        problem = _argument_problem(tool.input_schema, body.tool_args)
        if problem is not None:
            raise _ToolCallError(
                400, "failed", f"Tool call {call} failed: {problem}; nothing was asked or run."
            )

    def _too_large(self, call: str, size: int, qualifier: str = "") -> tuple[int, bytes]:
        return _error(
            502,
            "failed",
            f"Tool call {call} failed: its result is {qualifier}{_size(size)}, over the tool server's limit "
            f"of {_size(self.max_result_size)} per result (ToolServer max_result_size); ask the tool for "
            "less at a time (a smaller page, image or file).",
        )

    def _authorized(self, authorization: bytes) -> bool:
        return self._token is None or self._token.accepts(authorization)

    def _server_params(self, body: _RunRequest) -> dict[str, Any]:
        call = f"{body.server_name}.{body.tool_name}"
        if body.server_params:
            if self._registry is not None:
                raise _ToolCallError(
                    403,
                    "failed",
                    f"Tool call {call} failed: this tool server runs only MCP servers registered by the "
                    "application, so a request cannot supply server_params; name a registered server instead.",
                )
            return body.server_params
        # A plain tool server reads the default registry, where generate_mcp_sources records servers.
        registry = self._registry if self._registry is not None else self._default_registry()
        try:
            params = registry.lookup_shared(body.server_name, self.scope)
        except OSError as exc:
            raise _ToolCallError(500, "failed", f"The MCP server registry could not be read: {exc}") from exc
        if params is not None:
            return params
        if self._registry is None:
            running = self._sessions.get(body.server_name)
            if running is not None:
                return running[1]
            raise _ToolCallError(
                400,
                "failed",
                f"Tool call {call} failed: the request has no server_params and MCP server "
                f"{body.server_name!r} is neither running nor registered in {registry.path}; generate its API "
                "with generate_mcp_sources, or send server_params.",
            )
        where = f" into a folder inside {self.scope}" if self.scope is not None else ""
        raise _ToolCallError(
            404,
            "failed",
            f"Tool call {call} failed: MCP server {body.server_name!r} is not registered for this executor; "
            f"generate its API with generate_mcp_sources(...){where} from this application.",
        )

    def _default_registry(self) -> ServerRegistry:
        if self._fallback_registry is None:
            self._fallback_registry = ServerRegistry()
        return self._fallback_registry

    async def _approve(self, body: _RunRequest, call: str) -> None:
        try:
            accepted = await self._channel.request(body.server_name, body.tool_name, body.tool_args)
        except NoApprovalClientError:
            raise _ToolCallError(
                503,
                "failed",
                f"Tool call {call} failed: it needs approval, but the application's approval client is not "
                "connected to the tool server; connect an ApprovalClient before running code that calls tools.",
            ) from None
        except ApprovalClientDisconnected:
            raise _ToolCallError(
                503, "failed", f"Tool call {call} failed: the approval client disconnected before it decided."
            ) from None
        except TimeoutError:
            raise _ToolCallError(
                504,
                "expired",
                f"Tool call {call} expired: the application made no approval decision within "
                f"{self.approval_timeout:g} s.",
            ) from None
        if not accepted:
            raise _ToolCallError(403, "rejected", f"Tool call {call} was rejected by the application.")

    async def _session(self, server_name: str, params: dict[str, Any], call: str) -> MCPSession:
        running = self._sessions.get(server_name)
        if running is not None and running[0].alive and running[1] == params:
            return running[0]
        lock = self._starting.setdefault(server_name, asyncio.Lock())
        async with lock:
            running = self._sessions.get(server_name)
            if running is not None:
                if running[0].alive and running[1] == params:
                    return running[0]
                del self._sessions[server_name]
                await running[0].close()
            try:
                resolved = resolve_params(params)
            except ServerParamsError as exc:
                # Parameters from a request are the client's mistake; registered ones the application's.
                status = 400 if self._registry is None else 500
                raise _ToolCallError(status, "failed", f"Tool call {call} failed: {exc}") from exc
            confinement = self._confinement
            if isinstance(resolved, StdioParams) and confinement.writable:
                try:
                    resolved = confine(server_name, resolved, confinement.writable, confinement.readonly)
                except ServerParamsError as exc:
                    raise _ToolCallError(403, "failed", f"Tool call {call} failed: {exc}") from exc
            session = MCPSession(
                server_name, resolved, self.connect_timeout, self.max_result_size + _ENVELOPE_ALLOWANCE
            )
            await session.start()
            self._sessions[server_name] = (session, params)
            return session


def _shell_call(body: _ShellRequest) -> tuple[dict[str, Any], list[str]]:
    """The arguments a shell request is approved with, and the program line it runs."""
    if body.kind == "shell":
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
    cell = body.cmd.encode() if body.kind == "shell_magic" else None
    running = asyncio.ensure_future(runner.run(argv, cwd=body.cwd, stdin=cell, merge=body.kind == "shell"))
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


async def _disconnected(receive: Receive) -> None:
    """Return once the client has closed its connection (the request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _argument_problem(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """What is wrong with the arguments' names for the tool's input schema, if anything.

    An argument the schema does not declare is refused unless the schema allows more
    (``additionalProperties`` true or a schema, or ``patternProperties``); a required one must be there.
    """
    properties = schema.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    extra = schema.get("additionalProperties")
    if not (extra is True or isinstance(extra, dict) or schema.get("patternProperties")):
        undeclared = [name for name in args if name not in declared]
        if undeclared:
            known = ", ".join(repr(name) for name in declared) or "none"
            return (
                f"the tool's input schema does not declare the argument(s) "
                f"{', '.join(repr(name) for name in undeclared)} (it declares: {known})"
            )
    required = schema.get("required")
    missing = [name for name in required if name not in args] if isinstance(required, list) else []
    if missing:
        return f"the tool requires the argument(s) {', '.join(repr(name) for name in missing)}"
    return None


def _least_size(content: list[ContentBlock]) -> int:
    """A lower bound of the content's size as JSON: its texts and base64 data alone."""
    size = 0
    for block in content:
        if isinstance(block, TextContent):
            size += len(block.text)
        elif isinstance(block, ImageContent | AudioContent):
            size += len(block.data)
        elif isinstance(block, EmbeddedResource):
            resource = block.resource
            size += len(resource.text if isinstance(resource, TextResourceContents) else resource.blob)
    return size


def _size(size: int) -> str:
    if size >= 1024 * 1024:
        return f"{size / (1024 * 1024):.1f} MiB ({size} bytes)"
    return f"{size} bytes"


_UNAUTHORIZED = (
    "The tool server refused the request: it needs the tool server token as 'Authorization: Bearer <token>'."
)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _error(status: int, kind: ToolCallOutcome, message: str) -> tuple[int, bytes]:
    return status, _json({"error": {"kind": kind, "message": message}})


def _error_response(status: int, kind: ToolCallOutcome, message: str) -> Response:
    status, content = _error(status, kind, message)
    return Response(content, status_code=status, media_type="application/json")


def _summarise(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()
    )


class _StderrFallback(logging.StreamHandler):  # type: ignore[type-arg]  # generic only in typeshed
    """Writes ipybox's records to stderr for an application that configured no logging."""


def _log_to_stderr_unless_configured(level: str) -> None:
    """``log_to_stderr``: where the application has no logging set up, show ipybox's records on
    stderr. An application with its own handlers gets the records through them instead, and
    the logging configuration is left as the application made it."""
    if logging.getLogger().handlers:
        return
    package = logging.getLogger("ipybox")
    if not any(isinstance(handler, _StderrFallback) for handler in package.handlers):
        handler = _StderrFallback()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(level)
