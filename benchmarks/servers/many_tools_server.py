"""A stdio MCP server with 100 tools whose input and output schemas are nested.

Used by the `apigen` figure: `generate_mcp_sources` lists these tools and writes a typed
module for each. Every tool has a nested object, an array of objects, an enum, an optional
field with a default, a `$ref` into `$defs`, and an output schema of similar depth, so the
figure reflects the code-generation work a real server's schemas cause. Both sides of the
benchmark run this file with the project's interpreter (mcp 2.x SDK).
"""

from __future__ import annotations

import copy
from typing import Any

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

TOOL_COUNT = 100


def _input_schema(i: int) -> dict[str, Any]:
    return {
        "type": "object",
        "$defs": {
            "Address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "description": "Street and number."},
                    "city": {"type": "string"},
                    "country": {"type": "string", "enum": ["DE", "AT", "CH", "US"]},
                },
                "required": ["street", "city"],
            }
        },
        "properties": {
            "query": {"type": "string", "description": f"What tool {i} looks for."},
            "limit": {"type": "integer", "default": 10, "minimum": 1, "maximum": 100},
            "mode": {"type": "string", "enum": ["fast", "thorough", "exhaustive"], "default": "fast"},
            "filters": {
                "type": "object",
                "description": "Nested filter settings.",
                "properties": {
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "since": {"type": ["string", "null"], "format": "date-time"},
                    "range": {
                        "type": "object",
                        "properties": {
                            "low": {"type": "number"},
                            "high": {"type": "number"},
                        },
                        "required": ["low", "high"],
                    },
                },
            },
            "address": {"$ref": "#/$defs/Address"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "label": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                    },
                    "required": ["id"],
                },
            },
        },
        "required": ["query"],
    }


def _output_schema(i: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "total": {"type": "integer"},
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "title": {"type": "string"},
                        "score": {"type": "number"},
                        "meta": {
                            "type": "object",
                            "properties": {
                                "source": {"type": "string", "enum": ["web", "local", "cache"]},
                                "tags": {"type": "array", "items": {"type": "string"}},
                            },
                            "required": ["source"],
                        },
                    },
                    "required": ["id", "title"],
                },
            },
            "next_cursor": {"type": ["string", "null"], "description": f"Cursor of tool {i}."},
        },
        "required": ["total", "results"],
    }


TOOLS = [
    types.Tool(
        name=f"tool_{i:03d}",
        description=f"Benchmark tool number {i}: searches a nested catalogue and returns ranked results.",
        input_schema=_input_schema(i),
        output_schema=_output_schema(i),
    )
    for i in range(TOOL_COUNT)
]


async def list_tools(
    ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    return types.ListToolsResult(tools=copy.deepcopy(TOOLS))


async def call_tool(
    ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    result = {"total": 0, "results": [], "next_cursor": None}
    return types.CallToolResult(
        content=[types.TextContent(type="text", text='{"total": 0, "results": [], "next_cursor": null}')],
        structured_content=result,
    )


server: Server[Any] = Server("many_tools", on_list_tools=list_tools, on_call_tool=call_tool)


async def main() -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
