"""The Claude Code plugin marketplace in .claude-plugin/: valid, complete, and loadable by Claude Code."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
MARKETPLACE = ROOT / ".claude-plugin" / "marketplace.json"
LAUNCHER = ROOT / "plugins" / "codeact" / "ipybox-mcp.sh"
SKILL = ROOT / "plugins" / "codeact" / "skills" / "codeact"

# Claude Code's own CLI validates the manifest and installs the plugins (npm, run with npx).
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"


def _marketplace() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(MARKETPLACE.read_text())
    return data


def _plugin_root(plugin: dict[str, Any]) -> Path:
    source = plugin["source"]
    assert isinstance(source, str) and source.startswith("./"), source
    return (ROOT / source).resolve()


def _expand(value: str, plugin_root: Path) -> str:
    return value.replace("${CLAUDE_PLUGIN_ROOT}", str(plugin_root))


def _frontmatter(text: str) -> dict[str, str]:
    match = re.match(r"---\n(.*?)\n---\n", text, re.DOTALL)
    assert match, "SKILL.md must start with a YAML front matter block"
    fields = {}
    for line in match.group(1).splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def test_the_marketplace_offers_the_three_codeact_plugins() -> None:
    data = _marketplace()
    assert data["name"] == "ipybox"
    assert data["owner"]["name"]
    assert [p["name"] for p in data["plugins"]] == ["codeact-default", "codeact-sandbox", "codeact-docker"]
    modes = {p["name"]: p["mcpServers"]["ipybox"]["args"] for p in data["plugins"]}
    assert modes == {
        "codeact-default": ["default"],
        "codeact-sandbox": ["sandbox"],
        "codeact-docker": ["docker"],
    }
    for plugin in data["plugins"]:
        assert plugin["description"]
        assert plugin["strict"] is False, "the marketplace entry defines the whole plugin"


def test_every_path_the_marketplace_names_exists() -> None:
    for plugin in _marketplace()["plugins"]:
        root = _plugin_root(plugin)
        assert root.is_dir()
        for skill in plugin["skills"]:
            skill_dir = root / skill
            assert (skill_dir / "SKILL.md").is_file(), skill_dir
        for server in plugin["mcpServers"].values():
            command = Path(_expand(server["command"], root))
            assert command.is_file(), command
            assert os.access(command, os.X_OK), f"{command} is not executable"


def test_the_plugin_versions_follow_the_package_version() -> None:
    import ipybox

    data = _marketplace()
    assert data["metadata"]["version"] == ipybox.__version__
    assert {p["version"] for p in data["plugins"]} == {ipybox.__version__}


def test_the_skill_and_every_reference_it_links_exist() -> None:
    text = (SKILL / "SKILL.md").read_text()
    front = _frontmatter(text)
    assert front["name"] == SKILL.name == "codeact"
    assert len(front["description"]) <= 1024
    links = re.findall(r"\]\((references/[^)]+)\)", text)
    assert links, "SKILL.md links its reference files"
    for link in links:
        assert (SKILL / link).is_file(), link
    assert sorted(p.relative_to(SKILL).as_posix() for p in (SKILL / "references").iterdir()) == sorted(
        set(links)
    )


def test_the_skill_teaches_every_step_of_the_codeact_workflow() -> None:
    text = "\n".join(p.read_text() for p in sorted(SKILL.rglob("*.md")))
    for needle in [
        "search_tools",  # search the generated tools before reading any
        "mcptools/",  # find tools by listing the generated packages
        "__init__.py",  # a server's package docstring lists its tools
        "Params",  # read only the interface
        "execute_ipython_cell",  # chain calls in one code action
        "run_parsed()",  # output parsers
        "ParseResult",
        "mcpparse/<server>/<tool>.py",
        "gentools/<category>/<name>/api.py",  # saved code actions
        "impl.py",
        "reset()",
        "${VAR}",
    ]:
        assert needle in text, f"the skill does not mention {needle}"


def test_the_launcher_is_valid_bash_and_rejects_an_unknown_mode_clearly() -> None:
    subprocess.run(["bash", "-n", str(LAUNCHER)], check=True)
    result = subprocess.run([str(LAUNCHER), "turbo"], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert result.stdout == "", "stdout belongs to the MCP protocol"
    assert "unknown mode 'turbo': use default, sandbox or docker" in result.stderr


def test_the_launcher_names_a_missing_workspace(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    env = {**os.environ, "IPYBOX_WORKSPACE": str(missing)}
    result = subprocess.run([str(LAUNCHER), "default"], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 1
    assert f"the workspace '{missing}' is not a folder" in result.stderr


def test_the_docker_plugin_says_how_to_build_a_missing_image(tmp_path: Path) -> None:
    env = {**os.environ, "IPYBOX_WORKSPACE": str(tmp_path), "IPYBOX_IMAGE": "ipybox-test-no-such-image"}
    if (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True).returncode
    ):
        pytest.skip("no Docker engine is running here (the case without one is the next test)")
    result = subprocess.run([str(LAUNCHER), "docker"], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 1
    assert result.stdout == ""
    if shutil.which("docker") is None:
        assert "docker is not installed" in result.stderr
    else:
        assert "'ipybox-test-no-such-image' does not exist" in result.stderr
        assert "docker/build.sh" in result.stderr


def test_the_docker_plugin_tells_a_user_without_a_docker_engine_to_start_one(tmp_path: Path) -> None:
    if shutil.which("docker") is None:
        pytest.skip("the docker CLI is not installed (apt-get install docker.io brings it)")
    # The real CLI, pointed at a socket no engine listens on.
    env = {**os.environ, "IPYBOX_WORKSPACE": str(tmp_path), "DOCKER_HOST": f"unix://{tmp_path / 'no-engine'}"}
    result = subprocess.run([str(LAUNCHER), "docker"], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "no Docker engine answers" in result.stderr and "Start Docker" in result.stderr
    assert "Cannot connect to the Docker daemon" in result.stderr, "docker's own words are quoted"
    assert "build.sh" not in result.stderr
    # Building the image, which the README's Docker section starts with, says the same at once.
    build = subprocess.run(
        ["bash", str(ROOT / "docker" / "build.sh")], capture_output=True, text=True, env=env, check=False
    )
    assert build.returncode == 1 and "no Docker engine answers" in build.stderr, build.stderr


def _claude(*args: str, config_dir: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "CLAUDE_CONFIG_DIR": str(config_dir),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # How long a server may take to answer `initialize` (default 30 s). Claude Code's MCP SDK
        # gives up at 60 s whatever this says, so more than 60000 changes nothing. A plugin's first
        # start installs its environment (uv and npm, from their caches) and ipybox starts its
        # kernel before it answers: measured 20 s at load 7 to 8, 35 s at load 13.
        "MCP_TIMEOUT": "60000",
    }
    return subprocess.run(
        ["npx", "--yes", CLAUDE_CODE, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=400,
        check=False,
    )


# What `scripts/setup.sh` and a test run leave in a clone (the real .venv is about 445 MB).
SET_UP_CLONE_FILES = [".venv/big.bin", "scripts/srt/node_modules/big.bin", ".mypy_cache/big.bin"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The repository's files as a set-up clone has them: links stay links, and a virtual
    environment, srt's node_modules and caches lie beside them (20 MB more in each here)."""
    if shutil.which("npx") is None:
        pytest.skip("npx is not installed")
    uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    target = tmp_path_factory.mktemp("clone") / "ipybox"
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_symlink():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).symlink_to(os.readlink(source))
        elif source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    # A real environment: Claude Code starts the plugins of a clone's marketplace in the clone.
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(target / ".venv")], check=True)
    for name in SET_UP_CLONE_FILES:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(os.urandom(20 * 2**20))
    yield target


