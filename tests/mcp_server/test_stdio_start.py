"""The stdio server's handshake does not wait for its kernel.

A client gives a server a fixed time to answer ``initialize`` (Claude Code: at most 60 s, whatever
``MCP_TIMEOUT`` says), and a first start on a busy machine can take longer than that.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.mcp_server.support import connected, stdio_params


@pytest.mark.timeout(120)
async def test_the_handshake_and_the_tool_list_are_answered_while_the_kernel_is_still_starting(
    tmp_path: Path,
) -> None:
    # A kernel gateway that takes the server's connection and never answers: the kernel's start
    # never ends, so a server that answered only once its kernel was ready would never answer.
    asked = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        asked.set()

    gateway = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = gateway.sockets[0].getsockname()[1]
    try:
        params = stdio_params(tmp_path, "--kernel-gateway-url", f"http://127.0.0.1:{port}")
        async with connected(params) as client:
            tools = {tool.name for tool in (await client.list_tools()).tools}
            await asked.wait()  # the kernel's start is under way, and stays so
    finally:
        for writer in held:
            writer.close()
        gateway.close()
        await gateway.wait_closed()
    assert {"execute_ipython_cell", "register_mcp_server", "install_package", "reset"} <= tools
