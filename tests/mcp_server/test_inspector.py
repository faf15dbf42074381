"""A third-party client: the MCP Inspector's CLI mode, over stdio and streamable HTTP."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.mcp_server.test_http import TOKEN, HttpServer, start_server, stop_server

INSPECTOR = "@modelcontextprotocol/inspector@2.12.0"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("npx") is None, reason="the MCP Inspector needs Node.js (npx)"),
    pytest.mark.timeout(300),
]


def inspector(*args: str, cwd: Path) -> dict[str, Any]:
    """Run one Inspector CLI command; its JSON answer."""
    result = subprocess.run(
        # The stdio target starts an executor before it answers: on a loaded machine that took over
        # the Inspector's default 15 s to connect.
        ["npx", "-y", INSPECTOR, "--cli", "--connect-timeout", "120000", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env=os.environ,
    )
    # Exit code 5: the tool answered with isError (the answer is printed all the same).
    assert result.returncode in (0, 5), result.stderr[-2000:]
    answer: dict[str, Any] = json.loads(result.stdout[result.stdout.index("{") :])
    return answer


def stdio_target(workspace: Path) -> list[str]:
    return [sys.executable, "-m", "ipybox", "--workspace", str(workspace)]


def call(target: list[str], workspace: Path, tool: str, *args: str) -> dict[str, Any]:
    return inspector(
        *target, "--method", "tools/call", "--tool-name", tool, "--tool-arg", *args, cwd=workspace
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


def test_the_inspector_lists_and_calls_the_tools_over_stdio(workspace: Path) -> None:
    target = stdio_target(workspace)
    tools = inspector(*target, "--method", "tools/list", cwd=workspace)["tools"]
    assert {"execute_ipython_cell", "register_mcp_server", "install_package", "reset"} <= {
        t["name"] for t in tools
    }

    result = call(target, workspace, "execute_ipython_cell", "code=x = 6 * 7\nprint(x)")
    assert result["content"] == [{"type": "text", "text": "42"}] and not result.get("isError")

    error = call(target, workspace, "execute_ipython_cell", "code=1/0")
    assert error["isError"] and "ZeroDivisionError" in error["content"][0]["text"]

    encoded = base64.b64encode(b"a,b\n1,2\n").decode()
    upload = call(target, workspace, "upload_file", "path=in.csv", f"content_base64={encoded}")
    assert not upload.get("isError"), upload
    code = "code=open('out.csv', 'w').write(open('in.csv').read().upper())"
    assert not call(target, workspace, "execute_ipython_cell", code).get("isError")
    download = call(target, workspace, "download_file", "path=out.csv")
    blob = next(block["resource"]["blob"] for block in download["content"] if block["type"] == "resource")
    assert base64.b64decode(blob) == b"A,B\n1,2\n"
    escape = call(target, workspace, "download_file", "path=../secret")
    assert escape["isError"]

    plot = (
        "code=import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
    )
    image = call(target, workspace, "execute_ipython_cell", plot)
    assert [block["type"] for block in image["content"]].count("image") == 1


@pytest.fixture
def http_server(tmp_path: Path, workspace: Path) -> Iterator[HttpServer]:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    started = start_server(workspace, tmp_path / "server.log", env)
    try:
        yield started
    finally:
        stop_server(started.process)


def test_the_inspector_calls_the_tools_over_http_with_the_token(
    http_server: HttpServer, workspace: Path
) -> None:
    target = [http_server.url, "--transport", "http", "--header", f"Authorization: Bearer {TOKEN}"]
    tools = inspector(*target, "--method", "tools/list", cwd=workspace)["tools"]
    assert "execute_ipython_cell" in {t["name"] for t in tools}
    result = call(target, workspace, "execute_ipython_cell", "code=print('over http')")
    assert result["content"] == [{"type": "text", "text": "over http"}]
    refused = subprocess.run(
        ["npx", "-y", INSPECTOR, "--cli", http_server.url, "--transport", "http", "--method", "tools/list"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=workspace,
    )
    assert refused.returncode != 0
