"""Fixtures for the code generation tests: an isolated registry, real MCP servers, a secured tool server."""

from __future__ import annotations

import secrets
import selectors
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from apigen_support import DEMO_SERVER

from ipybox.tool_exec._registry import ServerRegistry
from ipybox.tool_exec.server import ToolServer


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own trusted registry, never the user's real one."""
    path = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(path))
    return path


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


@pytest.fixture(scope="module")
def streamable_http_url() -> Iterator[str]:
    yield from _start_http_demo("streamable-http")


@pytest.fixture(scope="module")
def sse_url() -> Iterator[str]:
    yield from _start_http_demo("sse")
