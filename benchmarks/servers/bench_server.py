"""A minimal stdio MCP server for the tool-call figures: one `echo` tool, nothing else.

Both sides of the benchmark start this same file with the project's interpreter (mcp 2.x
SDK), so the MCP server costs the same for the reference and for ipybox and the figure
measures only the path from `ToolRunner.run_sync` through the tool server and back.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

server = MCPServer("bench", log_level="WARNING")


@server.tool(structured_output=False)
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


if __name__ == "__main__":
    server.run()
