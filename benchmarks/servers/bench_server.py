"""A minimal stdio MCP server for the tool-call figures: `echo`, and `sleep` for concurrent calls.

Both sides of the benchmark start this same file with the project's interpreter (mcp 2.x
SDK), so the MCP server costs the same for the reference and for ipybox and the figure
measures only the path from `ToolRunner.run_sync` through the tool server and back.
"""

from __future__ import annotations

import asyncio

from mcp.server.mcpserver import MCPServer

server = MCPServer("bench", log_level="WARNING")


@server.tool(structured_output=False)
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool(structured_output=False)
async def sleep(seconds: float) -> str:
    """Sleep for the given number of seconds, then answer."""
    await asyncio.sleep(seconds)
    return "done"


if __name__ == "__main__":
    server.run()
