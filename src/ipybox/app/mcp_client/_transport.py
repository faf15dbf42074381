"""What sits between an MCP session's SDK ``Client`` and its server's connection (application side only).

The HTTP transports, every answer read with a size limit and a deadline:
:class:`ipybox.app.mcp_client._session.MCPSession` connects over streamable HTTP with `_streamable_http` and
over SSE with a client from `_bounded_client`; and the stream wrappers the session hands to the
``Client`` (`_EofWatchingStream`, `_EnteredTransport`). The stdio transport is in
:mod:`ipybox.app.mcp_client._stdio`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import anyio
import httpx2
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage
from mcp_types import ErrorData, JSONRPCError

_HTTP_TIMEOUT = 30.0
_HTTP_READ_TIMEOUT = 300.0
# An HTTP server's answer must arrive whole within this many seconds (a JSON answer, or one
# event of an event stream), however slowly it trickles.
_ANSWER_DEADLINE = 300.0


# The id of a JSON-RPC message that names it before anything else (as the SDKs write them).
_ID = re.compile(rb'^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d+|"[^"\\]*")')


def _message_id(head: bytes) -> int | str | None:
    """The id of the JSON-RPC message that starts with `head`, if it names one first."""
    found = _ID.match(head)
    return None if found is None else json.loads(found.group(1))


class _AnswerTooLarge(httpx2.StreamError, httpx2.SSEError):
    """An HTTP answer over the size limit or past its deadline, raised while it is read.

    Both a ``StreamError`` (the SDK fails that one JSON answer's request with it) and an
    ``SSEError`` (the SDK fails the request whose event stream it was). ``refused`` is the
    number of bytes read when it was refused for its size, ``None`` past its deadline.
    """

    def __init__(self, message: str, refused: int | None = None) -> None:
        super().__init__(message)
        self.refused = refused


class _Refused:
    """The ``data`` of an MCP error that fails a request whose answer this side refused for its size.

    A server's error data is parsed JSON, never one of these: only this side marks an error so.
    """

    def __init__(self, size: int) -> None:
        self.size = size


class _Refusals:
    """The requests whose answer one connection's transport refused for its size.

    The transport records a refusal where it happens (the MCP SDK turns it into an error that
    carries only text); `mark` then makes the error that fails the request carry a `_Refused`.
    """

    def __init__(self) -> None:
        self._by_id: dict[int | str, int] = {}

    def record(self, request_id: int | str | None, size: int) -> None:
        if request_id is not None:
            self._by_id[request_id] = size

    def mark(self, item: Any) -> Any:
        """`item` as read from the transport, its error marked if it fails a refused request."""
        if not self._by_id or not isinstance(item, SessionMessage):
            return item
        message = item.message
        if not isinstance(message, JSONRPCError) or message.id not in self._by_id:
            return item
        error = ErrorData(
            code=message.error.code, message=message.error.message, data=_Refused(self._by_id.pop(message.id))
        )
        return SessionMessage(JSONRPCError(jsonrpc="2.0", id=message.id, error=error), metadata=item.metadata)


class _BoundedStream(httpx2.AsyncByteStream):
    """An HTTP answer's body, read with a size limit and a deadline while it arrives.

    A JSON answer is bounded as a whole; an event stream per event (an event ends at a blank
    line), so a stream that stays open for many events is not cut off.
    """

    def __init__(
        self,
        inner: Any,
        limit: int | None,
        events: bool,
        refusals: _Refusals | None = None,
        request: httpx2.Request | None = None,
    ) -> None:
        self._inner = inner
        self._limit = limit
        self._events = events
        self._refusals = refusals
        self._request = request

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
                end = _event_end(joined)
                if end:
                    size = len(joined) - end
                tail = joined[-3:]
                started = (started or anyio.current_time()) if size else None
            if self._limit is not None and size > self._limit:
                if self._refusals is not None:
                    self._refusals.record(self._request_id(), size)
                raise _AnswerTooLarge(
                    f"the answer is over the byte limit of {self._limit} bytes per message (the tool server's "
                    "max_result_size plus 1 MiB), so it was not read further",
                    refused=size,
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()

    def _request_id(self) -> int | str | None:
        # The answer's request is the one POSTed (an event stream opened by GET answers many).
        try:
            return None if self._request is None else _message_id(self._request.content[:4096])
        except httpx2.RequestNotRead:
            return None


def _event_end(data: bytes) -> int:
    """Where the last event in `data` ends (after its blank line), or 0 if no event ends in it."""
    end = 0
    for blank in (b"\n\n", b"\r\r", b"\r\n\r\n"):
        found = data.rfind(blank)
        if found >= 0:
            end = max(end, found + len(blank))
    return end


def _bounded_client(
    limit: int | None,
    headers: Mapping[str, str] | None = None,
    timeout: httpx2.Timeout | None = None,
    auth: httpx2.Auth | None = None,
    refusals: _Refusals | None = None,
) -> httpx2.AsyncClient:
    """An HTTP client for MCP whose every answer is read through `_BoundedStream`.

    Each answer refused for its size is recorded in `refusals` under its request's id.
    """

    async def bound(response: httpx2.Response) -> None:
        events = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        response.stream = _BoundedStream(response.stream, limit, events, refusals, response.request)

    return httpx2.AsyncClient(
        headers=dict(headers or {}),
        timeout=timeout or httpx2.Timeout(_HTTP_TIMEOUT, read=_HTTP_READ_TIMEOUT),
        auth=auth,
        event_hooks={"response": [bound]},
    )


@contextlib.asynccontextmanager
async def _streamable_http(
    url: str,
    headers: Mapping[str, str],
    max_message_size: int | None,
    refusals: _Refusals,
    auth: httpx2.Auth | None = None,
) -> AsyncIterator[Any]:
    # The MCP SDK's own timeouts (a server may hold a response stream open for minutes), and
    # every answer read with the message size limit and a deadline. Ours refuses an event
    # before httpx2's event size limit can (it counts the event's bytes before they are decoded,
    # which each yield at most 3 bytes of text), so each refusal is recorded in `refusals`;
    # httpx2's limit still bounds an event the server compressed.
    sse_limit = None if max_message_size is None else 3 * max_message_size
    async with _bounded_client(max_message_size, headers, auth=auth, refusals=refusals) as http_client:
        async with streamable_http_client(
            url, http_client=http_client, max_sse_event_size=sse_limit
        ) as streams:
            yield streams


class _EofWatchingStream:
    """Wraps a transport's read stream: reports when the server side has gone away, marks refusals.

    Each error that fails a request recorded in `refusals` carries a `_Refused` as its data.
    """

    def __init__(self, inner: Any, on_eof: Any, refusals: _Refusals | None = None) -> None:
        self._inner = inner
        self._on_eof = on_eof
        self._mark = refusals.mark if refusals is not None else None

    def __getattr__(self, name: str) -> Any:
        # Forwards ``last_context`` and whatever else the SDK reads off its own streams.
        return getattr(self._inner, name)

    async def receive(self) -> Any:
        try:
            item = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_eof()
            raise
        return item if self._mark is None else self._mark(item)

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
