"""The tool server: runs MCP tools for code in a kernel, after the application approves each call.

Endpoints:

- ``POST /run`` with ``{"server_name", "tool_name", "tool_args", "server_params"?}`` answers
  ``{"result": ...}``, or an error with a real status code and the body
  ``{"error": {"kind": "rejected" | "expired" | "failed", "message": "..."}}``: 400 malformed
  request or parameters, 401 missing or wrong token, 403 rejected by the application or
  ``server_params`` refused (secured mode), 404 server not registered, 502 the MCP server
  failed (could not start, tool error, crash), 503 no approval client, 504 approval expired.
- ``POST /approve`` with ``{"server_name": "ipybox", "tool_name", "tool_args"}`` only asks the
  application for a decision, for what the kernel runs itself (shell commands); it answers
  ``{"result": null}`` once accepted, or an error as ``/run`` does.
- ``PUT /reset`` closes every MCP session (they start again on the next call).
- ``WS /approval`` is where the application's ``ApprovalClient`` connects.
- ``GET /status`` answers ``{"status": "ok"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from ipybox.errors import MCPServerError, ServerParamsError, ToolCallOutcome
from ipybox.tool_exec._mcp import MCPSession
from ipybox.tool_exec._params import resolve_params
from ipybox.tool_exec._registry import ServerRegistry
from ipybox.tool_exec.approval.server import (
    POLICY_VIOLATION,
    ApprovalChannel,
    ApprovalClientDisconnected,
    NoApprovalClientError,
)

__all__ = ["ToolServer"]

logger = logging.getLogger(__name__)


class _RunRequest(BaseModel):
    """The body of ``POST /run``."""

    model_config = ConfigDict(extra="forbid")

    server_name: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    tool_args: dict[str, Any] = Field(default_factory=dict)
    server_params: dict[str, Any] | None = None


class _ToolCallError(Exception):
    """A ``/run`` request ends with this HTTP status, outcome kind and message."""

    def __init__(self, status: int, kind: ToolCallOutcome, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


class _Uvicorn(uvicorn.Server):
    """uvicorn embedded in an application: reports readiness, leaves signal handling to the app."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ToolServer:
    """HTTP server that runs MCP tools for code in a kernel, with optional approval.

    MCP servers are started (or connected to) on their first tool call and kept for later
    calls; calls to different servers run concurrently. With ``approval_required`` each call
    waits for the decision of the application's ``ApprovalClient``.

    Two ways to use it:

    - **Trusted local use** (``ToolServer()`` as in the API reference): a ``/run`` request
      carries the ``server_params`` of the MCP server to start, and anybody who can reach the
      port may run tools. Use it only where every client is trusted.
    - **Secured mode** (what ``CodeExecutor`` uses), enabled by ``registry``: the tool server
      starts only MCP servers the application recorded in the registry, looked up by
      ``server_name``; a request carrying ``server_params`` is refused. ``token`` makes ``/run``
      and ``/reset`` require ``Authorization: Bearer <token>``; ``approval_secret`` makes the
      approval WebSocket require ``Authorization: Bearer <approval_secret>``. Give the kernel the
      token, never the approval secret.

    Example:
        ```python
        async with ToolServer(approval_required=True) as server:
            async with ApprovalClient(callback=on_approval_request, port=server.port):
                ...  # execute code that calls MCP tools
        ```

    Args:
        host: Hostname the server binds to.
        port: Port the server listens on; ``0`` picks a free port (see :attr:`port`).
        approval_required: Whether tool calls need the application's approval.
        approval_timeout: Seconds to wait for an approval decision.
        connect_timeout: Seconds an MCP server has to start and complete the MCP handshake.
        log_to_stderr: Log to stderr instead of stdout.
        log_level: Logging level of the tool server (DEBUG, INFO, WARNING, ERROR, CRITICAL).
        registry: The trusted server registry; enables the secured mode.
        token: Bearer token required by ``/run`` and ``/reset``.
        approval_secret: Bearer secret required to connect to ``/approval``.
        approve_tool_calls: With ``approval_required``, whether ``/run`` asks for approval;
            ``False`` lets tool calls through unasked while ``/approve`` still asks.
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
    ) -> None:
        self.host = host
        self._port = port
        self.approval_required = approval_required
        self.approval_timeout = approval_timeout
        self.connect_timeout = connect_timeout
        self.log_to_stderr = log_to_stderr
        self.log_level = log_level.upper()
        self._registry = registry
        self.approve_tool_calls = approve_tool_calls
        self._expected_auth = f"Bearer {token}".encode() if token is not None else None
        self._expected_approval_auth = (
            f"Bearer {approval_secret}".encode() if approval_secret is not None else None
        )
        self._channel = ApprovalChannel(
            approval_required=approval_required, approval_timeout=approval_timeout
        )
        self._sessions: dict[str, tuple[MCPSession, dict[str, Any]]] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._server: _Uvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._app = Starlette(
            routes=[
                Route("/reset", self._reset_endpoint, methods=["PUT"]),
                Route("/approve", self._approve_endpoint, methods=["POST"]),
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

    async def start(self) -> None:
        """Bind the socket and start the HTTP server; returns once it accepts requests.

        Raises:
            RuntimeError: The server is already running.
            OSError: The address could not be bound (e.g. the port is in use).
        """
        if self._serve_task is not None:
            raise RuntimeError(f"The tool server is already running on {self.host}:{self._port}.")
        _configure_logging(self.log_level, self.log_to_stderr)
        sock = _bind(self.host, self._port)
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            self,
            log_config=None,
            log_level=self.log_level.lower(),
            access_log=False,
            lifespan="off",
            http="auto",
            ws="websockets-sansio",
            timeout_keep_alive=300,
            timeout_graceful_shutdown=5,
        )
        server = _Uvicorn(config)
        serve_task = asyncio.create_task(server.serve(sockets=[sock]), name="ipybox-tool-server")
        self._server, self._serve_task = server, serve_task
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait({ready, serve_task}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            self._server = self._serve_task = None
            sock.close()
            try:
                await serve_task
            except BaseException as exc:
                raise RuntimeError(
                    f"The tool server could not start on {self.host}:{self._port}: {exc}"
                ) from exc
            raise RuntimeError(f"The tool server could not start on {self.host}:{self._port}.")
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
            server.should_exit = True
            with contextlib.suppress(Exception):
                await serve_task
        # Sessions started by requests that were still running while the server shut down.
        await self.reset()

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
        try:
            body = _RunRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _error_response(400, "failed", f"The approval request is malformed: {_summarise(exc)}")
        if body.server_params:
            return _error_response(400, "failed", "An approval request cannot carry server_params.")
        try:
            await self._approve(body, f"{body.server_name}.{body.tool_name}")
        except _ToolCallError as exc:
            return _error_response(exc.status, exc.kind, exc.message)
        return JSONResponse({"result": None})

    async def _approval(self, websocket: WebSocket) -> None:
        if self._expected_approval_auth is not None:
            supplied = websocket.headers.get("authorization", "").encode()
            if not hmac.compare_digest(supplied, self._expected_approval_auth):
                logger.warning("Refused an approval connection without the approval secret.")
                await websocket.close(code=POLICY_VIOLATION)
                return
        await self._channel.connect(websocket)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # POST /run is the hot path (one request per tool call from a kernel): it is served
        # straight from the ASGI messages, everything else goes through Starlette.
        if scope["type"] == "http" and scope["path"] == "/run" and scope["method"] == "POST":
            authorization = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value
                    break
            body = b""
            more_body = True
            while more_body:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more_body = message.get("more_body", False)
            status, content = await self._handle_run(authorization, body)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
            ]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
        else:
            await self._app(scope, receive, send)

    async def _handle_run(self, authorization: bytes, raw_body: bytes) -> tuple[int, bytes]:
        if not self._authorized(authorization):
            return _error(401, "failed", _UNAUTHORIZED)
        try:
            body = _RunRequest.model_validate_json(raw_body)
        except ValidationError as exc:
            return _error(400, "failed", f"The tool call request is malformed: {_summarise(exc)}")
        call = f"{body.server_name}.{body.tool_name}"
        try:
            params = self._server_params(body)
            if self.approve_tool_calls:
                await self._approve(body, call)
            session = await self._session(body.server_name, params, call)
            result = await session.call_tool(body.tool_name, body.tool_args)
        except _ToolCallError as exc:
            return _error(exc.status, exc.kind, exc.message)
        except MCPServerError as exc:
            return _error(502, "failed", f"Tool call {call} failed: {exc}")
        return 200, _json({"result": result})

    def _authorized(self, authorization: bytes) -> bool:
        return self._expected_auth is None or hmac.compare_digest(authorization, self._expected_auth)

    def _server_params(self, body: _RunRequest) -> dict[str, Any]:
        if self._registry is not None:
            if body.server_params:
                raise _ToolCallError(
                    403,
                    "failed",
                    f"Tool call {body.server_name}.{body.tool_name} failed: this tool server runs only MCP servers "
                    "registered by the application, so a request cannot supply server_params; name a registered "
                    "server instead.",
                )
            try:
                params = self._registry._lookup_shared(body.server_name)
            except OSError as exc:
                raise _ToolCallError(
                    500, "failed", f"The MCP server registry could not be read: {exc}"
                ) from exc
            if params is None:
                raise _ToolCallError(
                    404,
                    "failed",
                    f"Tool call {body.server_name}.{body.tool_name} failed: MCP server {body.server_name!r} is not "
                    "registered with this tool server; the application registers a server when it generates its "
                    "API with generate_mcp_sources.",
                )
            return params
        if body.server_params:
            return body.server_params
        running = self._sessions.get(body.server_name)
        if running is not None:
            return running[1]
        raise _ToolCallError(
            400,
            "failed",
            f"Tool call {body.server_name}.{body.tool_name} failed: the request has no server_params and MCP "
            f"server {body.server_name!r} is not running.",
        )

    async def _approve(self, body: _RunRequest, call: str) -> None:
        try:
            accepted = await self._channel.request(body.server_name, body.tool_name, body.tool_args)
        except NoApprovalClientError:
            raise _ToolCallError(
                503,
                "failed",
                f"Tool call {call} failed: no approval client is connected to the tool server, so the call could "
                "not be approved.",
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
            session = MCPSession(server_name, resolved, self.connect_timeout)
            await session.start()
            self._sessions[server_name] = (session, params)
            return session


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it every response waits for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


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


class _StdStreamHandler(logging.Handler):
    """Writes to whatever ``sys.stdout`` / ``sys.stderr`` is at the time of each record."""

    def __init__(self, stream_name: str) -> None:
        super().__init__()
        self.stream_name = stream_name

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


_handler = _StdStreamHandler("stdout")
_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))


def _configure_logging(level: str, to_stderr: bool) -> None:
    """Send the tool server's and uvicorn's logs to stdout or stderr at the given level."""
    _handler.stream_name = "stderr" if to_stderr else "stdout"
    for name in ("ipybox.tool_exec", "uvicorn.error"):
        target = logging.getLogger(name)
        target.setLevel(level)
        if _handler not in target.handlers:
            target.addHandler(_handler)
        target.propagate = False
