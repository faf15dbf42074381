"""HTTP/1.1 for the kernel's tool client, without I/O: request bytes out, response bytes in.

`request_head` writes what every request to the tool server starts with; `ResponseReader`
takes the bytes a connection receives, in whatever pieces they arrive, and gives back the
`Response` once it is complete (a ``Content-Length`` body, a chunked one, or one that ends
when the server closes the connection). It caps what it accepts (`HttpLimits`): an answer
over a cap fails with `ProtocolError` instead of growing without end. The sync and async
shells (``kernel/_io.py``) only move the bytes; this module is where the answer is parsed,
once, for both. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["ConnectionClosed", "HttpLimits", "ProtocolError", "Response", "ResponseReader", "request_head"]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The most a `ResponseReader` accepts of one response.

    Args:
        status_line: Bytes of the status line (``HTTP/1.1 200 OK``).
        head: Bytes of the whole head: status line and headers, and the trailers of a chunked body.
        headers: Number of header (and trailer) lines.
        body: Bytes of the body. The tool server caps a result at its ``max_result_size``
            (32 MiB unless the application chose otherwise); this cap only stops an answer that
            would grow without end.
        line: Bytes of one chunk-size line of a chunked body.
    """

    status_line: int = 8 * 1024
    head: int = 64 * 1024
    headers: int = 100
    body: int = 1024 * 1024 * 1024
    line: int = 4 * 1024


class ProtocolError(ValueError):
    """The answer is not HTTP/1.1 the reader understands, or it is over one of its limits."""


class ConnectionClosed(ConnectionError):
    """The server closed the connection before the response was complete."""

    def __init__(self, received: bool) -> None:
        super().__init__(
            "the tool server closed the connection mid-answer"
            if received
            else "the tool server closed the connection without answering"
        )
        self.received = received


class Response(NamedTuple):
    """A complete response: its status, its body, and whether the connection can take another request."""

    status: int
    body: bytes
    keep_alive: bool


def request_head(method: str, target: str, host: str, headers: dict[str, str]) -> bytes:
    """The head of a request up to its ``Content-Length`` value, which the caller appends.

    A request is then ``head + str(len(body)).encode() + b"\\r\\n\\r\\n" + body``; the head is the
    same for every request of one method and path, so it is made once.
    """
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")


DEFAULT_LIMITS = HttpLimits()


