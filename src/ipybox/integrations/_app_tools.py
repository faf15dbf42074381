"""Tools of the application, served to its executor's tool server as an MCP server on loopback.

A framework hands an agent tools that are Python objects in the application. ipybox never copies
them into the kernel: `AppToolServer` serves them as an MCP server over streamable HTTP on
``127.0.0.1``, behind a bearer token that only the trusted registry holds, and registers it for
the executor's working directory. Code in the kernel then reaches a tool the way it reaches any MCP
tool, through the tool server, with policy, approval and the audit trail on the way; the tool runs
here, in a worker thread. A sandboxed kernel has no network, so it cannot reach this server but
through the tool server; an unsandboxed one runs as the user, who could read the registry anyway.
"""

from __future__ import annotations

import base64
import io
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from mcp.server.lowlevel import Server

from ipybox._infra import Guard, Uvicorn, listen
from ipybox.app.mcp_client import ServerRegistry

__all__ = ["AppTool", "AppToolServer"]

_HOST = "127.0.0.1"


@dataclass(frozen=True)
class AppTool:
    """One tool of the application as the kernel may call it.

    Attributes:
        name: The tool's name.
        description: What it does.
        input_schema: The JSON schema of its arguments (an object).
        call: Runs it with the arguments as keywords, in a worker thread; returns a JSON value or
            a PIL image (sent as PNG), anything else as its ``str``.
    """

    name: str
    description: str
    input_schema: Mapping[str, Any]
    call: Callable[..., Any]


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _answer(value: Any) -> types.CallToolResult:
    """The tool result for `value`: an image as PNG, else its JSON as text and as structured content."""
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image, without importing PIL
        png = io.BytesIO()
        value.save(png, format="PNG")
        data = base64.b64encode(png.getvalue()).decode()
        return types.CallToolResult(
            content=[types.ImageContent(type="image", data=data, mime_type="image/png")]
        )
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        value = str(value)
        text = json.dumps(value)
    return types.CallToolResult(content=[_text(text)], structured_content={"result": value})


class AppToolServer:
    """Serves `AppTool`s to one executor's tool server (see the module docstring).

    Args:
        server_name: The MCP server's name, as kernel code names it (``run_tool(server_name, ...)``).
    """

    def __init__(self, server_name: str) -> None:
        self.server_name = server_name
        self._tools: dict[str, AppTool] = {}
        self._token = secrets.token_urlsafe(32)
        self._uvicorn: Uvicorn | None = None
        self._task: Any = None
        self._port = 0
        self._registered: tuple[ServerRegistry, Path] | None = None

    @property
    def params(self) -> dict[str, Any]:
        """The server parameters the tool server connects with (the token included)."""
        return {
            "url": f"http://{_HOST}:{self._port}/mcp",
            "headers": {"Authorization": f"Bearer {self._token}"},
            "type": "streamable_http",
        }

    def set_tools(self, tools: Sequence[AppTool]) -> None:
        """Serve `tools` from now on, in place of those served before."""
        self._tools = {tool.name: tool for tool in tools}

    async def start(self, registry: ServerRegistry, scope: Path) -> None:
        """Start serving and register the server for executors working in `scope`.

        Raises:
            RuntimeError: The server could not start.
            OSError: The registry could not be written.
        """
        server: Server[Any] = Server(self.server_name, on_list_tools=self._list, on_call_tool=self._call)
        sock = listen(_HOST)
        self._port = sock.getsockname()[1]
        app = Guard(
            server.streamable_http_app(host=_HOST),
            token=self._token,
            allowed_hosts={f"{_HOST}:{self._port}"},
        )
        # A tool server that keeps its session open (an executor the application still runs) is
        # cut off after a second at stop.
        uvicorn = Uvicorn(
            app, log_config=None, log_level=None, access_log=False, lifespan="on", timeout_graceful_shutdown=1
        )
        try:
            self._task = await uvicorn.start([sock])
        except BaseException:
            sock.close()
            raise
        self._uvicorn = uvicorn
        await anyio.to_thread.run_sync(registry.register, self.server_name, self.params, scope)
        self._registered = (registry, scope)

    async def stop(self) -> None:
        """Unregister the server and stop serving."""
        registered, self._registered = self._registered, None
        if registered is not None:
            await anyio.to_thread.run_sync(registered[0].unregister, self.server_name, registered[1])
        uvicorn, self._uvicorn = self._uvicorn, None
        if uvicorn is not None:
            uvicorn.request_exit()
            await self._task

    async def _list(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=tool.name, description=tool.description, input_schema=dict(tool.input_schema))
                for tool in self._tools.values()
            ]
        )

    async def _call(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        tool = self._tools.get(params.name)
        if tool is None:
            return types.CallToolResult(content=[_text(f"Unknown tool {params.name!r}.")], is_error=True)
        arguments = dict(params.arguments or {})
        try:
            value = await anyio.to_thread.run_sync(lambda: tool.call(**arguments))
        except Exception as exc:  # broad: whatever the application's tool raised goes back to the caller
            return types.CallToolResult(content=[_text(f"{type(exc).__name__}: {exc}")], is_error=True)
        return _answer(value)
