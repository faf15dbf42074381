"""Fixtures for the code generation tests: an isolated registry, real MCP servers, a secured tool server."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ipybox.app._registry import ServerRegistry
from ipybox.tool_exec.server import ToolServer


@pytest.fixture
async def tool_server(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ToolServer]:
    """A secured tool server (registry + token), found by generated code through the environment.

    Generated ``run()`` names only the server; the tool server takes its parameters from the
    registry that ``generate_mcp_sources`` wrote, as in a ``CodeExecutor``.
    """
    token = secrets.token_urlsafe(16)
    async with ToolServer(port=0, log_level="WARNING", registry=ServerRegistry(), token=token) as server:
        monkeypatch.setenv("TOOL_SERVER_HOST", "localhost")
        monkeypatch.setenv("TOOL_SERVER_PORT", str(server.port))
        monkeypatch.setenv("TOOL_SERVER_TOKEN", token)
        yield server
