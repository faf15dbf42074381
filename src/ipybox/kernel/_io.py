"""The shells of the kernel's tool client: they move bytes, the core (``kernel/_calls.py``) decides.

`SyncShell` keeps one HTTP/1.1 keep-alive connection on a plain socket and runs one exchange
at a time on it; `AsyncShell` keeps a pool of them on asyncio streams, one per exchange in
flight, so calls gathered in the kernel run concurrently. Each does the steps an exchange asks
for (get a connection, send, receive, drop) and hands back the result or throws the exception
into the exchange, which says what happens next. Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

from ipybox.kernel._calls import Exchange, Step, Steps
from ipybox.kernel._http import Response

__all__ = ["Address", "AsyncShell", "SyncShell"]

Address = tuple[str, int] | str
"""``(host, port)``, or the path of a Unix socket."""

# A module global: a member looked up on the enum class costs more, on every call.
_ACQUIRE = Step.ACQUIRE

# Idle connections the async shell keeps; more exchanges in flight open more.
_MAX_IDLE = 128
_READ_SIZE = 65536


class SyncShell:
    """Runs exchanges one at a time over one kept-alive connection on a plain socket.

    ``http.client`` costs about 0.1 ms per request (a buffered file and an ``email`` header
    parser per response), a tenth of a whole tool call: the shell only calls the socket.

    Args:
        address: Where the tool server (or the proxy to it) listens.
        connect_timeout: Seconds a connection may take.
        read_timeout: Seconds the socket waits for the answer's next bytes.
    """

    def __init__(self, address: Address, connect_timeout: float, read_timeout: float) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()

    def call(self, exchange: Exchange) -> Response:
        """Run `exchange` to its end; the connection is kept for the next one if the answer allows."""
        __tracebackhide__ = True
        with self._lock:
            steps = Steps(exchange)
            while (step := steps.next()) is not None:
                try:
                    steps.value = self._do(step)
                except BaseException as exc:  # the exchange decides what it means
                    steps.error = exc
            assert steps.response is not None
            if not steps.response.keep_alive:
                self._close()
            return steps.response

    def _do(self, step: Step | bytes | int) -> Any:
        sock = self.sock
        if isinstance(step, int):  # receive: the bytes still to come arrive at the socket's pace anyway
            assert sock is not None
            return sock.recv(_READ_SIZE)
        if isinstance(step, bytes):
            assert sock is not None
            sock.sendall(step)
            return None
        if step is _ACQUIRE:
            return self._acquire()
        self._close()
        return None

    def _acquire(self) -> bool:
        if self.sock is not None:
            if not _readable(self.sock):
                return True
            self._close()  # the tool server closed the idle connection (EOF is readable)
        self.sock = _connect(self.address, self.connect_timeout)
        self.sock.settimeout(self.read_timeout)
        return False

    def close(self) -> None:
        """Close the kept connection once no exchange runs on it (the next exchange opens a new one)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class AsyncShell:
    """Runs exchanges on asyncio streams, each on a connection of its own, kept for later ones.

    Idle connections belong to the event loop that made them; they are closed when that loop
    shuts down, or dropped when another loop runs an exchange.

    Args:
        address: Where the tool server (or the proxy to it) listens.
        connect_timeout: Seconds a connection may take.
        read_timeout: Seconds an exchange waits for its whole answer.
    """

    def __init__(self, address: Address, connect_timeout: float, read_timeout: float) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle: list[_Stream] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_guard: AsyncIterator[None] | None = None

    async def call(self, exchange: Exchange) -> Response:
        """Run `exchange` to its end; the connection is kept for a later one if the answer allows."""
        __tracebackhide__ = True
        stream: _Stream | None = None
        deadline: float | None = None
        steps = Steps(exchange)
        while (step := steps.next()) is not None:
            try:
                if step is _ACQUIRE:
                    stream, steps.value = await self._acquire(stream)
                    continue
                assert stream is not None
                if isinstance(step, int):
                    if deadline is None:
                        deadline = asyncio.get_running_loop().time() + self.read_timeout
                    steps.value = await stream.receive(step, deadline)
                else:
                    await stream.do(step)
            except BaseException as exc:  # the exchange decides what it means
                steps.error = exc
        response = steps.response
        assert stream is not None and response is not None
        if response.keep_alive and len(self.idle) < _MAX_IDLE:
            self.idle.append(stream)
        else:
            stream.writer.close()
        return response

    async def _acquire(self, held: _Stream | None) -> tuple[_Stream, bool]:
        """`held`, or an idle kept connection of this event loop, if still open (``True``); else a new one (``False``)."""
        if held is not None:
            if not held.stale():
                return held, True
            held.abort()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # Connections of another event loop cannot be used from this one.
            self.drop_idle()
            self._loop = loop
            # The loop closes this generator when it shuts down (asyncio.run does), while it
            # can still close the idle connections: a closed loop no longer can.
            self._loop_guard = self._close_idle_at_loop_end()
            await anext(self._loop_guard)
        while self.idle:
            stream = self.idle.pop()
            if not stream.stale():
                return stream, True
            stream.abort()
        async with asyncio.timeout(self.connect_timeout):
            return await _Stream.open(self.address), False

    async def _close_idle_at_loop_end(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if self._loop is asyncio.get_running_loop():
                self.drop_idle()
                self._loop = None

    def drop_idle(self) -> None:
        """Drop every idle connection at once."""
        idle, self.idle = self.idle, []
        for stream in idle:
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                stream.abort()

    async def aclose(self) -> None:
        """Close every idle connection and wait until they are closed."""
        idle, self.idle = self.idle, []
        for stream in idle:
            stream.writer.close()
        for stream in idle:
            with contextlib.suppress(OSError):
                await stream.writer.wait_closed()


class _Stream:
    """One connection to the tool server on asyncio streams."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, address: Address) -> _Stream:
        if isinstance(address, str):
            reader, writer = await asyncio.open_unix_connection(address)
        else:
            # asyncio sets TCP_NODELAY on TCP connections itself.
            reader, writer = await asyncio.open_connection(*address)
        return cls(reader, writer)

    async def receive(self, wanted: int, deadline: float) -> bytes:
        """The next bytes that arrive by `deadline`; all `wanted` of them at once, if that is many."""
        async with asyncio.timeout_at(deadline):
            if wanted <= _READ_SIZE:
                return await self.reader.read(_READ_SIZE)
            # One wake-up for a large body, not one for each piece of it.
            try:
                return await self.reader.readexactly(wanted)
            except asyncio.IncompleteReadError as exc:
                return exc.partial  # the connection closed: the next read says so

    async def do(self, step: Step | bytes) -> None:
        """Send bytes, or drop the connection."""
        if isinstance(step, bytes):
            self.writer.write(step)
            await self.writer.drain()
        else:
            self.abort()

    def stale(self) -> bool:
        """Whether the idle connection was closed by the server (EOF seen, or readable now)."""
        if self.reader.at_eof() or self.writer.is_closing():
            return True
        sock = self.writer.get_extra_info("socket")
        return sock is not None and _readable(sock)

    def abort(self) -> None:
        """Drop the connection now, with whatever it still has to send or receive."""
        self.writer.transport.abort()


def _connect(address: Address, timeout: float) -> socket.socket:
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _readable(sock: Any) -> bool:
    """Whether an idle connection has something to read: the server closed it (or broke step)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