def _server_lines(debug_log: Path) -> str:
    """What Claude Code's debug log says about the MCP servers it started (their stderr among it)."""
    if not debug_log.is_file():
        return f"\n(no debug log at {debug_log})"
    lines = [line for line in debug_log.read_text(errors="replace").splitlines() if "MCP server" in line]
    return "\n" + "\n".join(lines)


def _tree_size(folder: Path) -> int:
    return sum(path.lstat().st_size for path in folder.rglob("*") if path.is_file() or path.is_symlink())


def test_claude_code_validates_the_marketplace_strictly(clone: Path, tmp_path: Path) -> None:
    result = _claude("plugin", "validate", "--strict", str(clone), config_dir=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Validation passed" in result.stdout


@pytest.mark.timeout(900)
def test_claude_code_installs_each_plugin_and_connects_to_its_server(clone: Path, tmp_path: Path) -> None:
    config = tmp_path / "claude"
    project = tmp_path / "project"
    project.mkdir()
    added = _claude("plugin", "marketplace", "add", str(clone), config_dir=config)
    assert added.returncode == 0, added.stdout + added.stderr

    for name in ["codeact-default", "codeact-sandbox"]:
        installed = _claude("plugin", "install", f"{name}@ipybox", config_dir=config)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        # Claude Code copies the plugin's folder into its cache: the launcher, the skill and what
        # building ipybox needs (the links into the clone materialized), not the clone's .venv.
        (copy,) = (config / "plugins" / "cache" / "ipybox" / name).iterdir()
        assert not [n for n in SET_UP_CLONE_FILES if (copy / n).exists() or (copy / "ipybox" / n).exists()]
        assert (copy / "ipybox-mcp.sh").is_file() and (copy / "skills" / "codeact" / "SKILL.md").is_file()
        for needed in [
            "pyproject.toml",
            "uv.lock",
            "src/ipybox/__init__.py",
            "scripts/srt/package-lock.json",
        ]:
            assert (copy / "ipybox" / needed).is_file() and not (copy / "ipybox" / needed).is_symlink()
        assert _tree_size(copy) < 5 * 2**20, f"{name}'s copy holds {_tree_size(copy)} bytes"
    # Claude Code starts each plugin's server in the project, as a session would, and checks it
    # (the sandboxed one installs srt into the plugin's copy first).
    debug_log = tmp_path / "mcp-list.log"
    # The debug log says why a server failed, and when (with the server's stderr).
    listed = _claude("--debug-file", str(debug_log), "mcp", "list", config_dir=config, cwd=project)
    for name in ["codeact-default", "codeact-sandbox"]:
        assert re.search(rf"^plugin:{name}:ipybox: .*Connected", listed.stdout, re.MULTILINE), (
            listed.stdout + listed.stderr + _server_lines(debug_log)
        )

    installed = _claude("plugin", "install", "codeact-docker@ipybox", config_dir=config)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    for name in ["codeact-default", "codeact-sandbox", "codeact-docker"]:
        details = _claude("plugin", "details", f"{name}@ipybox", config_dir=config)
        assert details.returncode == 0, details.stdout + details.stderr
        assert re.search(r"Skills \(1\)\s+codeact", details.stdout), details.stdout
        assert re.search(r"MCP servers \(1\)\s+ipybox", details.stdout), details.stdout


@pytest.mark.timeout(300)
async def test_the_launcher_serves_the_claude_code_project_as_the_workspace(tmp_path: Path) -> None:
    from mcp.client.stdio import StdioServerParameters

    from tests.mcp_server.support import connected, run, server_env, text_of

    env = server_env(CLAUDE_PROJECT_DIR=str(tmp_path))
    params = StdioServerParameters(command=str(LAUNCHER), args=["default"], env=env, cwd=str(ROOT))
    async with connected(params) as client:
        result = await run(client, "import os\nopen('made-here.txt', 'w').write('x')\nprint(os.getcwd())")
    assert text_of(result).strip() == str(tmp_path)
    assert (tmp_path / "made-here.txt").read_text() == "x"


@pytest.mark.timeout(300)
async def test_the_sandbox_launcher_never_reads_settings_from_the_workspace(tmp_path: Path) -> None:
    """Attack: an earlier run without the sandbox (or its kernel) writes a ``sandbox-config.json``
    into the workspace that opens a folder outside it; the sandbox launcher used that file at its
    next start. Settings now come only from outside the workspace (``IPYBOX_SANDBOX_CONFIG``, or the
    plugin's own folder); the planted file is ignored with a note, and naming it is refused."""
    from mcp.client.stdio import StdioServerParameters

    from tests.mcp_server.support import connected, run, server_env, text_of

    workspace = tmp_path / "workspace"
    extra = tmp_path / "extra"
    workspace.mkdir()
    extra.mkdir()
    code = (
        f"try:\n    open({str(extra / 'x.txt')!r}, 'w').write('x')\n    print('allowed')\n"
        "except OSError:\n    print('blocked')\n"
    )
    config = {
        "network": {"allowedDomains": [], "deniedDomains": []},
        "filesystem": {"denyRead": [], "allowWrite": [str(workspace), str(extra)], "denyWrite": []},
    }
    (workspace / "sandbox-config.json").write_text(json.dumps(config))
    env = server_env(CLAUDE_PROJECT_DIR=str(workspace))
    env.pop("IPYBOX_SANDBOX_CONFIG", None)
    params = StdioServerParameters(command=str(LAUNCHER), args=["sandbox"], env=env)
    async with connected(params) as client:
        planted = await run(client, code)
    assert text_of(planted).strip() == "blocked", text_of(planted)

    trusted = tmp_path / "trusted-sandbox-config.json"
    trusted.write_text(json.dumps(config))
    params.env = {**env, "IPYBOX_SANDBOX_CONFIG": str(trusted)}
    async with connected(params) as client:
        custom = await run(client, code)
    assert text_of(custom).strip() == "allowed", text_of(custom)

    inside = await asyncio.to_thread(
        subprocess.run,
        [str(LAUNCHER), "sandbox"],
        env={**env, "IPYBOX_SANDBOX_CONFIG": str(workspace / "sandbox-config.json")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert inside.returncode != 0 and "lies in the workspace" in inside.stderr, inside.stderr


def test_the_docker_launcher_mounts_every_protected_name_that_ipybox_knows() -> None:
    """The launcher's list of names it mounts read-only is ipybox's own (bash cannot import it)."""
    # private: the protected names are internal to the sandbox; the launcher's copy must match them.
    from ipybox.app.sandbox._rules import PROTECTED_WORKSPACE_DIRS, PROTECTED_WORKSPACE_FILES

    [listed] = re.findall(r"^\s*protected=\((.*)\)$", LAUNCHER.read_text(), re.MULTILINE)
    assert listed.split() == [*PROTECTED_WORKSPACE_DIRS, *PROTECTED_WORKSPACE_FILES]


@pytest.mark.timeout(600)
async def test_the_launcher_runs_ipybox_from_a_copy_of_the_plugin_folder(tmp_path: Path) -> None:
    """What Claude Code's plugin cache holds: the plugin folder with its links made files."""
    from mcp.client.stdio import StdioServerParameters

    from tests.mcp_server.support import connected, run, server_env, text_of

    copy = tmp_path / "cache" / "codeact-default"
    shutil.copytree(LAUNCHER.parent, copy, symlinks=False)
    assert not any(path.is_symlink() for path in copy.rglob("*"))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    params = StdioServerParameters(
        command=str(copy / LAUNCHER.name), args=["default"], env=server_env(CLAUDE_PROJECT_DIR=str(workspace))
    )
    async with connected(params) as client:
        result = await run(client, "import ipybox, os, sys\nprint(ipybox.__file__, sys.prefix, os.getcwd())")
        # The plugin's environment has what the tools promise: plots.
        plot = await run(client, "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")
    assert [block.mime_type for block in plot.content if isinstance(block, types.ImageContent)] == [
        "image/png"
    ]
    module, prefix, cwd = text_of(result).split()
    assert Path(module).is_relative_to(copy / "ipybox" / "src") and Path(prefix) == copy / "ipybox" / ".venv"
    assert cwd == str(workspace)
