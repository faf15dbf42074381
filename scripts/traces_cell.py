"""Run one cell with tool calls through ``ipybox --otel`` (used by scripts/test-traces.sh).

Starts the ipybox MCP server over stdio with the SDK's client, registers the demo MCP server of the
tests, and runs a cell that calls two of its tools, each accepted by the person at the client
(``--approve-tool-calls``, answered here by an elicitation callback); ipybox sends its spans to
``$OTEL_EXPORTER_OTLP_ENDPOINT`` and flushes them when it exits. Prints the cell's output.

    uv run --frozen python scripts/traces_cell.py WORKSPACE
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import mcp_types as types
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters

ROOT = Path(__file__).resolve().parents[1]
CODE = """\
from mcptools.demo import add, greet
total = add.run(add.Params(a=2, b=3)).sum
print(total, greet.run(greet.Params(name="traces")))
"""


async def accept(context: object, params: types.ElicitRequestParams) -> types.ElicitResult:
    print(f"asked: {params.message}")
    return types.ElicitResult(action="accept")


async def main(workspace: Path) -> None:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "ipybox", "--workspace", str(workspace), "--otel", "--approve-tool-calls"],
        env=dict(os.environ),
    )
    demo = {"command": sys.executable, "args": [str(ROOT / "tests" / "servers" / "demo_server.py")]}
    async with Client(params, mode="legacy", elicitation_callback=accept) as client:
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": demo}
        )
        if registered.is_error:
            raise SystemExit(f"register_mcp_server failed: {registered.content}")
        result = await client.call_tool("execute_ipython_cell", {"code": CODE})
        text = "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
        if result.is_error:
            raise SystemExit(f"the cell failed: {text}")
        print(text)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
