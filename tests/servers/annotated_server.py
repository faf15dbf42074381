"""An MCP server for ipybox's policy tests whose tools carry MCP annotations (stdio).

Run it as ``python tests/servers/annotated_server.py``. Every tool answers with a line naming
itself and its arguments. With ``--gate FIFO``, ``slow_write`` writes its process id to FIFO once it has
started and then hangs, so a test can act while the call is under way.
"""

from __future__ import annotations

import argparse
import os
import threading

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

mcp = MCPServer("annotated", log_level="WARNING")
_gate: str | None = None


@mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False), structured_output=False)
def read_item(key: str) -> str:
    """Read an item (read-only)."""
    return f"read_item {key}"


@mcp.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False), structured_output=False)
def list_items() -> str:
    """List the items (read-only)."""
    return "list_items"


@mcp.tool(annotations=ToolAnnotations(destructive_hint=True), structured_output=False)
def delete_item(key: str) -> str:
    """Delete an item (destructive)."""
    return f"delete_item {key}"


@mcp.tool(
    annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True),
    structured_output=False,
)
def put_item(key: str, value: str) -> str:
    """Store an item (not destructive, idempotent)."""
    return f"put_item {key}={value}"


@mcp.tool(structured_output=False)
def plain(text: str) -> str:
    """A tool without annotations."""
    return f"plain {text}"


@mcp.tool(annotations=ToolAnnotations(destructive_hint=False), structured_output=False)
def slow_write(key: str) -> str:
    """Write this process's id to the gate file, then hang for two minutes (for crash tests)."""
    if _gate is not None:
        # The test waits on the other end of this pipe (a FIFO): it learns the call is under way.
        with open(_gate, "w") as file:
            file.write(str(os.getpid()))
        threading.Event().wait(120)
    return f"slow_write {key}"


def main() -> None:
    global _gate
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gate", default=None)
    _gate = parser.parse_args().gate
    mcp.run("stdio")


if __name__ == "__main__":
    main()
