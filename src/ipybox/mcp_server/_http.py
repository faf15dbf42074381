"""The server over streamable HTTP: bearer token, Host/Origin checks, one executor per MCP session."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError

from ipybox._infra import Guard, Uvicorn, listen
from ipybox._wire import UserEnv
from ipybox.app.pool import max_sessions_for_memory
from ipybox.mcp_server._announce import announce, stage
from ipybox.mcp_server._files import MAX_FILE_BYTES
from ipybox.mcp_server._server import Settings, build_server
from ipybox.mcp_server._session_limits import DEFAULT_IDLE_TIMEOUT, SessionLimits
from ipybox.mcp_server._snapshots import Handovers
from ipybox.mcp_server._tools import ToolSession

logger = logging.getLogger(__name__)

TOKEN_ENV = UserEnv.MCP_TOKEN
MCP_PATH = "/mcp"
# The SDK refuses request bodies over 4 MiB with 413; an upload_file call carries its file in
# base64 (4 characters per 3 bytes), so the body must hold the documented file limit encoded,
# plus the JSON-RPC envelope. A file over the limit then gets the tool's own clear error.
MAX_REQUEST_BYTES = (MAX_FILE_BYTES + 2) // 3 * 4 + 1024 * 1024
# A tool call that arrives before its session's executor is up waits at most this long.
_SESSION_START_TIMEOUT = 120


@dataclass
class _Entry:
    ready: asyncio.Future[ToolSession] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class SessionTable:
    """The executors of the open MCP sessions, by ``Mcp-Session-Id``.

    A session's executor is owned by the task that handles the session's
    ``notifications/initialized``: it starts the executor (or takes the one started with
    the server) and waits until the session ends, when the SDK cancels its tasks and the
    executor stops, or until the session is idle for the `limits`' idle timeout, when it stops
    the executor and closes the session. Only that task adds the session's entry, and it
    removes it when it ends (an executor that failed to start keeps its entry, with the error,
    until then). A second ``notifications/initialized`` of a session is ignored.
    """

    def __init__(self, settings: Settings, limits: SessionLimits | None = None) -> None:
        self.settings = settings
        self.limits = limits or SessionLimits(idle_timeout=None)
        self._entries: dict[str, _Entry] = {}
        self._warm: ToolSession | None = None
        self._registered = asyncio.Condition()
        # Snapshots of sessions closed for idleness, for their clients' next sessions.
        self.handovers = Handovers()

    def __len__(self) -> int:
        return len(self._entries)

    async def warm_up(self) -> None:
        """Start one executor with the server, for the first session.

        This also checks at start that executors can run with these settings (the sandbox,
        for one), so that a misconfiguration stops the server with a clear error.
        """
        self._warm = await self.settings.start_session()

    async def close(self) -> None:
        """Stop the executor started with the server, if no session took it (and remove its
        session folder if it is still empty)."""
        warm, self._warm = self._warm, None
        if warm is not None:
            with anyio.CancelScope(shield=True):
                await warm.executor.stop()
            if self.settings.session_folders:
                with contextlib.suppress(OSError):
                    warm.workspace.rmdir()

    async def own(self, ctx: ServerRequestContext[Any], params: types.NotificationParams) -> None:
        """Start the session's executor and keep it until the session ends."""
        session_id = _session_id(ctx)
        if session_id in self._entries:
            logger.warning("MCP session %s sent notifications/initialized again; ignored.", session_id)
            return
        entry = self._entries[session_id] = _Entry()
        tools: ToolSession | None = None
        idle = False
        try:
            async with self._registered:
                self._registered.notify_all()
            try:
                tools, self._warm = self._warm, None
                if tools is None:
                    tools = await self.settings.start_session()
                tools.handovers = self.handovers
                if self.settings.session_folders:
                    print(
                        f"ipybox: a new MCP session works in {tools.workspace}", file=sys.stderr, flush=True
                    )
                entry.ready.set_result(tools)
            except Exception as exc:  # broad: whatever stopped the start is handed to the session's calls
                logger.error("The executor of MCP session %s could not start: %s", session_id, exc)
                entry.ready.set_exception(exc)
            # Until the session ends or is idle; its tool calls get the executor, or the error.
            await self.limits.until_idle(session_id, lambda: tools is not None and tools.executor.busy)
            idle = True
            if tools is not None and (name := await tools.save_for_idle()) is not None:
                self.limits.add_note(
                    session_id,
                    f" Its kernel's state was saved first, as snapshot {name!r}: in the new session, call "
                    f"load_snapshot(name={name!r}) to get its variables back.",
                )
        finally:
            if self._entries.get(session_id) is entry:
                del self._entries[session_id]
            if not entry.ready.done():
                entry.ready.cancel()
            if tools is not None:
                with anyio.CancelScope(shield=True):
                    await tools.executor.stop()
            if idle:
                with anyio.CancelScope(shield=True):
                    await self.limits.close(session_id, MCP_PATH)

    async def get(self, ctx: ServerRequestContext[Any]) -> ToolSession:
        """The tools of the session `ctx` belongs to, once its executor is up."""
        session_id = _session_id(ctx)
        try:
            async with asyncio.timeout(_SESSION_START_TIMEOUT):
                async with self._registered:
                    await self._registered.wait_for(lambda: session_id in self._entries)
                    entry = self._entries[session_id]
                return await asyncio.shield(entry.ready)
        except TimeoutError:
            raise MCPError(
                code=types.INTERNAL_ERROR,
                message="The session's kernel did not start; did the client send notifications/initialized?",
            ) from None
        except Exception as exc:  # broad: the start's failure, whatever it was, becomes the MCP error
            raise MCPError(
                code=types.INTERNAL_ERROR, message=f"The session's kernel could not start: {exc}"
            ) from exc


