"""The MCP configurations of the README and the guide work as pasted, with only the placeholder paths filled in."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp.client.stdio import StdioServerParameters

from tests.mcp_server.support import connected, run, server_env, text_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
# The README and the guide pages, where the configurations for Docker and the plugin are.
README = "".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))])
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"


def _configs() -> list[dict[str, Any]]:
    blocks = re.findall(r"```json\n(.*?)```", README, re.DOTALL)
    configs = [json.loads(block) for block in blocks if '"mcpServers"' in block]
    # A configuration shown on two pages is one configuration.
    return [config for i, config in enumerate(configs) if config not in configs[:i]]


def _server(command: str) -> dict[str, Any]:
    """The documented configuration whose server runs `command`, first argument included (of
    several that differ only in their `env`, the one without)."""
    matches = [
        c["mcpServers"]["ipybox"]
        for c in _configs()
        if [c["mcpServers"]["ipybox"]["command"], *c["mcpServers"]["ipybox"]["args"]][:2] == command.split()
    ]
    plain = [{key: value for key, value in m.items() if key != "env"} for m in matches]
    assert plain and all(p == plain[0] for p in plain), f"configurations starting with {command!r}: {matches}"
    server: dict[str, Any] = min(matches, key=len)
    return server


def _fill(args: list[str], workspace: Path) -> list[str]:
    return [
        arg.replace("/path/to/ipybox", str(ROOT)).replace("/path/to/workspace", str(workspace))
        for arg in args
    ]


def test_every_configuration_has_the_shape_claude_code_reads() -> None:
    configs = _configs()
    assert len(configs) >= 2
    for config in configs:
        assert list(config) == ["mcpServers"]
        assert list(config["mcpServers"]) == ["ipybox"]
        server = config["mcpServers"]["ipybox"]
        assert set(server) <= {"command", "args", "env"}
        assert isinstance(server["command"], str)
        assert all(isinstance(arg, str) for arg in server["args"])


def test_no_configuration_runs_the_unrelated_release_published_under_the_name() -> None:
    # `uvx ipybox` takes PyPI's ipybox, an older release with a different design.
    for config in _configs():
        server = config["mcpServers"]["ipybox"]
        if server["command"] == "uvx":
            assert server["args"][:2] == ["--from", "/path/to/ipybox"], server


def test_the_docker_form_mounts_the_workspace_where_the_image_expects_it() -> None:
    args = _server("docker run")["args"]
    assert args[:3] == ["run", "-i", "--rm"]
    assert "/path/to/workspace:/app/workspace" in args
    assert args[-1] == "ipybox", "the tag docker/build.sh gives the image"


@pytest.mark.timeout(600)
async def test_the_clone_form_serves_an_mcp_session_as_pasted(tmp_path: Path) -> None:
    uv = shutil.which("uvx") or str(Path.home() / ".local" / "bin" / "uvx")
    server = _server("uvx --from")
    assert server["command"] == "uvx"
    params = StdioServerParameters(command=uv, args=_fill(server["args"], tmp_path), env=server_env())
    async with connected(params) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert "execute_ipython_cell" in tools
        result = await run(client, "import os\nprint(os.getcwd())")
        # The tools promise plots: the configuration installs what they need (matplotlib).
        plot = await run(client, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    assert text_of(result).strip() == str(tmp_path)
    assert not plot.is_error, text_of(plot)
    images = [block for block in plot.content if isinstance(block, types.ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert len(list((tmp_path / "images").glob("*.png"))) == 1


@pytest.mark.timeout(600)
def test_the_claude_mcp_add_command_connects_in_claude_code(tmp_path: Path) -> None:
    if shutil.which("npx") is None:
        pytest.skip("npx is not installed")
    (line,) = {
        line for line in README.splitlines() if line.startswith("claude mcp add ipybox -- uvx --from ")
    }
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    argv = _fill(shlex.split(line), workspace)
    env = {
        **os.environ,
        "CLAUDE_CONFIG_DIR": str(tmp_path / "claude"),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }

    def claude(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["npx", "--yes", CLAUDE_CODE, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=workspace,
            timeout=300,
            check=False,
        )

    added = claude(*argv[1:])
    assert added.returncode == 0, added.stdout + added.stderr
    listed = claude("mcp", "list")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert re.search(r"^ipybox: .*Connected", listed.stdout, re.MULTILINE), listed.stdout


@pytest.mark.timeout(600)
def test_uvx_from_a_clone_runs_the_clones_newest_commit(tmp_path: Path) -> None:
    # Found in a newcomer's trial: after a `git pull` in the clone, `uvx --from` still ran its
    # first build of the clone (uv keyed the build on pyproject.toml alone).
    uvx = shutil.which("uvx") or str(Path.home() / ".local" / "bin" / "uvx")
    clone = tmp_path / "ipybox"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    cli = clone / "src" / "ipybox" / "mcp_server" / "_cli.py"
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}

    def described() -> str:
        helped = subprocess.run(
            [uvx, "--from", str(clone), "ipybox", "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert helped.returncode == 0, helped.stderr
        return helped.stdout

    assert "a newer commit" not in described()
    cli.write_text(cli.read_text().replace("Run ipybox as an MCP server.", "Run ipybox (a newer commit)."))
    git = ["git", "-C", str(clone), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run([*git, "commit", "--quiet", "--all", "--message", "newer"], check=True)
    assert "a newer commit" in described()