class ResponseReader:
    """Reads one response from the bytes received (bytes in, a `Response` out).

    Example:
        ```python
        reader = ResponseReader()
        while (response := reader.feed(sock.recv(65536))) is None:
            pass
        ```

    Args:
        limits: What the reader accepts at most.
    """

    __slots__ = (
        "_buffer",
        "_keep_alive",
        "_limits",
        "_parts",
        "_remaining",
        "_response",
        "_scanned",
        "_size",
        "_status",
        "_step",
        "_trailers",
        "received",
        "wanted",
    )
    # Set once the body starts.
    _parts: list[bytes]
    _size: int
    _remaining: int
    _trailers: int
    _status: int
    _keep_alive: bool

    def __init__(self, limits: HttpLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._buffer = b""
        # How far the head was searched for its end without finding it (a head that trickles
        # in is not searched again from its start).
        self._scanned = 0
        self._step: Callable[[], bool] = self._read_head
        self._response: Response | None = None
        self.received = False
        """Whether any byte of the response arrived."""
        self.wanted = 0
        """Bytes the response is known to still have (0 while unknown): a reader may wait for them at once."""

    def feed(self, data: bytes) -> Response | None:
        """Take the next bytes received; ``b""`` means the server closed the connection.

        Returns:
            The response once it is complete, else ``None`` (feed more).

        Raises:
            ProtocolError: The answer is not HTTP/1.1, or over a limit.
            ConnectionClosed: The connection closed before the response was complete.
        """
        if self._response is not None:
            return self._response
        if not data:
            return self._end()
        self.received = True
        self._buffer = self._buffer + data if self._buffer else data
        step = self._step
        while step():
            if self._response is not None:
                return self._response
            step = self._step
        return None

    def _end(self) -> Response:
        if self._step == self._read_to_end:
            self._finish(keep_alive=False)
            assert self._response is not None
            return self._response
        raise ConnectionClosed(self.received)

    def _finish(self, keep_alive: bool = True) -> None:
        parts = self._parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        # Bytes after the response mean the connection is out of step: it takes no more requests.
        keep_alive = keep_alive and self._keep_alive and not self._buffer
        self._response = Response(self._status, body, keep_alive)
        self._parts = []

    def _read_head(self) -> bool:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
        if end < 0:
            self._scanned = len(buffer)
            self._check_partial_head(buffer)
            return False
        limits = self._limits
        if end + 4 > limits.head:
            raise ProtocolError(f"the tool server's answer has a head over {limits.head} bytes")
        first = buffer.find(b"\r\n", 0, end)
        if first < 0:
            first = end
        status, http11 = _status_line(buffer[:first], limits)
        # Header names, and the values read here, are case-insensitive.
        lines = buffer[first + 2 : end].lower().split(b"\r\n") if first < end else []
        if len(lines) > limits.headers:
            raise ProtocolError(f"the tool server's answer has more than {limits.headers} headers")
        length, chunked, keep_alive = _headers(lines, http11, limits)
        rest = self._buffer = buffer[end + 4 :]
        self._scanned = 0
        if 100 <= status < 200:
            return True  # an interim response: the real one follows
        if status in (204, 304):
            length, chunked = 0, False
        if not chunked and length is not None and len(rest) >= length:
            # The whole body is here (the usual case): no copy but the body's own.
            body = rest[:length] if len(rest) > length else rest
            # Bytes after the response mean the connection is out of step: it takes no more requests.
            self._response = Response(status, body, keep_alive and len(rest) == length)
            return True
        self._status = status
        self._keep_alive = keep_alive
        self._start_body(length, chunked)
        return True

    def _check_partial_head(self, buffer: bytes) -> None:
        limits = self._limits
        if len(buffer) > limits.head:
            raise ProtocolError(f"the tool server's answer has a head over {limits.head} bytes")
        if len(buffer) > limits.status_line + 1 and b"\r\n" not in buffer[: limits.status_line + 2]:
            raise ProtocolError(f"the tool server's answer has a status line over {limits.status_line} bytes")

    def _start_body(self, length: int | None, chunked: bool) -> None:
        self._parts = []
        self._size = 0
        self._remaining = 0
        self._trailers = 0
        if chunked:
            self._step = self._read_chunk_size
        elif length is None:
            self._step = self._read_to_end
        else:
            self._remaining = length
            self._step = self._read_fixed

    def _take(self) -> bool:
        """Take up to `_remaining` bytes of the body; whether all of them have arrived."""
        buffer = self._buffer
        remaining = self._remaining
        if len(buffer) <= remaining:
            if buffer:
                self._parts.append(buffer)
                self._buffer = b""
            remaining -= len(buffer)
        else:
            self._parts.append(buffer[:remaining])
            self._buffer = buffer[remaining:]
            remaining = 0
        self._remaining = self.wanted = remaining
        return remaining == 0

    def _read_fixed(self) -> bool:
        """A ``Content-Length`` body."""
        if self._take():
            self._finish()
            return True
        return False

    def _read_to_end(self) -> bool:
        self._size += len(self._buffer)
        if self._size > self._limits.body:
            raise ProtocolError(f"the tool server's answer has a body over {self._limits.body} bytes")
        self._parts.append(self._buffer)
        self._buffer = b""
        return False

    def _line(self) -> bytes | None:
        """The next line of a chunked body, without its CRLF, or ``None`` until it has arrived."""
        buffer = self._buffer
        end = buffer.find(b"\r\n")
        if end < 0:
            if len(buffer) > self._limits.line:
                raise ProtocolError(
                    f"the tool server's answer has a chunk line over {self._limits.line} bytes"
                )
            return None
        if end > self._limits.line:
            raise ProtocolError(f"the tool server's answer has a chunk line over {self._limits.line} bytes")
        self._buffer = buffer[end + 2 :]
        return buffer[:end]

    def _read_chunk_size(self) -> bool:
        line = self._line()
        if line is None:
            return False
        digits = line.split(b";", 1)[0].strip()
        if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
            raise ProtocolError(f"the tool server's answer has a bad chunk size line {line[:100]!r}")
        size = int(digits, 16)
        if size == 0:
            self._step = self._read_trailer
            return True
        self._size += size
        if self._size > self._limits.body:
            raise ProtocolError(f"the tool server's answer has a body over {self._limits.body} bytes")
        self._remaining = size
        self._step = self._read_chunk_data
        return True

    def _read_chunk_data(self) -> bool:
        if self._take():
            self._step = self._read_chunk_end
            return True
        return False

    def _read_chunk_end(self) -> bool:
        buffer = self._buffer
        if len(buffer) < 2:
            return False
        if buffer[:2] != b"\r\n":
            raise ProtocolError("the tool server's answer has a chunk that does not end with CRLF")
        self._buffer = buffer[2:]
        self._step = self._read_chunk_size
        return True

    def _read_trailer(self) -> bool:
        line = self._line()
        if line is None:
            return False
        if not line:
            self._finish()
            return True
        self._trailers += 1
        if self._trailers > self._limits.headers:
            raise ProtocolError(f"the tool server's answer has more than {self._limits.headers} trailers")
        return True


def _status_line(line: bytes, limits: HttpLimits) -> tuple[int, bool]:
    """The status code of a status line, and whether the server speaks HTTP/1.1 (not 1.0)."""
    if len(line) > limits.status_line:
        raise ProtocolError(f"the tool server's answer has a status line over {limits.status_line} bytes")
    version, code = line[:8], line[9:12]
    if (
        version not in (b"HTTP/1.1", b"HTTP/1.0")
        or line[8:9] != b" "
        or len(code) != 3
        or not code.isdigit()
        or line[12:13] not in (b"", b" ")
    ):
        raise ProtocolError(
            f"the tool server's answer does not start with an HTTP/1.1 status line: {line[:100]!r}"
        )
    return int(code), version == b"HTTP/1.1"


def _headers(lines: list[bytes], http11: bool, limits: HttpLimits) -> tuple[int | None, bool, bool]:
    """``(content_length, chunked, keep_alive)`` of a head's lower-cased header lines (length ``None``: not given)."""
    length: int | None = None
    chunked = False
    keep_alive = http11
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name[0] in _BLANK or name[-1] in _BLANK:
            raise ProtocolError(f"the tool server's answer has a bad header line {line[:100]!r}")
        if name == b"content-length":
            length = _content_length(value.strip(), length, limits)
        elif name == b"transfer-encoding":
            if value.strip() != b"chunked":
                raise ProtocolError(
                    f"the tool server's answer uses a transfer coding the kernel does not read: {value[:100]!r}"
                )
            chunked = True
        elif name == b"connection":
            tokens = {token.strip() for token in value.split(b",")}
            keep_alive = b"close" not in tokens and (http11 or b"keep-alive" in tokens)
    return length, chunked, keep_alive


_BLANK = (ord(" "), ord("\t"))


def _content_length(value: bytes, earlier: int | None, limits: HttpLimits) -> int:
    if not value.isdigit() or len(value) > 19:
        raise ProtocolError(f"the tool server's answer has a bad Content-Length {value[:100]!r}")
    length = int(value)
    if earlier is not None and earlier != length:
        raise ProtocolError("the tool server's answer has two different Content-Length headers")
    if length > limits.body:
        raise ProtocolError(
            f"the tool server's answer has a body of {length} bytes, over the {limits.body} bytes the kernel reads"
        )
    return length