def _session_id(ctx: ServerRequestContext[Any]) -> str:
    request = ctx.request
    session_id = request.headers.get("mcp-session-id") if request is not None else None
    if not session_id:
        raise MCPError(code=types.INVALID_REQUEST, message="ipybox needs an MCP session (Mcp-Session-Id).")
    return str(session_id)


def allowed_hosts(host: str, port: int, extra: list[str]) -> set[str]:
    """Host header values the server answers: its address, loopback names, and `extra`."""
    names = {host if ":" not in host else f"[{host}]"}
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(host)
        if address.is_loopback or address.is_unspecified:
            names |= {"127.0.0.1", "localhost", "[::1]"}
    if host == "localhost":
        names |= {"127.0.0.1", "[::1]"}
    hosts = {f"{name}:{port}" for name in names}
    for item in extra:
        hosts.add(item if item.rsplit(":", 1)[-1].isdigit() and not item.endswith("]") else f"{item}:{port}")
    return hosts


async def serve_http(
    settings: Settings,
    host: str,
    port: int,
    allowed_hosts_extra: list[str] | None = None,
    session_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    shared_workspace: bool = False,
    max_sessions: int | None = None,
) -> None:
    """Serve MCP over streamable HTTP on ``http://host:port/mcp`` until cancelled.

    A session without requests or running cells for `session_timeout` seconds is closed and its
    executor stopped (`SessionLimits`); at most `max_sessions` are open at once (by default, as
    many as the available memory holds: `max_sessions_for_memory`).
    Each session works in a new folder of its own inside ``<workspace>/sessions``, kept when it
    ends; with `shared_workspace`, all work in the workspace itself.
    """
    token = os.environ.get(TOKEN_ENV) or ""
    generated = not token
    if generated:
        token = secrets.token_urlsafe(32)
    if max_sessions is None:
        max_sessions = max_sessions_for_memory()
    limits = SessionLimits(session_timeout, max_sessions)
    sessions = SessionTable(
        dataclasses.replace(settings, spare_kernel=False, session_folders=not shared_workspace), limits
    )
    server = build_server(sessions, handshake_only=True)
    server.add_notification_handler("notifications/initialized", types.NotificationParams, sessions.own)
    # The Guard checks Host and Origin for every path; the SDK's own check is left off.
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        max_sessions=max_sessions,
        max_request_body_size=MAX_REQUEST_BYTES,
        # Only a backstop, for sessions that never initialized: `limits` closes the others first.
        session_idle_timeout=2 * session_timeout if session_timeout else None,
        host=host,
    )
    serve_sessions = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(asgi_app: Any) -> AsyncIterator[None]:
        # The warm executor stops within uvicorn's shutdown: after it, uvicorn raises the
        # signal that stopped it again, and the process ends.
        try:
            async with serve_sessions(asgi_app):
                yield
        finally:
            await sessions.close()

    app.router.lifespan_context = lifespan
    try:
        sock = listen(host, port)
    except OSError as exc:
        from ipybox.errors import IpyboxError

        raise IpyboxError(f"Could not listen on {host}:{port} ({exc}); choose another --port.") from exc
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    # Until uvicorn takes over SIGINT and SIGTERM, they cancel the warm-up, which cleans up.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, main.cancel)
    try:
        with stage(f"the {'sandboxed ' if settings.sandbox else ''}kernel for the first session"):
            await sessions.warm_up()
    except BaseException:
        sock.close()
        raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    bound_port = sock.getsockname()[1]
    hosts = allowed_hosts(host, bound_port, allowed_hosts_extra or [])
    guarded = Guard(
        limits.wrap(app),
        token=token,
        allowed_hosts=hosts,
        hint=f" (${TOKEN_ENV} where the server runs, or the token it printed at start)",
        jsonrpc=True,
    )
    shown_host = f"[{host}]" if ":" in host else host
    print(
        f"ipybox: MCP server listening on http://{shown_host}:{bound_port}{MCP_PATH}",
        file=sys.stderr,
        flush=True,
    )
    if not any(name.startswith(("127.0.0.1:", "localhost:")) for name in hosts) or host in (
        "0.0.0.0",
        "::",
    ):
        print(
            "ipybox: clients on other machines must name this server with a host given by --allow-host "
            "(and should reach it through TLS, e.g. an SSH tunnel or a reverse proxy).",
            file=sys.stderr,
            flush=True,
        )
    idle = f"idle ones closed after {session_timeout:g} s" if session_timeout else "never closed when idle"
    announce(
        f"sessions: at most {max_sessions} open at once (--max-sessions), {idle} (--session-idle-timeout)"
    )
    if generated:
        print(f"ipybox: bearer token (set {TOKEN_ENV} to choose one): {token}", file=sys.stderr, flush=True)
    uvicorn_server = Uvicorn(
        guarded,
        handle_signals=True,
        log_level=settings.log_level.lower(),
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    try:
        await uvicorn_server.serve(sockets=[sock])
    finally:
        sock.close()
        await sessions.close()
