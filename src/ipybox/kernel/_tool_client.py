"""Calls MCP tools through a tool server; imported inside every kernel by generated code.

Only the standard library is imported, so importing this module in a fresh kernel is cheap.
The blocking API keeps one HTTP/1.1 keep-alive connection per runner, on a plain socket; the
async API keeps a pool of them on asyncio streams, one per call in flight, so calls gathered
in the kernel run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any, get_args

from ipybox._wire import RunFields, ToolServerEnv, run_head
from ipybox.errors import ToolCallOutcome, ToolRunnerError
from ipybox.kernel._content import ToolContent, from_json

__all__ = [
    "ToolContent",
    "ToolRunner",
    "ToolRunnerError",
    "arun_tool",
    "arun_tool_content",
    "request_approval",
    "run_shell",
    "run_tool",
    "run_tool_content",
]

# Idle connections the async API keeps per runner; more calls in flight open more.
_MAX_IDLE = 128

_KINDS: frozenset[str] = frozenset(get_args(ToolCallOutcome))
# The parts of a ``/run`` body after the tool name, written once.
_ARGS_KEY = f', "{RunFields.TOOL_ARGS}": '
_CONTENT_TAIL = f', "{RunFields.CONTENT}": true}}'


class ToolRunner:
    """Client for running the tools of one MCP server on a tool server.

    Example:
        .. code-block:: python

            runner = ToolRunner(
                server_name="fetch",
                server_params={"command": "uvx", "args": ["mcp-server-fetch"]},
            )
            result = await runner.run("fetch", {"url": "https://example.com"})

    Args:
        server_name: Name of the MCP server.
        server_params: Parameters of the MCP server, for a tool server in trusted local use;
            empty for a secured tool server, which knows its servers by name.
        host: Hostname of the tool server.
        port: Port of the tool server.
        token: The tool server's bearer token; by default the ``TOOL_SERVER_TOKEN`` environment
            variable, if set.
        connect_timeout: Seconds to wait for a connection to the tool server.
        read_timeout: Seconds to wait for the answer to one call, approval wait included.
        proxy: An ``http://host:port`` proxy to reach the tool server through (a sandboxed
            kernel may have no other way out); by default the ``TOOL_SERVER_PROXY`` environment
            variable, if set.
        socket_path: A Unix socket the tool server listens on, used in place of `host` and
            `port` (how a sandboxed kernel reaches it); by default the ``TOOL_SERVER_SOCKET``
            environment variable, if set.

    Raises:
        ValueError: ``proxy`` is not an ``http://`` URL.
    """

    def __init__(
        self,
        server_name: str,
        server_params: dict[str, Any],
        host: str = "localhost",
        port: int = 8900,
        *,
        token: str | None = None,
        connect_timeout: float = 10,
        read_timeout: float = 3600,
        proxy: str | None = None,
        socket_path: str | None = None,
    ) -> None:
        self.server_name = server_name
        self.server_params = server_params
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        token = token if token is not None else os.environ.get(ToolServerEnv.TOKEN)
        self.proxy = (proxy if proxy is not None else os.environ.get(ToolServerEnv.PROXY)) or None
        self.socket_path = (
            socket_path if socket_path is not None else os.environ.get(ToolServerEnv.SOCKET)
        ) or None
        self._address: tuple[str, int] | str = self.socket_path or (
            _proxy_address(self.proxy) if self.proxy else (host, port)
        )
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # The request body up to the tool name, encoded once.
        head = run_head(server_name, server_params)
        self._body_head = json.dumps(head)[:-1] + f', "{RunFields.TOOL_NAME}": '
        self._lock = threading.Lock()
        self._connection: _Connection | None = None
        self._heads: dict[str, bytes] = {}
        self._idle: list[_AsyncConnection] = []
        self._idle_loop: asyncio.AbstractEventLoop | None = None
        self._loop_guard: AsyncIterator[None] | None = None

    def run_sync(self, tool_name: str, tool_args: dict[str, Any]) -> dict[str, Any] | str | None:
        """Run a tool and wait for its result (blocking).

        Args:
            tool_name: Name of the tool.
            tool_args: Arguments to pass to the tool; ``datetime``, ``UUID``, ``Decimal``, paths and
                Pydantic models are converted to JSON.

        Returns:
            The tool's structured result as a ``dict``, else its text, or ``None``.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed.
        """
        __tracebackhide__ = True  # IPython leaves ipybox's own frames out of the agent's traceback
        body = self._body(tool_name, tool_args)
        status, data = self._request_sync("POST", "/run", body, tool_name)
        return self._result(status, data, tool_name)

    async def run(self, tool_name: str, tool_args: dict[str, Any]) -> dict[str, Any] | str | None:
        """Run a tool and return its result.

        Args:
            tool_name: Name of the tool.
            tool_args: Arguments to pass to the tool; ``datetime``, ``UUID``, ``Decimal``, paths and
                Pydantic models are converted to JSON.

        Returns:
            The tool's structured result as a ``dict``, else its text, or ``None``.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed.
        """
        __tracebackhide__ = True
        body = self._body(tool_name, tool_args)
        status, data = await self._request_async("POST", "/run", body, tool_name)
        return self._result(status, data, tool_name)

    def run_content_sync(self, tool_name: str, tool_args: dict[str, Any]) -> ToolContent:
        """Run a tool and return everything it returned: text, images, audio, resources (blocking).

        Args:
            tool_name: Name of the tool.
            tool_args: Arguments to pass to the tool, converted as for `run_sync`.

        Returns:
            Every content part, typed, and the structured content.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed (also when the result is
                over the tool server's size limit).
        """
        __tracebackhide__ = True
        body = self._body(tool_name, tool_args, content=True)
        status, data = self._request_sync("POST", "/run", body, tool_name)
        return self._content(status, data, tool_name)

    async def run_content(self, tool_name: str, tool_args: dict[str, Any]) -> ToolContent:
        """Run a tool and return everything it returned: text, images, audio, resources.

        Args:
            tool_name: Name of the tool.
            tool_args: Arguments to pass to the tool, converted as for `run`.

        Returns:
            Every content part, typed, and the structured content.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed (also when the result is
                over the tool server's size limit).
        """
        __tracebackhide__ = True
        body = self._body(tool_name, tool_args, content=True)
        status, data = await self._request_async("POST", "/run", body, tool_name)
        return self._content(status, data, tool_name)

    def reset_sync(self) -> None:
        """Reset the tool server: close every MCP server it started (blocking).

        Raises:
            ToolRunnerError: The tool server refused or could not be reached.
        """
        status, data = self._request_sync("PUT", "/reset", b"", "")
        self._check_reset(status, data)

    async def reset(self) -> None:
        """Reset the tool server: close every MCP server it started; they restart on their next call.

        Raises:
            ToolRunnerError: The tool server refused or could not be reached.
        """
        status, data = await self._request_async("PUT", "/reset", b"", "")
        self._check_reset(status, data)

    def close(self) -> None:
        """Close the kept connection of the blocking API (a later call opens a new one)."""
        with self._lock:
            self._drop_connection()

    async def aclose(self) -> None:
        """Close every kept connection, of the blocking and the async API (a later call opens a new one)."""
        self.close()
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        for connection in idle:
            await connection.wait_closed()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ToolRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _body(self, tool_name: str, tool_args: dict[str, Any], content: bool = False) -> bytes:
        __tracebackhide__ = True
        try:
            args = json.dumps(tool_args, default=_to_json)
        except (TypeError, ValueError) as exc:
            raise ToolRunnerError(
                f"Tool call {self.server_name}.{tool_name} failed: its arguments cannot be sent as JSON ({exc}).",
                "failed",
                self.server_name,
                tool_name,
            ) from exc
        tail = _CONTENT_TAIL if content else "}"
        return f"{self._body_head}{json.dumps(tool_name)}{_ARGS_KEY}{args}{tail}".encode()

    def _request_sync(self, method: str, path: str, body: bytes, tool_name: str) -> tuple[int, bytes]:
        __tracebackhide__ = True
        head = self._heads.get(method + path)
        if head is None:
            head = self._heads[method + path] = self._head(method, path)
        request = head + str(len(body)).encode() + b"\r\n\r\n" + body
        with self._lock:
            for attempt in (1, 2):
                connection = self._connection
                reused = connection is not None and not connection.stale()
                if not reused:
                    self._drop_connection()
                try:
                    if connection is None or not reused:
                        connection = self._connection = _Connection(
                            self._address, self.connect_timeout, self.read_timeout
                        )
                    try:
                        connection.send(request)
                    except (BrokenPipeError, ConnectionResetError) as exc:
                        # A kept connection the tool server closed just now: the request did not
                        # get through, so it is safe to send it once more on a new connection.
                        self._drop_connection()
                        if reused and attempt == 1:
                            continue
                        raise self._unreachable(tool_name, exc) from exc
                    status, data, close = connection.receive()
                except BaseException as exc:
                    # The connection is unusable, whatever went wrong (a KeyboardInterrupt from the
                    # kernel mid-response too, which goes on as it is).
                    self._drop_connection()
                    error = self._failure(tool_name, exc)
                    if error is None:
                        raise
                    raise error from exc
                if close:
                    self._drop_connection()
                return status, data
        raise AssertionError("unreachable")  # pragma: no cover

    def _failure(self, tool_name: str, exc: BaseException) -> ToolRunnerError | None:
        """The error a request that `exc` stopped fails with, or ``None`` to let `exc` go on."""
        if isinstance(exc, _ClosedBeforeAnswer | BrokenPipeError | ConnectionResetError):
            # The request was sent and may have run: a tool call runs at most once.
            return ToolRunnerError(
                f"{self._what(tool_name)} failed: the tool server at {self.host}:{self.port} closed the "
                f"connection after the request was sent ({exc}); it may or may not have run, so it was "
                "not sent again. Check its effect before calling it again.",
                "failed",
                self.server_name,
                tool_name,
            )
        if isinstance(exc, TimeoutError):
            return ToolRunnerError(
                f"{self._what(tool_name)} failed: the tool server did not answer within "
                f"{self.read_timeout:g} s.",
                "failed",
                self.server_name,
                tool_name,
            )
        if isinstance(exc, OSError | ValueError):
            return self._unreachable(tool_name, exc)
        return None

    def _head(self, method: str, path: str) -> bytes:
        target = f"http://{self.host}:{self.port}{path}" if self.proxy and not self.socket_path else path
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: application/json"]
        lines += [f"{name}: {value}" for name, value in self._headers.items()]
        return ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    async def _request_async(self, method: str, path: str, body: bytes, tool_name: str) -> tuple[int, bytes]:
        __tracebackhide__ = True
        head = self._heads.get(method + path)
        if head is None:
            head = self._heads[method + path] = self._head(method, path)
        request = head + str(len(body)).encode() + b"\r\n\r\n" + body
        for attempt in (1, 2):
            connection, reused = await self._acquire(tool_name)
            try:
                try:
                    await connection.send(request)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    # As in the blocking API: only a failed send on a kept connection is sent again.
                    connection.abort()
                    if reused and attempt == 1:
                        continue
                    raise self._unreachable(tool_name, exc) from exc
                async with asyncio.timeout(self.read_timeout):
                    status, data, close = await connection.receive()
            except (
                _ClosedBeforeAnswer,
                asyncio.IncompleteReadError,
                BrokenPipeError,
                ConnectionResetError,
            ) as exc:
                connection.abort()
                raise ToolRunnerError(
                    f"{self._what(tool_name)} failed: the tool server at {self.host}:{self.port} closed the "
                    f"connection after the request was sent ({exc}); it may or may not have run, so it was "
                    "not sent again. Check its effect before calling it again.",
                    "failed",
                    self.server_name,
                    tool_name,
                ) from exc
            except TimeoutError as exc:
                connection.abort()
                raise ToolRunnerError(
                    f"{self._what(tool_name)} failed: the tool server did not answer within "
                    f"{self.read_timeout:g} s.",
                    "failed",
                    self.server_name,
                    tool_name,
                ) from exc
            except (OSError, ValueError, asyncio.LimitOverrunError) as exc:
                connection.abort()
                raise self._unreachable(tool_name, exc) from exc
            except BaseException:
                # Cancelled (or interrupted) mid-call: the answer may still come, so the
                # connection cannot serve another call.
                connection.abort()
                raise
            if close or len(self._idle) >= _MAX_IDLE:
                connection.close()
            else:
                self._idle.append(connection)
            return status, data
        raise AssertionError("unreachable")  # pragma: no cover

    async def _close_idle_at_loop_end(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if self._idle_loop is asyncio.get_running_loop():
                self._drop_idle()
                self._idle_loop = None

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                connection.abort()

    async def _acquire(self, tool_name: str) -> tuple[_AsyncConnection, bool]:
        """An idle kept connection of this event loop (``True``), else a new one (``False``)."""
        __tracebackhide__ = True
        loop = asyncio.get_running_loop()
        if self._idle_loop is not loop:
            # Connections of another event loop cannot be used from this one.
            self._drop_idle()
            self._idle_loop = loop
            # The loop closes this generator when it shuts down (asyncio.run does), while it
            # can still close the idle connections: a closed loop no longer can.
            self._loop_guard = self._close_idle_at_loop_end()
            await anext(self._loop_guard)
        while self._idle:
            connection = self._idle.pop()
            if not connection.stale():
                return connection, True
            connection.abort()
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await _AsyncConnection.open(self._address), False
        except TimeoutError as exc:
            raise self._unreachable(
                tool_name, TimeoutError(f"no connection within {self.connect_timeout:g} s")
            ) from exc
        except OSError as exc:
            raise self._unreachable(tool_name, exc) from exc

    def _result(self, status: int, data: bytes, tool_name: str) -> dict[str, Any] | str | None:
        __tracebackhide__ = True
        if status == 200:
            try:
                result: dict[str, Any] | str | None = json.loads(data)["result"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ToolRunnerError(
                    f"Tool call {self.server_name}.{tool_name} failed: the tool server's answer is not valid "
                    f"({data[:200]!r}).",
                    "failed",
                    self.server_name,
                    tool_name,
                ) from exc
            return result
        raise self._error(status, data, tool_name)

    def _content(self, status: int, data: bytes, tool_name: str) -> ToolContent:
        __tracebackhide__ = True
        if status == 200:
            try:
                answer = json.loads(data)
                return from_json(answer["content"], answer.get("structured"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ToolRunnerError(
                    f"Tool call {self.server_name}.{tool_name} failed: the tool server's answer is not valid "
                    f"({exc}; {data[:200]!r}).",
                    "failed",
                    self.server_name,
                    tool_name,
                ) from exc
        raise self._error(status, data, tool_name)

    def _check_reset(self, status: int, data: bytes) -> None:
        if status != 200:
            raise self._error(status, data, "")

    def _error(self, status: int, data: bytes, tool_name: str) -> ToolRunnerError:
        kind: ToolCallOutcome = "failed"
        try:
            error = json.loads(data)["error"]
            message = str(error["message"])
            if error.get("kind") in _KINDS:
                kind = error["kind"]
        except (ValueError, KeyError, TypeError):
            text = data[:500].decode("utf-8", "replace")
            message = f"{self._what(tool_name)} failed: the tool server answered HTTP {status}: {text}"
        return ToolRunnerError(message, kind, self.server_name, tool_name)

    def _unreachable(self, tool_name: str, exc: BaseException) -> ToolRunnerError:
        return ToolRunnerError(
            f"{self._what(tool_name)} failed: the tool server at {self.host}:{self.port} could not be reached "
            f"({exc!r}).",
            "failed",
            self.server_name,
            tool_name,
        )

    def _what(self, tool_name: str) -> str:
        return f"Tool call {self.server_name}.{tool_name}" if tool_name else "Resetting the tool server"


class _ClosedBeforeAnswer(ConnectionError):
    """The tool server closed the connection before it sent any part of an answer."""


class _Connection:
    """One kept-alive HTTP/1.1 connection to the tool server, on a plain socket.

    ``http.client`` costs about 0.1 ms per request (a buffered file and an ``email`` header
    parser per response), a tenth of a whole tool call; the tool server's answers are simple
    (``Content-Length`` or chunked bodies), so a few lines read them.
    """

    def __init__(self, address: tuple[str, int] | str, connect_timeout: float, read_timeout: float) -> None:
        if isinstance(address, str):  # a Unix socket's path
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.settimeout(connect_timeout)
                self.sock.connect(address)
            except BaseException:
                self.sock.close()
                raise
        else:
            self.sock = socket.create_connection(address, timeout=connect_timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(read_timeout)
        self.buffer = bytearray()

    def stale(self) -> bool:
        """Whether the idle connection was closed by the server (it is readable: EOF)."""
        if self.buffer:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def close(self) -> None:
        self.sock.close()

    def send(self, request: bytes) -> None:
        """Send one request."""
        self.sock.sendall(request)

    def receive(self) -> tuple[int, bytes, bool]:
        """Read the response to the request sent: ``(status, body, server_closes)``."""
        buffer = self.buffer
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if not self._fill():
                if buffer:
                    raise ConnectionResetError("the tool server closed the connection mid-answer")
                raise _ClosedBeforeAnswer("the tool server closed the connection")
        lines = bytes(buffer[:end]).split(b"\r\n")
        del buffer[: end + 4]
        status, length, chunked, close = _response_head(lines)
        if chunked:
            return status, self._read_chunked(), close
        if length >= 0:
            return status, self._read_exactly(length), close
        while self._fill():
            pass
        body = bytes(buffer)
        buffer.clear()
        return status, body, True

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _read_exactly(self, length: int) -> bytes:
        while len(self.buffer) < length:
            if not self._fill():
                raise ConnectionResetError("the tool server closed the connection mid-answer")
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    def _read_line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if not self._fill():
                raise ConnectionResetError("the tool server closed the connection mid-answer")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def _read_chunked(self) -> bytes:
        chunks = []
        while (size := int(self._read_line().split(b";")[0], 16)) > 0:
            chunks.append(self._read_exactly(size))
            self._read_line()
        while self._read_line():  # trailers, up to the empty line
            pass
        return b"".join(chunks)


class _AsyncConnection:
    """One kept-alive HTTP/1.1 connection to the tool server, on asyncio streams.

    Reads answers as `_Connection` does. ``address`` is ``(host, port)`` or the path of a
    Unix socket.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, address: tuple[str, int] | str) -> _AsyncConnection:
        if isinstance(address, str):
            reader, writer = await asyncio.open_unix_connection(address)
        else:
            # asyncio sets TCP_NODELAY on TCP connections itself.
            reader, writer = await asyncio.open_connection(*address)
        return cls(reader, writer)

    def stale(self) -> bool:
        """Whether the idle connection was closed by the server (EOF seen, or readable now)."""
        if self.reader.at_eof() or self.writer.is_closing():
            return True
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        """Drop the connection now, with whatever it still has to send or receive."""
        transport = self.writer.transport
        transport.abort()

    async def wait_closed(self) -> None:
        try:
            await self.writer.wait_closed()
        except OSError:
            pass

    async def send(self, request: bytes) -> None:
        self.writer.write(request)
        await self.writer.drain()

    async def receive(self) -> tuple[int, bytes, bool]:
        """Read the response to the request sent: ``(status, body, server_closes)``."""
        reader = self.reader
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ConnectionResetError("the tool server closed the connection mid-answer") from exc
            raise _ClosedBeforeAnswer("the tool server closed the connection") from exc
        lines = head[:-4].split(b"\r\n")
        status, length, chunked, close = _response_head(lines)
        if chunked:
            chunks = []
            while (size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)) > 0:
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, up to the empty line
                pass
            return status, b"".join(chunks), close
        if length >= 0:
            return status, await reader.readexactly(length), close
        return status, await reader.read(), True


