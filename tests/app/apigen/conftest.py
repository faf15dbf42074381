"""Fixtures for the code generation tests: an isolated registry, real MCP servers, a secured tool server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ipybox.tool_exec.server import ToolServer


@pytest.fixture
async def tool_server(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ToolServer]:
    """A tool server with its secure defaults (this user's registry, a generated token), found
    by generated code through the environment.

    Generated ``run()`` names only the server; the tool server takes its parameters from the
    registry that ``generate_mcp_sources`` wrote, as in a ``CodeExecutor``.
    """
    async with ToolServer(approval_required=False, log_level="WARNING") as server:
        assert server.token is not None
        monkeypatch.setenv("TOOL_SERVER_HOST", "localhost")
        monkeypatch.setenv("TOOL_SERVER_PORT", str(server.port))
        monkeypatch.setenv("TOOL_SERVER_TOKEN", server.token)
        yield server
