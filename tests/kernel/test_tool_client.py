"""ToolRunner's own HTTP handling, against a raw socket server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

# private: the tool server's head timeout is shortened so that it closes an unused connection soon.
from ipybox.app.tools import _http as tool_server_module
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
from ipybox.tool_exec.server import ToolServer
from tests.conftest import DEMO_SERVER

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}

_BODY = b'{"result": {"answer": 42}}'
_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_BODY),
    _BODY,
)


class RawServer:
    """A plain socket server on a free port; `handle` serves each connection, in a thread of its own."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.accepted = 0
        self.accepting = threading.Condition()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.accepting:
                self.accepted += 1
                self.accepting.notify_all()
            threading.Thread(target=self._handle_and_close, args=(conn,), daemon=True).start()

    def _handle_and_close(self, conn: socket.socket) -> None:
        with conn:
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def read_request(conn: socket.socket) -> bool:
        """Read one request; ``False`` when the client closed the connection instead."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(
                b":"
            )[1]
        )
        while len(body) < length:
            body += conn.recv(65536)
        return True

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.listener.close()
        self._thread.join(timeout=10)


class DroppingServer(RawServer):
    """Answers the first request of each connection, then reads the next one and drops the connection."""

    def __init__(self) -> None:
        self.requests = 0
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        for answer in (True, False):
            if not self.read_request(conn):
                break
            self.requests += 1
            if answer:
                conn.sendall(_OK)


@pytest.fixture
def dropping_server() -> Iterator[DroppingServer]:
    server = DroppingServer()
    yield server
    server.close()


def test_a_call_whose_connection_drops_after_sending_is_not_sent_again(
    dropping_server: DroppingServer,
) -> None:
    runner = ToolRunner("demo", {}, "127.0.0.1", dropping_server.port, connect_timeout=5, read_timeout=10)
    assert runner.run_sync("echo", {"text": "first"}) == {"answer": 42}
    with pytest.raises(ToolRunnerError, match="not sent again") as info:
        runner.run_sync("echo", {"text": "second"})
    assert info.value.kind == "failed"
    assert dropping_server.requests == 2  # the second call reached the server exactly once
    runner.close()


def test_a_kept_connection_the_server_closed_while_idle_is_replaced_silently(
    dropping_server: DroppingServer,
) -> None:
    runner = ToolRunner("demo", {}, "127.0.0.1", dropping_server.port, connect_timeout=5, read_timeout=10)
    assert runner.run_sync("echo", {"text": "first"}) == {"answer": 42}
    # Private: the kept-alive connection is internal; closing its socket stands for a server's drop.
    assert runner._sync.sock is not None
    runner._sync.sock.shutdown(socket.SHUT_WR)  # the server sees EOF and closes its side
    assert runner.run_sync("echo", {"text": "second"}) == {"answer": 42}
    runner.close()


async def test_an_async_call_whose_connection_drops_after_sending_is_not_sent_again(
    dropping_server: DroppingServer,
) -> None:
    async with ToolRunner(
        "demo", {}, "127.0.0.1", dropping_server.port, connect_timeout=5, read_timeout=10
    ) as runner:
        assert await runner.run("echo", {"text": "first"}) == {"answer": 42}
        with pytest.raises(ToolRunnerError, match="not sent again") as info:
            await runner.run("echo", {"text": "second"})
        assert info.value.kind == "failed"
        assert dropping_server.requests == 2  # the second call reached the server exactly once


async def test_an_async_kept_connection_the_server_closed_while_idle_is_replaced_silently(
    dropping_server: DroppingServer,
) -> None:
    async with ToolRunner(
        "demo", {}, "127.0.0.1", dropping_server.port, connect_timeout=5, read_timeout=10
    ) as runner:
        assert await runner.run("echo", {"text": "first"}) == {"answer": 42}
        [connection] = runner._async.idle  # private: the pooled connection, to drop it as a server would
        connection.writer.write_eof()  # the server sees EOF and closes its side
        await connection.reader.read()  # ... which this side has now seen too
        assert await runner.run("echo", {"text": "second"}) == {"answer": 42}
        assert dropping_server.requests == 2


async def test_the_async_client_reaches_a_tool_server_over_a_unix_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "tool.sock")
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(_OK)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_unix_server(serve, path)
    async with server:
        async with ToolRunner("demo", {}, socket_path=path) as runner:
            assert await runner.run("echo", {"text": "over a socket file"}) == {"answer": 42}
    assert requests[0].startswith(b"POST /run HTTP/1.1")


def test_the_async_api_works_under_one_asyncio_run_after_another(dropping_server: DroppingServer) -> None:
    # Each event loop's idle connections are closed as the loop shuts down (no ResourceWarning).
    runner = ToolRunner("demo", {}, "127.0.0.1", dropping_server.port, connect_timeout=5, read_timeout=10)
    assert asyncio.run(runner.run("echo", {"text": "first"})) == {"answer": 42}
    assert asyncio.run(runner.run("echo", {"text": "second"})) == {"answer": 42}
    assert dropping_server.requests == 2
    runner.close()


class AnsweringServer(RawServer):
    """Answers every request with `answer`, sent `piece` bytes at a time; with
    `close_after_answer`, then closes the connection."""

    def __init__(self, answer: bytes, piece: int) -> None:
        self.answer = answer
        self.piece = piece
        self.close_after_answer = False
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while self.read_request(conn):
            for start in range(0, len(self.answer), self.piece):
                conn.sendall(self.answer[start : start + self.piece])
            if self.close_after_answer:
                return


_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (_BODY[:7], _BODY[7:]))
    + b"0\r\n\r\n"
)


@pytest.mark.parametrize("answer", [_OK, _CHUNKED], ids=["content-length", "chunked"])
@pytest.mark.parametrize("piece", [1, 5, 65536])
async def test_an_answer_is_read_however_the_server_frames_and_splits_it(answer: bytes, piece: int) -> None:
    server = AnsweringServer(answer, piece)
    try:
        async with ToolRunner(
            "demo", {}, "127.0.0.1", server.port, connect_timeout=5, read_timeout=10
        ) as runner:
            for _ in range(2):  # the second call on the kept connections
                assert await asyncio.to_thread(runner.run_sync, "echo", {}) == {"answer": 42}
                assert await runner.run("echo", {}) == {"answer": 42}
    finally:
        server.close()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 200 OK\r\nX-Filler: " + b"x" * 70000 + b"\r\n\r\n", "a head over 65536 bytes"),
        (b"HTTP/1.1 200 " + b"O" * 9000 + b"\r\n\r\n", "a status line over 8192 bytes"),
        (b"HTTP/1.1 200 OK\r\n" + b"X-Filler: x\r\n" * 101 + b"\r\n", "more than 100 headers"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2000000000\r\n\r\n", "a body of 2000000000 bytes, over the"),
    ],
)
async def test_an_answer_over_the_kernels_limits_fails_the_call_and_says_why(
    answer: bytes, message: str
) -> None:
    server = AnsweringServer(answer, 65536)
    try:
        async with ToolRunner(
            "demo", {}, "127.0.0.1", server.port, connect_timeout=5, read_timeout=10
        ) as runner:
            with pytest.raises(ToolRunnerError, match=message) as info:
                await asyncio.to_thread(runner.run_sync, "echo", {})
            assert "it may or may not have run, so it was not sent again" in str(info.value)
            with pytest.raises(ToolRunnerError, match=message):
                await runner.run("echo", {})
    finally:
        server.close()


_LARGE = b'{"result": "' + b"x" * (3 * 1024 * 1024) + b'"}'
_LARGE_OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_LARGE), _LARGE)


async def test_a_large_answer_is_read_whole_and_one_cut_short_fails_the_call() -> None:
    server = AnsweringServer(_LARGE_OK, 100_000)
    try:
        async with ToolRunner(
            "demo", {}, "127.0.0.1", server.port, connect_timeout=5, read_timeout=10
        ) as runner:
            assert await runner.run("echo", {}) == "x" * (3 * 1024 * 1024)
            assert await asyncio.to_thread(runner.run_sync, "echo", {}) == "x" * (3 * 1024 * 1024)
    finally:
        server.close()
    server = AnsweringServer(_LARGE_OK[: len(_LARGE_OK) // 2], 100_000)
    server.close_after_answer = True
    try:
        async with ToolRunner(
            "demo", {}, "127.0.0.1", server.port, connect_timeout=5, read_timeout=10
        ) as runner:
            with pytest.raises(ToolRunnerError, match=r"mid-answer.*not sent again"):
                await runner.run("echo", {})
            with pytest.raises(ToolRunnerError, match=r"mid-answer.*not sent again"):
                await asyncio.to_thread(runner.run_sync, "echo", {})
    finally:
        server.close()


async def test_gathered_calls_all_connect_before_any_encodes_its_arguments() -> None:
    # Encoding large arguments holds the event loop; were it done before connecting, the calls
    # gathered after the first would see their connect_timeout run out while it is held.
    server = AnsweringServer(_OK, 65536)
    connected: list[bool] = []

    class Slow:
        def model_dump(self, mode: str) -> str:
            with server.accepting:  # blocks the event loop, as a long encoding does
                connected.append(server.accepting.wait_for(lambda: server.accepted >= 10, timeout=10))
            return "slow"

    try:
        async with ToolRunner(
            "demo", {}, "127.0.0.1", server.port, connect_timeout=5, read_timeout=30
        ) as runner:
            results = await asyncio.gather(*(runner.run("echo", {"arg": Slow()}) for _ in range(10)))
        assert results == [{"answer": 42}] * 10
        assert connected == [True] * 10
    finally:
        server.close()


class ArgumentMadeOnceTheServerClosed:
    """An argument whose JSON form is made only once the tool server has closed the connection the
    runner opened for the call: a large body encoded while other calls encode theirs takes as long."""

    def __init__(self, port: int) -> None:
        self.port = port

    def model_dump(self, mode: str) -> str:
        me = psutil.Process()
        deadline = time.monotonic() + 30
        while not any(
            conn.raddr and conn.raddr.port == self.port and conn.status == psutil.CONN_CLOSE_WAIT
            for conn in me.net_connections("tcp")
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the tool server did not close the unused connection")
            time.sleep(0.01)
        return "made late"


@pytest.mark.parametrize("api", ["sync", "async"])
async def test_a_call_whose_connection_the_server_closed_while_its_body_was_made_is_sent_on_a_new_one(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Private: the tool server's head timeout (10 s) is shortened so that it closes the connection soon.
    monkeypatch.setattr(tool_server_module, "_HEAD_TIMEOUT", 0.2, raising=False)
    async with ToolServer(
        port=0, log_level="WARNING", approval_required=False, trust_all_clients=True
    ) as server:
        runner = ToolRunner("demo", DEMO, port=server.port, connect_timeout=5, read_timeout=30)
        args = {"text": ArgumentMadeOnceTheServerClosed(server.port)}
        # The runner runs in a thread (and its own event loop) so that the tool server's loop goes on.
        if api == "sync":
            result = await asyncio.to_thread(runner.run_sync, "echo", args)
            runner.close()
        else:

            async def call() -> Any:
                async with runner:
                    return await runner.run("echo", args)

            result = await asyncio.to_thread(asyncio.run, call())
        assert result == "made late"