def _response_head(lines: list[bytes]) -> tuple[int, int, bool, bool]:
    """``(status, content_length, chunked, server_closes)`` of a response head's lines (length -1: none)."""
    status = int(lines[0].split(b" ", 2)[1])
    length = -1
    chunked = close = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = value.strip().lower() == b"close"
    return status, length, chunked, close


def _proxy_address(proxy: str) -> tuple[str, int]:
    if not proxy.startswith("http://"):
        raise ValueError(f"Only http:// proxies can reach the tool server, not {proxy!r}.")
    netloc = proxy.removeprefix("http://").split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = netloc.rpartition(":") if netloc.rpartition(":")[2].isdigit() else (netloc, "", "80")
    return host.strip("[]"), int(port)


def _to_json(value: Any) -> Any:
    """JSON form of argument values ``json`` does not know (checked only for loaded modules)."""
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):
        return model_dump(mode="json")
    modules = sys.modules
    datetime = modules.get("datetime")
    if datetime is not None and isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    uuid = modules.get("uuid")
    if uuid is not None and isinstance(value, uuid.UUID):
        return str(value)
    decimal = modules.get("decimal")
    if decimal is not None and isinstance(value, decimal.Decimal):
        return str(value)
    pathlib = modules.get("pathlib")
    if pathlib is not None and isinstance(value, pathlib.PurePath):
        return str(value)
    enum = modules.get("enum")
    if enum is not None and isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_runners: dict[tuple[str, ToolServerEnv], ToolRunner] = {}
