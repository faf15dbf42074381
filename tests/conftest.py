"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# The SDK demo MCP server every test folder runs (stdio by default; HTTP below).
DEMO_SERVER = Path(__file__).parent / "servers" / "demo_server.py"


TOOL_SERVER_CLIENT = """
import http.client as _http, json as _json, os as _os, socket as _socket
class _ToolServer(_http.HTTPConnection):
    def connect(self):
        unix = _os.environ.get("TOOL_SERVER_SOCKET")  # how a sandboxed kernel reaches it
        if unix:
            self.sock = _socket.socket(_socket.AF_UNIX)
            self.sock.connect(unix)
        else:
            super().connect()
def send(method, path, body, token=True):
    conn = _ToolServer(_os.environ["TOOL_SERVER_HOST"], int(_os.environ["TOOL_SERVER_PORT"]), timeout=30)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + _os.environ["TOOL_SERVER_TOKEN"]
    conn.request(method, path, _json.dumps(body), headers)
    response = conn.getresponse()
    return response.status, response.read().decode()
"""
"""Kernel code that defines ``send(method, path, body, token=True) -> (status, text)``: one
request to the executor's tool server, as hostile code in the kernel can make it (the address
and token from the kernel's environment, over TCP or the sandbox's socket)."""


def command_line(process: psutil.Process | int) -> str:
    """The command line of `process`, empty for one that has exited since it was listed (a
    process table read twice is never the same: a helper may end in between)."""
    try:
        return " ".join(
            (process if isinstance(process, psutil.Process) else psutil.Process(process)).cmdline()
        )
    except psutil.Error:
        return ""


@pytest.fixture(autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own state directory (trusted registry), never the user's real one."""
    path = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A working directory for one test module, with a registry of its own inside it: the
    current directory and ``IPYBOX_STATE_DIR`` point there while the module's tests run. A module
    whose executor outlives one test also overrides `state_dir` to return ``workdir / "state"``."""
    path = tmp_path_factory.mktemp("workdir")
    old_cwd, old_state = Path.cwd(), os.environ.get("IPYBOX_STATE_DIR")
    os.chdir(path)
    os.environ["IPYBOX_STATE_DIR"] = str(path / "state")
    try:
        yield path
    finally:
        os.chdir(old_cwd)
        if old_state is None:
            os.environ.pop("IPYBOX_STATE_DIR", None)
        else:
            os.environ["IPYBOX_STATE_DIR"] = old_state


def _start_http_demo(transport: str) -> Iterator[str]:
    """Run the demo MCP server over HTTP on a free port; yield its URL once it listens."""
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
        process.stdout.close()


@pytest.fixture(scope="session")
def streamable_http_url() -> Iterator[str]:
    """URL of a demo server over streamable HTTP (one per test session)."""
    yield from _start_http_demo("streamable-http")


@pytest.fixture(scope="session")
def sse_url() -> Iterator[str]:
    """URL of a demo server over SSE (one per test session)."""
    yield from _start_http_demo("sse")
