"""The tool server's HTTP plumbing: bounded connections, bounded request bodies, error answers.

Application side only. What one client can hold of the tool server (`_BoundedHttp`), the
in-flight budget of request and answer bytes (`_InflightBudget`, `_Charge`), reading a request
body under those limits (`BodyReader`, a part of :class:`ipybox.app.tools._server.ToolServer`),
the JSON error answers every endpoint gives, and ``log_to_stderr``'s fallback handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import Receive
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

from ipybox._infra import DIRECT_TEXT
from ipybox._wire import AnswerFields
from ipybox.errors import ToolCallOutcome

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec.server")

# What a client may hold of the server: a request head (request line and headers) of this many
# bytes, arriving within this many seconds of the connection (or of its previous request); a
# body within _BODY_TIMEOUT; and this many open connections at once.
_MAX_HEAD_SIZE = 64 * 1024
_HEAD_TIMEOUT = 10.0
_BODY_TIMEOUT = 60.0
_MAX_CONNECTIONS = 512
# Messages of one WebSocket that may wait for the application before reading stops.
_WS_QUEUE = 4
# How long a request waits for room in the tool server's max_inflight_size before it fails.
_INFLIGHT_WAIT = 60.0


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


class _QueuedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, with two short cuts for the approval channel's messages.

    uvicorn stops reading a connection after each message until the application has taken it,
    which costs two system calls per message; here it stops once ``_WS_QUEUE`` messages wait,
    which bounds what a client can queue all the same. And an application that accepted the
    connection may hand it a synchronous handler of text messages (``DIRECT_TEXT``, an entry of the
    scope's ``extensions``): each whole text message is then answered in ``data_received``
    already, without the queue, the task hand-off to the application and its ``send``. The
    handler returns the text to answer with, or ``None``; handing it over returns a function that
    writes a text message at once (`_write_text`). A message is queued as before while
    the connection's writes are paused (the client is not reading), after the application sent
    its close, or when it is not UTF-8.
    """

    _on_text: Callable[[str], str | None] | None = None

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][DIRECT_TEXT] = self._take_text

    def _take_text(self, on_text: Callable[[str], str | None] | None) -> Callable[[str], bool]:
        """Take the application's text handler (``None``: none any more); returns `_write_text`."""
        self._on_text = on_text
        return self._write_text

    def _write_text(self, text: str) -> bool:
        """Write a text message now, if the connection takes writes; whether it was written (if not,
        the application sends it the ASGI way, which waits for room and reports a closed connection)."""
        if not self.handshake_complete or self.close_sent or not self.writable.is_set():
            return False
        if self.transport.is_closing():
            return False
        try:
            self.conn.send_text(text.encode())
        except InvalidState:
            return False
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    def send_receive_event_to_app(self) -> None:
        on_text = self._on_text
        if (
            on_text is not None
            and self.curr_msg_data_type == "text"
            and self.handshake_complete
            and not self.close_sent
            and self.writable.is_set()
        ):
            frames = self.frames
            try:
                text = (frames[0] if len(frames) == 1 else b"".join(frames)).decode()
            except UnicodeDecodeError:
                pass  # the base closes the connection for it
            else:
                self.frames = []
                reply = on_text(text)
                if reply is not None and not self.transport.is_closing():
                    try:
                        self.conn.send_text(reply.encode())
                    except InvalidState:
                        return  # closing: the application learns it from its receive()
                    self.transport.write(b"".join(self.conn.data_to_send()))
                return
        if self.read_paused or self.queue.qsize() + 1 >= _WS_QUEUE:
            super().send_receive_event_to_app()
            return
        # The base pauses reading unless it is paused already: it is told so for this message.
        self.read_paused = True
        try:
            super().send_receive_event_to_app()
        finally:
            self.read_paused = False


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


class BodyReader:
    """Reads a request's body within the tool server's size limits and in-flight budget.

    Args:
        max_request_size: Bytes one request body may have.
        max_inflight_size: Bytes all calls in flight may hold together (named in errors).
    """

    def __init__(self, max_request_size: int, max_inflight_size: int) -> None:
        self.max_request_size = max_request_size
        self.max_inflight_size = max_inflight_size

    async def read(
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
    return status, _json({AnswerFields.ERROR: {AnswerFields.KIND: kind, AnswerFields.MESSAGE: message}})


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