_runners_lock = threading.Lock()


def run_tool(server_name: str, tool_name: str, tool_args: dict[str, Any]) -> dict[str, Any] | str | None:
    """Run a tool of a registered MCP server through the kernel's tool server (blocking).

    What generated code calls. The tool server is found through the environment variables
    ``TOOL_SERVER_HOST`` (default ``localhost``), ``TOOL_SERVER_PORT`` (default ``8900``) and
    ``TOOL_SERVER_TOKEN`` (and ``TOOL_SERVER_PROXY``, if set); the server is named, never described (the tool server knows its
    parameters). One runner, with its kept connection, is reused per server.

    Args:
        server_name: Name of the MCP server, as registered by the application.
        tool_name: Name of the tool.
        tool_args: Arguments to pass to the tool.

    Returns:
        The tool's structured result as a ``dict``, else its text, or ``None``.

    Raises:
        ToolRunnerError: The call was rejected, expired or failed.
    """
    __tracebackhide__ = True
    return _runner(server_name).run_sync(tool_name, tool_args)


def run_tool_content(server_name: str, tool_name: str, tool_args: dict[str, Any]) -> ToolContent:
    """Like `run_tool`, but returns every content part, typed, and the structured content.

    Raises:
        ToolRunnerError: The call was rejected, expired or failed.
    """
    __tracebackhide__ = True
    return _runner(server_name).run_content_sync(tool_name, tool_args)


