"""The kernel's HTTP/1.1 response reader, without I/O: bytes in, a response out, every part capped."""

from __future__ import annotations

# private-ok: the kernel's HTTP response reader (ipybox.kernel._http) is internal; its unit tests
# feed it bytes directly, split and broken in ways no real server sends on demand.
import pytest

from ipybox.kernel._http import (
    DEFAULT_LIMITS,
    ConnectionClosed,
    HttpLimits,
    ProtocolError,
    Response,
    ResponseReader,
)

BODY = b'{"result": {"answer": 42}}'
LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 26\r\n\r\n" + BODY
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"a;name=value\r\n" + BODY[:10] + b"\r\n" + b"10\r\n" + BODY[10:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"
)
TO_THE_END = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + BODY


def read(*pieces: bytes, limits: HttpLimits = DEFAULT_LIMITS) -> Response | None:
    reader = ResponseReader(limits)
    response = None
    for piece in pieces:
        response = reader.feed(piece)
    return response


@pytest.mark.parametrize(("answer", "has_length"), [(LENGTH, True), (CHUNKED, True), (TO_THE_END, False)])
def test_a_response_split_at_any_byte_reads_the_same(answer: bytes, has_length: bool) -> None:
    end = [] if has_length else [b""]  # a body without a length ends with the connection
    expected = Response(200, BODY, keep_alive=has_length)
    assert read(answer, *end) == expected
    for cut in range(1, len(answer)):
        assert read(answer[:cut], answer[cut:], *end) == expected, cut
    assert read(*(answer[i : i + 1] for i in range(len(answer))), *end) == expected


def test_the_response_is_given_as_soon_as_it_is_complete() -> None:
    reader = ResponseReader()
    assert reader.feed(LENGTH[:-1]) is None
    assert reader.feed(LENGTH[-1:]) == Response(200, BODY, True)


def test_a_server_that_closes_the_connection_is_not_kept() -> None:
    answer = LENGTH.replace(b"Content-Type", b"Connection: close\r\nContent-Type")
    assert read(answer) == Response(200, BODY, False)
    http10 = LENGTH.replace(b"HTTP/1.1", b"HTTP/1.0")
    assert read(http10) == Response(200, BODY, False)
    assert read(http10.replace(b"Content-Type", b"Connection: Keep-Alive\r\nContent-Type")) == Response(
        200, BODY, True
    )


def test_bytes_after_the_response_leave_the_connection_out_of_step() -> None:
    assert read(LENGTH + b"HTTP/1.1 200") == Response(200, BODY, False)


def test_an_error_status_and_an_interim_response_are_read() -> None:
    continue_ = b"HTTP/1.1 100 Continue\r\n\r\n"
    answer = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 2\r\n\r\nno"
    assert read(continue_ + answer) == Response(403, b"no", True)
    assert read(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n") == Response(204, b"", True)


def test_a_connection_closed_before_the_end_of_the_answer_is_reported() -> None:
    reader = ResponseReader()
    with pytest.raises(ConnectionClosed, match="without answering") as info:
        reader.feed(b"")
    assert not info.value.received
    for answer in (LENGTH, CHUNKED):
        for cut in range(1, len(answer)):
            reader = ResponseReader()
            reader.feed(answer[:cut])
            with pytest.raises(ConnectionClosed, match="mid-answer") as info:
                reader.feed(b"")
            assert info.value.received


LIMITS = HttpLimits(status_line=64, head=256, headers=4, body=100, line=16)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 200 " + b"O" * 100 + b"\r\n\r\n", "status line over 64 bytes"),
        (b"HTTP/1.1 200 " + b"O" * 100, "status line over 64 bytes"),  # before its end arrives
        (b"HTTP/1.1 200 OK\r\nX: " + b"x" * 300 + b"\r\n\r\n", "head over 256 bytes"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"x" * 300, "head over 256 bytes"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * 5 + b"\r\n", "more than 4 headers"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 101\r\n\r\n", "body of 101 bytes, over the 100 bytes"),
        (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 101, "body over 100 bytes"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"40\r\n" + b"x" * 64 + b"\r\n40\r\n",
            "body over 100 bytes",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * 20, "chunk line over 16 bytes"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"X: 1\r\n" * 5,
            "more than 4 trailers",
        ),
    ],
)
def test_an_answer_over_a_limit_is_refused_with_the_limit_named(answer: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        read(answer, limits=LIMITS)
    # The same, whichever way the bytes arrive.
    with pytest.raises(ProtocolError, match=message):
        read(*(answer[i : i + 7] for i in range(0, len(answer), 7)), limits=LIMITS)


def test_the_default_limits_take_a_large_answer() -> None:
    body = b"x" * (40 * 1024 * 1024)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    pieces = [answer] + [body[i : i + 65536] for i in range(0, len(body), 65536)]
    response = read(*pieces)
    assert response is not None and response.body == body


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
    ],
)
def test_an_answer_that_is_not_http_1_1_is_refused(answer: bytes) -> None:
    with pytest.raises(ProtocolError, match="the tool server's answer"):
        read(answer)
