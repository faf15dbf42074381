"""Fixtures for the tool execution tests: real MCP servers over stdio, streamable HTTP and SSE."""

from __future__ import annotations

import selectors
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from tool_exec_support import DEMO_SERVER

from ipybox.tool_exec.server import ToolServer


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own registry directory, never the user's real one."""
    path = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(path))
    return path


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


def _start_http_demo(transport: str) -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, str(DEMO_SERVER), "--transport", transport, "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout=60):
                raise RuntimeError(f"the {transport} demo server did not announce its URL within 60 s")
        line = process.stdout.readline().strip()
        if not line.startswith("READY "):
            raise RuntimeError(f"the {transport} demo server did not start: {line!r}")
        yield line.removeprefix("READY ")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def streamable_http_url() -> Iterator[str]:
    """URL of a demo server over streamable HTTP (one per test session)."""
    yield from _start_http_demo("streamable-http")


@pytest.fixture(scope="session")
def sse_url() -> Iterator[str]:
    """URL of a demo server over SSE (one per test session)."""
    yield from _start_http_demo("sse")


@pytest.fixture
async def tool_server() -> AsyncIterator[ToolServer]:
    """A plain (trusted local use) tool server on a free port."""
    async with ToolServer(port=0, log_level="WARNING") as server:
        yield server
