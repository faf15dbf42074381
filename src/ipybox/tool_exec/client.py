"""Calls MCP tools through a tool server; imported inside every kernel by generated code.

Only the standard library is imported at module level (``httpx`` only when the async API
is used), so importing this module in a fresh kernel is cheap. The synchronous path keeps
one HTTP/1.1 keep-alive connection per runner, on a plain socket.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
from typing import Any

from ipybox.errors import ToolCallOutcome, ToolRunnerError

__all__ = ["ToolRunner", "ToolRunnerError", "request_approval", "run_tool"]

_KINDS: frozenset[str] = frozenset({"rejected", "expired", "failed"})


class ToolRunner:
    """Client for running the tools of one MCP server on a tool server.

    Example:
        ```python
        runner = ToolRunner(
            server_name="fetch",
            server_params={"command": "uvx", "args": ["mcp-server-fetch"]},
        )
        result = await runner.run("fetch", {"url": "https://example.com"})
        ```

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
    ) -> None:
        self.server_name = server_name
        self.server_params = server_params
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        token = token if token is not None else os.environ.get("TOOL_SERVER_TOKEN")
        self.proxy = (proxy if proxy is not None else os.environ.get("TOOL_SERVER_PROXY")) or None
        self._address = _proxy_address(self.proxy) if self.proxy else (host, port)
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        # The request body up to the tool name, encoded once.
        head: dict[str, Any] = {"server_name": server_name}
        if server_params:
            head["server_params"] = server_params
        self._body_head = json.dumps(head)[:-1] + ', "tool_name": '
        self._lock = threading.Lock()
        self._connection: _Connection | None = None
        self._heads: dict[str, bytes] = {}
        self._async_client: Any = None
        self._async_loop: Any = None

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
        body = self._body(tool_name, tool_args)
        status, data = await self._request_async("POST", "/run", body, tool_name)
        return self._result(status, data, tool_name)

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
        client, self._async_client = self._async_client, None
        self._async_loop = None
        if client is not None:
            await client.aclose()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ToolRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _body(self, tool_name: str, tool_args: dict[str, Any]) -> bytes:
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
        return f'{self._body_head}{json.dumps(tool_name)}, "tool_args": {args}}}'.encode()

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
                except (_ClosedBeforeAnswer, BrokenPipeError, ConnectionResetError) as exc:
                    # The request was sent and may have run: a tool call runs at most once.
                    self._drop_connection()
                    raise ToolRunnerError(
                        f"{self._what(tool_name)} failed: the tool server at {self.host}:{self.port} closed the "
                        f"connection after the request was sent ({exc}); it may or may not have run, so it was "
                        "not sent again. Check its effect before calling it again.",
                        "failed",
                        self.server_name,
                        tool_name,
                    ) from exc
                except TimeoutError as exc:
                    self._drop_connection()
                    raise ToolRunnerError(
                        f"{self._what(tool_name)} failed: the tool server did not answer within "
                        f"{self.read_timeout:g} s.",
                        "failed",
                        self.server_name,
                        tool_name,
                    ) from exc
                except (OSError, ValueError) as exc:
                    self._drop_connection()
                    raise self._unreachable(tool_name, exc) from exc
                except BaseException:
                    # E.g. a KeyboardInterrupt from the kernel mid-response: the connection is unusable.
                    self._drop_connection()
                    raise
                if close:
                    self._drop_connection()
                return status, data
        raise AssertionError("unreachable")  # pragma: no cover

    def _head(self, method: str, path: str) -> bytes:
        target = f"http://{self.host}:{self.port}{path}" if self.proxy else path
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.host}:{self.port}", "Accept: application/json"]
        lines += [f"{name}: {value}" for name, value in self._headers.items()]
        return ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    async def _request_async(self, method: str, path: str, body: bytes, tool_name: str) -> tuple[int, bytes]:
        import asyncio

        import httpx

        loop = asyncio.get_running_loop()
        if self._async_client is None or self._async_loop is not loop:
            self._async_client = httpx.AsyncClient(
                base_url=f"http://{self.host}:{self.port}",
                timeout=httpx.Timeout(self.read_timeout, connect=self.connect_timeout),
                trust_env=False,
                proxy=self.proxy,
                # No cap on connections: calls gathered in the kernel may wait on each other
                # (an approval, a tool that needs its siblings), so a queue could deadlock them.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            )
            self._async_loop = loop
        try:
            response = await self._async_client.request(method, path, content=body, headers=self._headers)
        except httpx.TimeoutException as exc:
            raise ToolRunnerError(
                f"{self._what(tool_name)} failed: the tool server did not answer in time ({exc!r}).",
                "failed",
                self.server_name,
                tool_name,
            ) from exc
        except httpx.HTTPError as exc:
            raise self._unreachable(tool_name, exc) from exc
        return response.status_code, response.content

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

    def __init__(self, address: tuple[str, int], connect_timeout: float, read_timeout: float) -> None:
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


_runners: dict[tuple[str, str, int, str | None, str | None], ToolRunner] = {}
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


def _runner(server_name: str) -> ToolRunner:
    """The kept runner for `server_name` and the tool server the kernel's environment names."""
    environ = os.environ
    host = environ.get("TOOL_SERVER_HOST") or "localhost"
    port = int(environ.get("TOOL_SERVER_PORT") or 8900)
    token = environ.get("TOOL_SERVER_TOKEN")
    proxy = environ.get("TOOL_SERVER_PROXY") or None
    key = (server_name, host, port, token, proxy)
    runner = _runners.get(key)
    if runner is None:
        with _runners_lock:
            runner = _runners.get(key)
            if runner is None:
                runner = _runners[key] = ToolRunner(
                    server_name, {}, host, port, token=token or "", proxy=proxy or ""
                )
    return runner
