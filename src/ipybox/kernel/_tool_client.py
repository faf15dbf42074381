"""Calls MCP tools through a tool server; imported inside every kernel by generated code.

Only the standard library is imported, so importing this module in a fresh kernel is cheap.
`ToolRunner` puts together the protocol core (``kernel/_calls.py``: requests, the steps of a
call, what an answer means; its HTTP/1.1 reader is ``kernel/_http.py``) and two shells that
move the bytes (``kernel/_io.py``): the blocking API keeps one HTTP/1.1 keep-alive connection
per runner, on a plain socket; the async API keeps a pool of them on asyncio streams, one per
call in flight, so calls gathered in the kernel run concurrently.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ipybox._wire import SHELL_SERVER_NAME, StdinChannel, ToolServerEnv
from ipybox.errors import ToolRunnerError
from ipybox.kernel import _stdin
from ipybox.kernel._calls import ToolCalls, proxy_address
from ipybox.kernel._content import ToolContent
from ipybox.kernel._io import AsyncShell, SyncShell

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
        socket_path: A Unix socket the tool server listens on, used in place of `host` and
            `port` (how a sandboxed kernel reaches it); by default the ``TOOL_SERVER_SOCKET``
            environment variable, if set.
        channel: ``"stdin"`` sends tool calls over the kernel's own stdin channel to the application
            that runs the cell, not to a tool server over HTTP (mainly for a kernel on another host,
            which can reach nothing but its gateway); by default the ``TOOL_SERVER_CHANNEL``
            environment variable, if set. Only ``run``, ``run_sync`` and their ``content`` variants
            use it.

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
        channel: str | None = None,
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
        address = self.socket_path or (proxy_address(self.proxy) if self.proxy else (host, port))
        self._calls = ToolCalls(
            server_name,
            server_params,
            host,
            port,
            token=token,
            proxy=self.proxy,
            socket_path=self.socket_path,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self._sync = SyncShell(address, connect_timeout, read_timeout)
        self._async = AsyncShell(address, connect_timeout, read_timeout)
        self.channel = (channel if channel is not None else os.environ.get(ToolServerEnv.CHANNEL)) or None
        self._stdin = _stdin.CHANNEL if self.channel == StdinChannel.VALUE else None

    def _stdin_call(self, tool_name: str, tool_args: dict[str, Any], content: bool) -> Any:
        __tracebackhide__ = True
        assert self._stdin is not None
        calls = self._calls
        body = calls.body(tool_name, tool_args, content).decode()
        try:
            status, answer = self._stdin.call(body)
        except _stdin.StdinFailure as exc:
            raise calls.unanswered(tool_name, str(exc)) from None
        return calls.answered(status, answer, tool_name, content)

    async def _stdin_acall(self, tool_name: str, tool_args: dict[str, Any], content: bool) -> Any:
        __tracebackhide__ = True
        assert self._stdin is not None
        calls = self._calls
        body = calls.body(tool_name, tool_args, content).decode()
        try:
            status, answer = await self._stdin.acall(body)
        except _stdin.StdinFailure as exc:
            raise calls.unanswered(tool_name, str(exc)) from None
        return calls.answered(status, answer, tool_name, content)

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
        if self._stdin is not None:
            return self._stdin_call(tool_name, tool_args, False)  # type: ignore[no-any-return]
        calls = self._calls
        return calls.result(self._sync.call(calls.run(tool_name, tool_args)), tool_name)

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
        if self._stdin is not None:
            return await self._stdin_acall(tool_name, tool_args, False)  # type: ignore[no-any-return]
        calls = self._calls
        return calls.result(await self._async.call(calls.run(tool_name, tool_args)), tool_name)

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
        if self._stdin is not None:
            return self._stdin_call(tool_name, tool_args, True)  # type: ignore[no-any-return]
        calls = self._calls
        return calls.content(self._sync.call(calls.run(tool_name, tool_args, content=True)), tool_name)

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
        if self._stdin is not None:
            return await self._stdin_acall(tool_name, tool_args, True)  # type: ignore[no-any-return]
        calls = self._calls
        return calls.content(await self._async.call(calls.run(tool_name, tool_args, content=True)), tool_name)

    def reset_sync(self) -> None:
        """Reset the tool server: close every MCP server it started (blocking).

        Raises:
            ToolRunnerError: The tool server refused or could not be reached, or tool calls go over
                the stdin channel (which carries tool calls only).
        """
        self._no_reset_over_stdin()
        self._calls.check(self._sync.call(self._calls.reset()), "")

    async def reset(self) -> None:
        """Reset the tool server: close every MCP server it started; they restart on their next call.

        Raises:
            ToolRunnerError: The tool server refused or could not be reached, or tool calls go over
                the stdin channel (which carries tool calls only).
        """
        self._no_reset_over_stdin()
        self._calls.check(await self._async.call(self._calls.reset()), "")

    def _no_reset_over_stdin(self) -> None:
        if self._stdin is not None:
            raise ToolRunnerError(
                "This kernel's tool calls go over its stdin channel, which carries tool calls only: "
                "the MCP servers cannot be reset from inside it. The application resets them "
                "(CodeExecutor.reset(), or the MCP server's reset tool).",
                "failed",
                self.server_name,
            )

    def close(self) -> None:
        """Close the kept connection of the blocking API (a later call opens a new one)."""
        self._sync.close()

    async def aclose(self) -> None:
        """Close every kept connection, of the blocking and the async API (a later call opens a new one)."""
        self._sync.close()
        await self._async.aclose()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ToolRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


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
    like a tool call; nothing runs on the tool server. The tool server is found as for `run_tool`;
    on the stdin channel (``TOOL_SERVER_CHANNEL=stdin``) the request is an ask-only call there.

    Args:
        tool_name: What is to run (``"shell"`` or ``"shell_magic"``).
        tool_args: What the application decides on (the command).

    Raises:
        ToolRunnerError: The request was rejected, expired or failed.
    """
    __tracebackhide__ = True
    runner = _runner(SHELL_SERVER_NAME)
    calls = runner._calls
    if runner._stdin is None:
        calls.check(runner._sync.call(calls.approve(tool_name, tool_args)), tool_name)
        return
    body = calls.body(tool_name, tool_args).decode()
    try:
        status, answer = runner._stdin.call(f'{body[:-1]}, "{StdinChannel.ASK_ONLY}": true}}')
    except _stdin.StdinFailure as exc:
        raise calls.unanswered(tool_name, str(exc)) from None
    calls.answered(status, answer, tool_name, False)


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
    runner = _runner(SHELL_SERVER_NAME)
    calls = runner._calls
    return calls.shell_result(runner._sync.call(calls.shell(tool_name, cmd, os.getcwd(), argv)), tool_name)


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
                    channel=address.channel or "",
                )
    return runner
