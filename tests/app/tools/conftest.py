"""Fixtures for the tool execution tests: real MCP servers over stdio, streamable HTTP and SSE."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ipybox.tool_exec.client import ToolRunner
from ipybox.tool_exec.server import ToolServer
from tests.conftest import DEMO_SERVER


@pytest.fixture(autouse=True)
async def close_runners(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Close every ToolRunner a test made, as an application closes its clients."""
    made: list[ToolRunner] = []
    init = ToolRunner.__init__

    def recording_init(self: ToolRunner, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ToolRunner, "__init__", recording_init)
    yield
    for runner in made:
        await runner.aclose()


@pytest.fixture
def demo_params() -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture
def time_params() -> dict[str, Any]:
    return {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}


@pytest.fixture
def filesystem_params(tmp_path: Path) -> dict[str, Any]:
    if shutil.which("npx") is None:
        pytest.skip("npx is not installed")
    return {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", str(tmp_path)]}


@pytest.fixture
async def tool_server() -> AsyncIterator[ToolServer]:
    """A plain (trusted local use) tool server on a free port."""
    async with ToolServer(
        port=0, log_level="WARNING", approval_required=False, trust_all_clients=True
    ) as server:
        yield server
