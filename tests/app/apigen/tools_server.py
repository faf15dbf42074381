"""An MCP server (stdio, MCP SDK low-level API) that offers whatever tool list it is given.

Run it as::

    python tests/app/apigen/tools_server.py --tools TOOLS.json   # tools as MCP wire dicts

The low-level server sends tool schemas exactly as given, so tests can hand the code
generator schemas no decorator-based server would produce (hostile names, invalid schemas).
A call answers with the arguments it received: as text, and for a tool with an output
schema also as structured content under ``"echo"``. The 100-tool server of the speed
figures is ``benchmarks/servers/many_tools_server.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server


def build_server(tool_dicts: list[dict[str, Any]]) -> Server[Any]:
    tools = [types.Tool.model_validate(tool) for tool in tool_dicts]
    has_output = {tool.name: tool.output_schema is not None for tool in tools}

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = params.arguments or {}
        text = types.TextContent(type="text", text=json.dumps(arguments, sort_keys=True))
        structured = {"echo": arguments} if has_output.get(params.name) else None
        return types.CallToolResult(content=[text], structured_content=structured)

    return Server("tools", on_list_tools=list_tools, on_call_tool=call_tool)


async def _serve(server: Server[Any]) -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tools", type=Path, required=True, help="a JSON file holding a list of MCP tool dicts"
    )
    args = parser.parse_args()
    tool_dicts = json.loads(args.tools.read_text("utf-8"))
    anyio.run(_serve, build_server(tool_dicts))


if __name__ == "__main__":
    main()
