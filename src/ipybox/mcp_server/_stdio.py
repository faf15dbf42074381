"""Stdin and stdout as asyncio pipes for the SDK's stdio transport.

The SDK reads and writes the standard streams in worker threads. A read blocked in a thread
cannot be cancelled, so SIGTERM would wait for the client's next message before the kernel
and gateway stop; and every message then crosses threads twice, which costs a few
milliseconds per call on a busy machine. Pipes read and written by the event loop have
neither problem. As the SDK does, fd 0 and fd 1 point elsewhere while serving (the null
device, stderr), so that child processes and stray prints cannot touch the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

# The longest MCP message read from stdin (an upload of the largest allowed file, in base64).
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class _Lines:
    """The lines of a pipe, as the SDK's transport iterates over stdin."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


class _Writer:
    """A pipe written as the SDK's transport writes stdout."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, text: str) -> None:
        self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        await self._writer.drain()


@contextlib.asynccontextmanager
async def stdio_pipes() -> AsyncIterator[tuple[Any, Any]]:
    """``(stdin, stdout)`` for ``mcp.server.stdio.stdio_server``; ``(None, None)`` (the SDK's
    own threads) when the standard streams are not pipes or sockets (a file, a terminal)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_MAX_MESSAGE_BYTES, loop=loop)
    stdin_pipe = os.fdopen(os.dup(0), "rb", buffering=0)
    stdout_pipe = os.fdopen(os.dup(1), "wb", buffering=0)
    try:
        read_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), stdin_pipe
        )
    except (OSError, ValueError):
        stdin_pipe.close()
        stdout_pipe.close()
        yield None, None
        return
    try:
        write_transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop), stdout_pipe
        )
    except (OSError, ValueError):
        read_transport.close()
        stdout_pipe.close()
        yield None, None
        return
    writer = asyncio.StreamWriter(write_transport, protocol, None, loop)
    saved = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    try:
        yield _Lines(reader), _Writer(writer)
    finally:
        read_transport.close()
        write_transport.close()
        for fd, original in enumerate(saved):
            os.dup2(original, fd)
            os.close(original)
