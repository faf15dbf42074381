"""ToolRunner's own HTTP handling, against a raw socket server that misbehaves on purpose."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipybox.tool_exec.client import ToolRunner, ToolRunnerError

_BODY = b'{"result": {"answer": 42}}'
_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_BODY),
    _BODY,
)


class DroppingServer:
    """Answers the first request of each connection, then reads the next one and drops the connection."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.requests = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                for answer in (True, False):
                    if not self._read_request(conn):
                        break
                    self.requests += 1
                    if answer:
                        conn.sendall(_OK)

    @staticmethod
    def _read_request(conn: socket.socket) -> bool:
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
    assert runner._connection is not None
    runner._connection.sock.shutdown(socket.SHUT_WR)  # the server sees EOF and closes its side
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
        [connection] = runner._idle  # private: the pooled connection, to drop it as a server would
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