async def arun_tool(
    server_name: str, tool_name: str, tool_args: dict[str, Any]
) -> dict[str, Any] | str | None:
    """Like `run_tool`, but async: calls gathered together run concurrently on the tool server.

    Raises:
        ToolRunnerError: The call was rejected, expired or failed.
    """
    __tracebackhide__ = True
    return await _runner(server_name).run(tool_name, tool_args)


async def arun_tool_content(server_name: str, tool_name: str, tool_args: dict[str, Any]) -> ToolContent:
    """Like `run_tool_content`, but async (see `arun_tool`).

    Raises:
        ToolRunnerError: The call was rejected, expired or failed.
    """
    __tracebackhide__ = True
    return await _runner(server_name).run_content(tool_name, tool_args)


def request_approval(tool_name: str, tool_args: dict[str, Any]) -> None:
    """Ask the application to approve something the kernel runs itself (a shell command).

    The request reaches the application as an ``ApprovalRequest`` with ``server_name`` ``"ipybox"``,
    like a tool call; nothing runs on the tool server. The tool server is found as for `run_tool`.

    Args:
        tool_name: What is to run (``"shell"`` or ``"shell_magic"``).
        tool_args: What the application decides on (the command).

    Raises:
        ToolRunnerError: The request was rejected, expired or failed.
    """
    __tracebackhide__ = True
    runner = _runner("ipybox")
    status, data = runner._request_sync("POST", "/approve", runner._body(tool_name, tool_args), tool_name)
    if status != 200:
        raise runner._error(status, data, tool_name)


