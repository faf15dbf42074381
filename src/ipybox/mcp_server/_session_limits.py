"""Idle HTTP MCP sessions are closed, and the number of sessions is capped.

A session is idle while none of its requests is being served and its kernel runs no cell. An
open GET stream (which clients keep for server messages while doing nothing) does not count:
a connected client that sends no request for the idle time loses its session as one that went
away does. When the idle time has passed, the session's executor (gateway, kernel, MCP servers)
stops and the session is closed as a client's ``DELETE`` would close it, which frees its place
under the cap. A client that comes back with its session id gets HTTP 404 (so that MCP clients
open a new session) with a JSON-RPC error saying why.

The cap itself is the MCP SDK's: it answers a request that would open one session too many with
HTTP 503; `SessionLimits.wrap` gives that answer a message saying what to do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import mcp_types as types
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT = 3600.0
"""Seconds without requests and running cells after which a session is closed."""

# A cell that runs while none of the session's requests is in flight (one waiting for the
# person's approval over the 2026 protocol) shows only in its executor: looked at this often.
_BUSY_RECHECK = 5.0
# Sessions closed for idleness that are still answered with the reason; older ones get the SDK's
# plain "Session not found".
_REMEMBERED = 10_000


@dataclass
class _Activity:
    """What a session is doing: requests in flight, and when the last one ended."""

    busy: int = 0
    last: float = field(default_factory=time.monotonic)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def touch(self) -> None:
        self.last = time.monotonic()
        self.changed.set()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def _json_error(send: Send, status: int, code: int, message: str) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class SessionLimits:
    """The idle timeout and the cap of an HTTP MCP server's sessions.

    Args:
        idle_timeout: Seconds a session may be idle before it is closed; `None` never closes one.
        max_sessions: The most sessions open at once (the SDK enforces it; this words its refusal).

    The owner of a session calls `until_idle`, then stops the session's executor, then calls `close`.
    """

    def __init__(self, idle_timeout: float | None, max_sessions: int | None = None) -> None:
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self._activity: dict[str, _Activity] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._owned: set[str] = set()
        self._inner: ASGIApp | None = None

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """`app` (the SDK's streamable HTTP app), with each session's requests tracked, closed
        sessions answered with the reason, and the cap's refusal worded."""
        self._inner = app

        async def tracked(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            session_id = _header(scope, b"mcp-session-id")
            if session_id is None:
                await app(scope, receive, self._worded_refusal(send))
                return
            if (reason := self._closed.get(session_id)) is not None:
                await _json_error(send, 404, types.INVALID_REQUEST, reason)
                return
            # A standing GET stream only listens: it keeps no session open.
            if scope["method"] == "GET":
                await app(scope, receive, send)
                return
            activity = self._activity.setdefault(session_id, _Activity())
            activity.busy += 1
            activity.touch()
            try:
                await app(scope, receive, send)
            finally:
                activity.busy -= 1
                activity.touch()
                if not activity.busy and session_id not in self._owned:
                    self._activity.pop(session_id, None)

        return tracked

    def _worded_refusal(self, send: Send) -> Send:
        """`send`, with the SDK's 503 for one session too many replaced by a message saying what to do."""
        refused = False

        async def worded(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 503:
                refused = True
                await _json_error(
                    send,
                    503,
                    types.INTERNAL_ERROR,
                    f"This ipybox server already has its maximum of {self.max_sessions} MCP sessions open "
                    "(--max-sessions); close a session you no longer use, or try again when one ends or is "
                    "closed for idleness.",
                )
                return
            if not refused:
                await send(message)

        return worded

    async def until_idle(self, session_id: str, cell_running: Callable[[], bool]) -> None:
        """Return once session `session_id` has been idle for the idle timeout (never without one),
        marked closed: its requests get the reason from then on.

        Args:
            cell_running: Whether the session's kernel runs a cell now.
        """
        timeout = self.idle_timeout
        if timeout is None:
            await anyio.sleep_forever()
            return
        self._owned.add(session_id)
        activity = self._activity.setdefault(session_id, _Activity())
        activity.touch()
        told = False
        try:
            while True:
                activity.changed.clear()
                remaining = activity.last + timeout - time.monotonic()
                if remaining > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(remaining):
                            await activity.changed.wait()
                    continue
                if activity.busy or cell_running():
                    if not told:
                        logger.info(
                            "MCP session %s: its idle time passed while a request was in flight or a cell "
                            "ran; kept open.",
                            session_id,
                        )
                        told = True
                    # A request's end is signalled; a cell's (one may run with no request in
                    # flight) is looked for, and a cell seen running counts as activity.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_BUSY_RECHECK):
                            await activity.changed.wait()
                    if cell_running():
                        activity.last = time.monotonic()
                    continue
                self._mark_closed(session_id, timeout)
                return
        finally:
            self._owned.discard(session_id)
            if not activity.busy:
                self._activity.pop(session_id, None)

    def _mark_closed(self, session_id: str, timeout: float) -> None:
        self._closed[session_id] = (
            f"MCP session {session_id} was closed after {timeout:g} s without requests "
            "(the server's --session-idle-timeout); its kernel was stopped and its variables are gone. "
            "Start a new session: initialize again without this Mcp-Session-Id."
        )
        while len(self._closed) > _REMEMBERED:
            self._closed.popitem(last=False)

    def add_note(self, session_id: str, note: str) -> None:
        """Add `note` to what requests of the closed session `session_id` are answered."""
        if session_id in self._closed:
            self._closed[session_id] += note

    async def close(self, session_id: str, path: str) -> None:
        """Close `session_id` in the SDK as a client's ``DELETE`` of `path` would (made in-process),
        which frees its place under the cap and ends its GET stream."""
        assert self._inner is not None
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "DELETE",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"mcp-session-id", session_id.encode())],
            "client": None,
            "server": None,
        }

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            pass

        await self._inner(scope, receive, send)
        print(
            f"ipybox: closed MCP session {session_id} after {self.idle_timeout:g} s idle; its kernel stopped",
            file=sys.stderr,
            flush=True,
        )
