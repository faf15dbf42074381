"""What sits between an MCP session's SDK ``Client`` and its server's connection (application side only).

The HTTP transports, every answer read with a size limit and a deadline:
:class:`ipybox.app._mcp.MCPSession` connects over streamable HTTP with `_streamable_http` and
over SSE with a client from `_bounded_client`; and the stream wrappers the session hands to the
``Client`` (`_EofWatchingStream`, `_EnteredTransport`). The stdio transport is in
:mod:`ipybox.app._mcp_stdio`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any

import anyio
import httpx2
from mcp.client.streamable_http import streamable_http_client

_HTTP_TIMEOUT = 30.0
_HTTP_READ_TIMEOUT = 300.0
# An HTTP server's answer must arrive whole within this many seconds (a JSON answer, or one
# event of an event stream), however slowly it trickles.
_ANSWER_DEADLINE = 300.0


class _AnswerTooLarge(httpx2.StreamError, httpx2.SSEError):
    """An HTTP answer over the size limit or past its deadline, raised while it is read.

    Both a ``StreamError`` (the SDK fails that one JSON answer's request with it) and an
    ``SSEError`` (the SDK fails the request whose event stream it was).
    """


class _BoundedStream(httpx2.AsyncByteStream):
    """An HTTP answer's body, read with a size limit and a deadline while it arrives.

    A JSON answer is bounded as a whole; an event stream per event (an event ends at a blank
    line), so a stream that stays open for many events is not cut off.
    """

    def __init__(self, inner: Any, limit: int | None, events: bool) -> None:
        self._inner = inner
        self._limit = limit
        self._events = events

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
                end = max(joined.rfind(b"\n\n") + 2, joined.rfind(b"\r\r") + 2, joined.rfind(b"\r\n\r\n") + 4)
                if end > 1:
                    size = len(joined) - end
                tail = joined[-3:]
                started = (started or anyio.current_time()) if size else None
            if self._limit is not None and size > self._limit:
                raise _AnswerTooLarge(
                    f"the answer is over the byte limit of {self._limit} bytes per message (the tool server's "
                    "max_result_size plus 1 MiB), so it was not read further"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _bounded_client(
    limit: int | None,
    headers: Mapping[str, str] | None = None,
    timeout: httpx2.Timeout | None = None,
    auth: httpx2.Auth | None = None,
) -> httpx2.AsyncClient:
    """An HTTP client for MCP whose every answer is read through `_BoundedStream`."""

    async def bound(response: httpx2.Response) -> None:
        events = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        response.stream = _BoundedStream(response.stream, limit, events)

    return httpx2.AsyncClient(
        headers=dict(headers or {}),
        timeout=timeout or httpx2.Timeout(_HTTP_TIMEOUT, read=_HTTP_READ_TIMEOUT),
        auth=auth,
        event_hooks={"response": [bound]},
    )


@contextlib.asynccontextmanager
async def _streamable_http(
    url: str, headers: Mapping[str, str], max_message_size: int | None, auth: httpx2.Auth | None = None
) -> AsyncIterator[Any]:
    # The MCP SDK's own timeouts (a server may hold a response stream open for minutes), and
    # every answer read with the message size limit and a deadline.
    async with _bounded_client(max_message_size, headers, auth=auth) as http_client:
        async with streamable_http_client(
            url, http_client=http_client, max_sse_event_size=max_message_size
        ) as streams:
            yield streams


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