def run_shell(tool_name: str, cmd: str, argv: list[str] | None = None) -> dict[str, Any]:
    """Have the tool server run a shell command for this kernel, once the application approves it.

    For a kernel that cannot start programs itself: the request reaches the application as an
    ``ApprovalRequest`` as with `request_approval`, and the accepted command runs in a sandbox of
    its own, in this kernel's current folder (with the application's ``PATH``, not this kernel's).

    Args:
        tool_name: ``"shell"`` (`cmd` is a command line for ``sh -c``) or ``"shell_magic"`` (`cmd`
            is a cell, given to `argv` on stdin).
        cmd: The command line, or the cell.
        argv: The cell magic's program and its arguments.

    Returns:
        ``{"stdout", "stderr", "exit_code", "stopped"}``; ``stopped`` says why the command was
        stopped before its end (a time or output limit), else is ``None``.

    Raises:
        ToolRunnerError: The command was rejected, expired or could not run.
    """
    __tracebackhide__ = True
    runner = _runner("ipybox")
    request: dict[str, Any] = {
        "kind": tool_name,
        "cmd": cmd,
        "cwd": os.getcwd(),
    }
    if argv is not None:
        request["argv"] = argv
    status, data = runner._request_sync("POST", "/shell", json.dumps(request).encode(), tool_name)
    if status != 200:
        raise runner._error(status, data, tool_name)
    result: dict[str, Any] = json.loads(data)
    return result


def _runner(server_name: str) -> ToolRunner:
    """The kept runner for `server_name` and the tool server the kernel's environment names."""
    address = ToolServerEnv.from_env(os.environ)
    key = (server_name, address)
    runner = _runners.get(key)
    if runner is None:
        with _runners_lock:
            runner = _runners.get(key)
            if runner is None:
                runner = _runners[key] = ToolRunner(
                    server_name,
                    {},
                    address.host,
                    address.port,
                    token=address.token or "",
                    proxy=address.proxy or "",
                    socket_path=address.socket or "",
                )
    return runner
