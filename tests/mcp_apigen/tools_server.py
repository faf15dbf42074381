"""An MCP server (stdio, MCP SDK low-level API) that offers whatever tool list it is given.

Run it as::

    python tests/mcp_apigen/tools_server.py --tools TOOLS.json   # tools as MCP wire dicts
    python tests/mcp_apigen/tools_server.py --many 100           # 100 tools, nested schemas

The low-level server sends tool schemas exactly as given, so tests can hand the code
generator schemas no decorator-based server would produce (hostile names, invalid schemas).
A call answers with the arguments it received: as text, and for a tool with an output
schema also as structured content under ``"echo"`` (the ``--many`` tools' output schema
has that shape).
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


def many_tools(count: int) -> list[dict[str, Any]]:
    """``count`` tools whose input and output schemas nest objects, arrays, enums and ``$ref``s."""
    tools = []
    for i in range(count):
        input_schema = {
            "type": "object",
            "$defs": {
                "Address": {
                    "type": "object",
                    "description": "A postal address.",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string", "minLength": 1},
                        "zip": {"type": ["string", "null"], "default": None},
                    },
                    "required": ["street", "city"],
                },
                "Kind": {"type": "string", "enum": ["basic", "premium", "x-large"]},
            },
            "properties": {
                "name": {"type": "string", "description": f"Name for call {i}."},
                "count": {"type": "integer", "minimum": 0, "default": 3},
                "address": {"$ref": "#/$defs/Address"},
                "kind": {"$ref": "#/$defs/Kind"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "options": {
                    "type": "object",
                    "properties": {
                        "deep": {"type": "object", "properties": {"flag": {"type": "boolean"}}},
                        "level": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
                    },
                },
            },
            "required": ["name", "address"],
        }
        output_schema = {
            "type": "object",
            "$defs": {"Address": {"type": "object", "properties": {"line": {"type": "string"}}}},
            "properties": {
                "echo": {"type": "object", "additionalProperties": True},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"id": {"type": "integer"}, "address": {"$ref": "#/$defs/Address"}},
                    },
                },
            },
            "required": ["echo"],
        }
        tools.append(
            {
                "name": f"tool_{i:03d}",
                "description": f"Tool number {i}.\n\nIt echoes its arguments.",
                "inputSchema": input_schema,
                "outputSchema": output_schema,
            }
        )
    return tools


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
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--tools", type=Path, help="a JSON file holding a list of MCP tool dicts")
    group.add_argument("--many", type=int, help="offer this many generated tools")
    args = parser.parse_args()
    tool_dicts = json.loads(args.tools.read_text("utf-8")) if args.tools else many_tools(args.many)
    anyio.run(_serve, build_server(tool_dicts))


if __name__ == "__main__":
    main()
