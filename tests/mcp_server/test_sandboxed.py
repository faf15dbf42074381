"""``ipybox --sandbox`` over stdio: the agent's code runs contained, tool calls still work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of
from tests.net_support import package_index_url
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.slow

ATTEMPT = (
    "def attempt(action):\n"
    "    try:\n"
    "        action()\n"
    "        return 'allowed'\n"
    "    except Exception as exc:\n"
    "        return 'blocked'\n"
)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    require_sandbox()
    path = tmp_path / "workspace"
    path.mkdir()
    (path / ".env").write_text("DOTENV_SECRET=hidden\n")
    return path


@pytest.mark.timeout(300)
async def test_a_sandboxed_server_contains_the_code_and_still_runs_tool_calls(workspace: Path) -> None:
    env = server_env(IPYBOX_STATE_DIR=str(workspace.parent / "state"))
    async with connected(stdio_params(workspace, "--sandbox", env=env)) as client:
        registered = await client.call_tool(
            "register_mcp_server",
            {"server_name": "demo", "server_params": {"command": sys.executable, "args": [str(DEMO_SERVER)]}},
        )
        assert not registered.is_error, text_of(registered)
        result = await run(
            client,
            ATTEMPT + "from mcptools.demo import echo\n"
            "print(echo.run(echo.Params(text='through the sandbox')))\n"
            "print(attempt(lambda: open('written.txt', 'w').write('ok')))\n"
            "print(attempt(lambda: open('.env').read()))\n"
            # The kernel's own Python is visible (read-only); the rest of /tmp is hidden.
            f"print(attempt(lambda: open({str(Path(sys.prefix) / 'outside.txt')!r}, 'w').write('x')))\n"
            "import urllib.request\n"
            f"print(attempt(lambda: urllib.request.urlopen({package_index_url()!r}, timeout=10)))\n",
        )
        assert not result.is_error, text_of(result)
        assert text_of(result).split() == [
            "through",
            "the",
            "sandbox",
            "allowed",
            "blocked",
            "blocked",
            "blocked",
        ]
    assert (workspace / "written.txt").read_text() == "ok"
    assert not (Path(sys.prefix) / "outside.txt").exists()


@pytest.mark.timeout(300)
async def test_a_sandbox_config_loosens_only_what_it_names(workspace: Path) -> None:
    config = workspace.parent / "sandbox.json"
    # Writes allowed in the folder that also holds ipybox's state (the trusted registry): the
    # registry stays read-only whatever the config says.
    extra = workspace.parent
    config.write_text(
        json.dumps(
            {
                "network": {"allowedDomains": [], "deniedDomains": []},
                "filesystem": {"denyRead": [], "allowWrite": [str(extra)], "denyWrite": []},
            }
        )
    )
    env = server_env(IPYBOX_STATE_DIR=str(workspace.parent / "state"))
    async with connected(stdio_params(workspace, "--sandbox-config", str(config), env=env)) as client:
        result = await run(
            client,
            ATTEMPT + f"print(attempt(lambda: open({str(extra / 'x.txt')!r}, 'w').write('x')))\n"
            f"print(attempt(lambda: open({str(workspace.parent / 'state' / 'planted')!r}, 'w').write('x')))\n",
        )
        assert not result.is_error, text_of(result)
        assert text_of(result).split() == ["allowed", "blocked"]


@pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap is the Linux sandbox's tool")
def test_a_missing_sandbox_tool_stops_the_server_at_once_naming_it(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ipybox", "--workspace", str(tmp_path), "--sandbox"],
        input=b"",  # a pipe, as an MCP client gives; /dev/null is refused before the kernel starts
        capture_output=True,
        timeout=60,
        env={**os.environ, "PATH": str(tmp_path / "empty"), "IPYBOX_SRT": ""},
    )
    stderr = result.stderr.decode()
    assert result.returncode != 0
    assert "bwrap" in stderr or "bubblewrap" in stderr, stderr
    assert "apt-get install" in stderr and "Traceback" not in stderr
