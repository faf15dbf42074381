"""The steps of a tool call, decided without I/O: retries, at most once, timeouts, interrupts.

Each test plays the shell's part by hand: it answers every step an exchange asks for, or throws
into it what a socket or a stream would have raised, and checks what the exchange asks next.
"""

from __future__ import annotations

# private-ok: the kernel-side tool-call core (ipybox.kernel._calls) is internal; its unit tests
# drive it step by step, without I/O, which no public API can.
import asyncio
from typing import Any

import pytest

from ipybox.errors import ToolRunnerError
from ipybox.kernel._calls import Exchange, Step, ToolCalls
from ipybox.kernel._http import Response

OK = b'HTTP/1.1 200 OK\r\nContent-Length: 26\r\n\r\n{"result": {"answer": 42}}'


def calls() -> ToolCalls:
    return ToolCalls(
        "demo",
        {},
        "127.0.0.1",
        8900,
        token="t0k",
        proxy=None,
        socket_path=None,
        connect_timeout=3,
        read_timeout=7,
    )


def play(exchange: Exchange, *answers: Any) -> list[Step | bytes | int]:
    """Answer each step in turn (an exception is thrown in); the steps asked for, in order."""
    steps = [next(exchange)]
    for answer in answers:
        if isinstance(answer, BaseException):
            steps.append(exchange.throw(answer))
        else:
            steps.append(exchange.send(answer))
    return steps


def finish(exchange: Exchange, answer: Any) -> Response:
    with pytest.raises(StopIteration) as done:
        exchange.send(answer)
    response: Response = done.value.value
    return response


def test_a_call_gets_a_connection_sends_its_request_and_reads_the_answer_in_pieces() -> None:
    core = calls()
    exchange = core.run("echo", {"text": "hi"})
    # A connection, the request made, the connection again (still open), then send and read.
    steps = play(exchange, True, True, None, OK[:10])
    assert steps[:2] == [Step.ACQUIRE, Step.ACQUIRE]
    request = steps[2]
    assert isinstance(request, bytes) and request.startswith(b"POST /run HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer t0k\r\n" in request
    assert steps[3:] == [0, 0]
    response = finish(exchange, OK[10:])
    assert response == Response(200, OK.partition(b"\r\n\r\n")[2], True)
    assert core.result(response, "echo") == {"answer": 42}


def test_a_request_through_a_proxy_names_the_whole_url() -> None:
    core = ToolCalls(
        "demo",
        {},
        "localhost",
        8901,
        token=None,
        proxy="http://proxy:3128",
        socket_path=None,
        connect_timeout=3,
        read_timeout=7,
    )
    request = play(core.reset(), True, True)[2]
    assert isinstance(request, bytes)
    assert request.startswith(b"PUT http://localhost:8901/reset HTTP/1.1\r\nHost: localhost:8901\r\n")
    assert b"Authorization" not in request


@pytest.mark.parametrize("gone", [BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")])
@pytest.mark.parametrize("first", [True, False], ids=["kept", "new"])
def test_a_send_that_fails_on_a_connection_that_waited_is_sent_once_more_on_a_new_one(
    gone: OSError, first: bool
) -> None:
    # The tool server closes a kept connection left idle, and a new one whose request head does not
    # come in time (while the request is made): either way the request did not get through.
    exchange = calls().run("echo", {})
    steps = play(exchange, first, True, gone, None, False, None)
    assert steps[3:] == [Step.DROP, Step.ACQUIRE, steps[2], 0]
    assert finish(exchange, OK).status == 200


def test_a_send_that_fails_twice_is_not_tried_a_third_time() -> None:
    exchange = calls().run("echo", {})
    play(exchange, True, True, BrokenPipeError(), None, False)
    assert exchange.throw(BrokenPipeError("again")) is Step.DROP
    with pytest.raises(ToolRunnerError, match="could not be reached") as info:
        exchange.send(None)
    assert info.value.kind == "failed"


def test_a_send_that_fails_on_a_new_connection_is_not_sent_again() -> None:
    exchange = calls().run("echo", {})
    play(exchange, True, False)  # the kept connection closed while the request was made: a new one
    assert exchange.throw(ConnectionResetError()) is Step.DROP
    with pytest.raises(ToolRunnerError, match="could not be reached"):
        exchange.send(None)


@pytest.mark.parametrize(
    "closed", [b"", ConnectionResetError(104, "reset"), BrokenPipeError(32, "Broken pipe")]
)
@pytest.mark.parametrize("part", [b"", OK[:20]])
def test_a_request_sent_is_never_sent_again_whatever_ends_its_connection(closed: Any, part: bytes) -> None:
    exchange = calls().run("echo", {})
    play(exchange, True, True, None, *([part] if part else []))
    step = exchange.send(closed) if isinstance(closed, bytes) else exchange.throw(closed)
    assert step is Step.DROP
    with pytest.raises(ToolRunnerError, match="may or may not have run, so it was not sent again") as info:
        exchange.send(None)
    assert (info.value.kind, info.value.server_name, info.value.tool_name) == ("failed", "demo", "echo")


def test_an_answer_that_breaks_http_fails_the_call_with_the_reason() -> None:
    exchange = calls().run("echo", {})
    play(exchange, True, True, None)
    assert exchange.send(b"HTTP/1.1 200 OK\r\nX: " + b"x" * 70000) is Step.DROP
    with pytest.raises(ToolRunnerError, match="head over 65536 bytes; it may or may not have run"):
        exchange.send(None)


def test_a_connection_that_cannot_be_made_in_time_says_so() -> None:
    exchange = calls().run("echo", {})
    next(exchange)
    with pytest.raises(
        ToolRunnerError, match=r"could not be reached \(TimeoutError\('no connection within 3 s'\)\)"
    ):
        exchange.throw(TimeoutError())
    exchange = calls().run("echo", {})
    next(exchange)
    with pytest.raises(ToolRunnerError, match="ConnectionRefusedError"):
        exchange.throw(ConnectionRefusedError(111, "Connection refused"))
    # Asked again once the request is made, the connection held is dropped whatever happens.
    exchange = calls().run("echo", {})
    play(exchange, False)
    assert exchange.throw(TimeoutError()) is Step.DROP
    with pytest.raises(ToolRunnerError, match=r"no connection within 3 s"):
        exchange.send(None)


def test_an_answer_that_does_not_come_in_time_drops_the_connection() -> None:
    exchange = calls().run("echo", {})
    play(exchange, True, True, None)
    assert exchange.throw(TimeoutError()) is Step.DROP
    with pytest.raises(ToolRunnerError, match="did not answer within 7 s"):
        exchange.send(None)


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), asyncio.CancelledError()])
@pytest.mark.parametrize("answers", [(True,), (True, True), (True, True, None), (True, True, None, OK[:5])])
def test_an_interrupt_or_a_cancellation_drops_the_connection_and_goes_on(
    stop: BaseException, answers: tuple[Any, ...]
) -> None:
    exchange = calls().run("echo", {})
    play(exchange, *answers)
    assert exchange.throw(stop) is Step.DROP
    with pytest.raises(type(stop)) as info:
        exchange.send(None)
    assert info.value is stop


def test_an_interrupt_while_connecting_goes_on_with_nothing_to_drop() -> None:
    exchange = calls().run("echo", {})
    next(exchange)
    stop = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as info:
        exchange.throw(stop)
    assert info.value is stop


def test_an_exchange_left_unfinished_closes_quietly() -> None:
    exchange = calls().run("echo", {})
    play(exchange, True, True, None)
    exchange.close()  # no "generator ignored GeneratorExit"


def test_arguments_that_are_not_json_fail_the_call_before_anything_is_sent() -> None:
    exchange = calls().run("echo", {"x": object()})
    assert next(exchange) is Step.ACQUIRE
    assert exchange.send(True) is Step.DROP
    with pytest.raises(ToolRunnerError, match="cannot be sent as JSON"):
        exchange.send(None)


def test_a_request_is_made_once_the_exchange_has_a_connection() -> None:
    encoded: list[str] = []

    class Arg:
        def model_dump(self, mode: str) -> str:
            encoded.append(mode)
            return "x"

    exchange = calls().run("echo", {"x": Arg()})
    assert next(exchange) is Step.ACQUIRE
    assert encoded == []
    assert exchange.send(False) is Step.ACQUIRE  # made: the connection again, in case it was closed
    assert encoded == ["json"]
    request = exchange.send(True)
    assert isinstance(request, bytes) and request.endswith(b'"tool_args": {"x": "x"}}')
