"""The ipybox Docker image, driven as an MCP client drives it: `docker run -i` on stdio.

Runs only against a built image named by IPYBOX_DOCKER_IMAGE (with the container user's ids in
IPYBOX_DOCKER_UID / IPYBOX_DOCKER_GID); `bash scripts/test-docker.sh` builds one and runs this.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import mcp_types as types
import pytest
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from PIL import Image

from tests.mcp_server.support import connected, run, text_of
from tests.net_support import package_index_url

ROOT = Path(__file__).parents[2]
IMAGE = os.environ.get("IPYBOX_DOCKER_IMAGE", "")
UID = int(os.environ.get("IPYBOX_DOCKER_UID", "1000"))
GID = int(os.environ.get("IPYBOX_DOCKER_GID", "1000"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not IMAGE, reason="needs a built image: run `bash scripts/test-docker.sh`"),
    pytest.mark.timeout(600),
]

# What `--sandbox` needs from Docker (README, "In Docker").
SANDBOX_OPTS = ["--security-opt", "seccomp=unconfined", "--security-opt", "systempaths=unconfined"]


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A workspace folder owned by the container user, as the host user's own folder would be."""
    path = tmp_path / "workspace"
    path.mkdir()
    if os.geteuid() == 0:
        os.chown(path, UID, GID)
    return path


@pytest.fixture
def state_volume() -> Iterator[str]:
    """A fresh named volume for the registry of MCP servers (the README's `ipybox-state`)."""
    name = f"ipybox-test-state-{uuid.uuid4().hex[:8]}"
    yield name
    _docker("volume", "rm", "-f", name)


def _readme_docker_args() -> list[str]:
    """The `docker` arguments of the documented MCP configuration for the image (README, guide)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    text = "".join(page.read_text() for page in pages)
    for block in re.findall(r"```json\n(.*?)```", text, re.DOTALL):
        server = json.loads(block).get("mcpServers", {}).get("ipybox", {})
        if server.get("command") == "docker":
            args: list[str] = server["args"]
            return args
    raise AssertionError("neither the README nor the guide has a docker configuration")


@asynccontextmanager
async def container(
    workspace: Path, state_volume: str, *ipybox_args: str, docker_opts: tuple[str, ...] = ()
) -> AsyncIterator[Client]:
    """An MCP session with a container, started by the README's configuration.

    Only the placeholders change: the workspace path, the state volume and the image's tag; a
    container name (to clean up after a failure) and `docker_opts` go before the image.
    """
    name = f"ipybox-test-{uuid.uuid4().hex[:8]}"
    args = [
        arg.replace("/path/to/workspace", str(workspace)).replace("ipybox-state:", f"{state_volume}:")
        for arg in _readme_docker_args()
    ]
    assert args[-1] == "ipybox"
    args[-1:] = ["--name", name, *docker_opts, IMAGE, *ipybox_args]
    docker = shutil.which("docker")
    assert docker is not None
    try:
        async with connected(
            StdioServerParameters(command=docker, args=args, env=dict(os.environ))
        ) as client:
            yield client
    finally:
        _docker("rm", "-f", name)


async def test_a_session_through_docker_run_writes_files_the_host_user_owns(
    workspace: Path, state_volume: str
) -> None:
    async with container(workspace, state_volume) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert {"execute_ipython_cell", "register_mcp_server", "install_package", "reset"} <= tools
        result = await run(
            client,
            "import os\nos.makedirs('out', exist_ok=True)\n"
            "open('out/hello.txt', 'w').write('from the container')\nprint(os.getcwd(), os.getuid())",
        )
    assert not result.is_error, text_of(result)
    assert text_of(result).split() == ["/app/workspace", str(UID)]
    written = workspace / "out" / "hello.txt"
    assert written.read_text() == "from the container"
    for path in [written, written.parent]:
        assert (path.stat().st_uid, path.stat().st_gid) == (UID, GID), path


async def test_a_plot_comes_back_as_an_image(workspace: Path, state_volume: str) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('in docker')\nplt.show()"
    async with container(workspace, state_volume) as client:
        result = await run(client, code)
    assert not result.is_error, text_of(result)
    images = [block for block in result.content if isinstance(block, types.ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    with Image.open(io.BytesIO(base64.b64decode(images[0].data))) as image:
        assert image.size[0] > 100 and image.size[1] > 100
    saved = list((workspace / "images").glob("*.png"))
    assert len(saved) == 1
    assert saved[0].stat().st_uid == UID


async def test_an_mcp_server_inside_the_container_is_called_from_code_and_stays_registered(
    workspace: Path, state_volume: str
) -> None:
    shutil.copy(ROOT / "examples" / "library_server.py", workspace / "library_server.py")
    params = {"command": "python", "args": ["/app/workspace/library_server.py"]}
    code = (
        "from mcptools.library import search_books, get_book\n"
        "found = search_books.run(search_books.Params(query='python'))\n"
        "best = max((get_book.run(get_book.Params(book_id=b.id)) for b in found.books), key=lambda b: b.rating)\n"
        "print(best.title)"
    )
    async with container(workspace, state_volume) as client:
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "library", "server_params": params}
        )
        assert not registered.is_error, text_of(registered)
        first = await run(client, code)
    assert text_of(first).strip() == "Fluent Python", text_of(first)
    assert (workspace / "mcptools" / "library" / "search_books.py").stat().st_uid == UID

    # A new container with the same state volume still runs the registered server.
    async with container(workspace, state_volume) as client:
        second = await run(client, code)
    assert text_of(second).strip() == "Fluent Python", text_of(second)


async def test_install_package_reaches_the_package_index_from_the_container(
    workspace: Path, state_volume: str
) -> None:
    async with container(workspace, state_volume) as client:
        installed = await client.call_tool("install_package", {"package_name": "six==1.17.0"})
        assert not installed.is_error, text_of(installed)
        result = await run(client, "import six\nprint(six.__version__)")
    assert text_of(result).strip() == "1.17.0"


async def test_the_codeact_docker_plugin_launcher_runs_the_image(workspace: Path, state_volume: str) -> None:
    launcher = ROOT / "plugins" / "codeact" / "ipybox-mcp.sh"
    env = {
        **os.environ,
        "IPYBOX_IMAGE": IMAGE,
        "IPYBOX_STATE_VOLUME": state_volume,
        "CLAUDE_PROJECT_DIR": str(workspace),
    }
    params = StdioServerParameters(command=str(launcher), args=["docker"], env=env)
    async with connected(params) as client:
        result = await run(client, "import os\nopen('via-plugin.txt', 'w').write('ok')\nprint(os.getcwd())")
    assert text_of(result).strip() == "/app/workspace"
    assert (workspace / "via-plugin.txt").stat().st_uid == UID


def test_sandbox_without_the_docker_options_it_needs_says_which_to_add(workspace: Path) -> None:
    result = subprocess.run(
        ["docker", "run", "-i", "--rm", "-v", f"{workspace}:/app/workspace", IMAGE, "--sandbox"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert "--sandbox cannot work in this container" in result.stderr
    assert "--security-opt seccomp=unconfined --security-opt systempaths=unconfined" in result.stderr


async def test_sandbox_works_in_the_container_with_the_documented_options_and_tools_still_run(
    workspace: Path, state_volume: str
) -> None:
    probe = await asyncio.to_thread(
        subprocess.run,
        [
            "docker",
            "run",
            "-i",
            "--rm",
            *SANDBOX_OPTS,
            "-v",
            f"{workspace}:/app/workspace",
            IMAGE,
            "--sandbox",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if "not available yet" in probe.stderr:
        pytest.skip("this version of ipybox has no sandbox yet")
    code = (
        "import os, urllib.request\n"
        "open('inside.txt', 'w').write('ok')\n"
        "def attempt(action):\n"
        "    try:\n"
        "        action()\n"
        "        return 'allowed'\n"
        "    except Exception as exc:\n"
        "        return 'blocked'\n"
        # The registry's folder, like the rest of /app but the workspace and the kernel's Python, is
        # hidden behind an empty folder of the sandbox's own: a write there may succeed and vanish
        # (checked on the volume below).
        "attempt(lambda: open('/app/state/planted', 'w').write('x'))\n"
        "print(attempt(lambda: open('/app/ipybox/pyproject.toml').read()))\n"
        # The application's own environment, writable by the container's user outside the sandbox.
        "print(attempt(lambda: open('/app/.venv/planted', 'w').write('x')))\n"
        f"print(attempt(lambda: urllib.request.urlopen({package_index_url()!r}, timeout=10)))\n"
    )
    shutil.copy(ROOT / "examples" / "library_server.py", workspace / "library_server.py")
    in_workspace = {"command": "python", "args": ["/app/workspace/library_server.py"]}
    # A server the kernel cannot rewrite: outside the workspace, mounted read-only.
    params = {"command": "python", "args": ["/opt/examples/library_server.py"]}
    examples = ("-v", f"{ROOT / 'examples'}:/opt/examples:ro")
    async with container(
        workspace, state_volume, "--sandbox", docker_opts=(*SANDBOX_OPTS, *examples)
    ) as client:
        result = await run(client, code)
        refused = await client.call_tool(
            "register_mcp_server", {"server_name": "library", "server_params": in_workspace}
        )
        assert refused.is_error and "sandboxed kernel can write" in text_of(refused), text_of(refused)
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "library", "server_params": params}
        )
        assert not registered.is_error, text_of(registered)
        called = await run(
            client,
            "from mcptools.library import search_books\n"
            "print(search_books.run(search_books.Params(query='kleppmann')).books[0].title)",
        )
    assert text_of(called).strip() == "Designing Data-Intensive Applications", text_of(called)
    assert not result.is_error, text_of(result)
    assert text_of(result).split() == ["blocked", "blocked", "blocked"]
    state = await asyncio.to_thread(
        _docker,
        "run",
        "--rm",
        "-v",
        f"{state_volume}:/app/state",
        "--entrypoint",
        "ls",
        IMAGE,
        "-a",
        "/app/state",
    )
    assert state.returncode == 0 and "planted" not in state.stdout, state
    assert (workspace / "inside.txt").read_text() == "ok"
    assert (workspace / "inside.txt").stat().st_uid == UID


def _git_workspace(workspace: Path) -> None:
    """A workspace that is a git repository, owned by the container user as the host user's would be."""
    (workspace / ".git" / "hooks").mkdir(parents=True)
    (workspace / ".git" / "config").write_text("[core]\n")
    if os.geteuid() == 0:
        for path in (workspace / ".git", workspace / ".git" / "hooks", workspace / ".git" / "config"):
            os.chown(path, UID, GID)


def test_without_sandbox_the_image_refuses_a_workspace_whose_git_it_could_change(workspace: Path) -> None:
    """Attack: without ``--sandbox`` the kernel runs as the workspace's owner and wrote
    ``.git/config`` (``core.fsmonitor``) and ``.git/hooks``, which git on the host later runs. The
    image does not start while such a name is writable, and names the read-only mount to add."""
    _git_workspace(workspace)
    result = subprocess.run(
        ["docker", "run", "-i", "--rm", "-v", f"{workspace}:/app/workspace", IMAGE],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "dst=/app/workspace/.git,readonly" in result.stderr


async def test_through_the_plugin_launcher_the_kernel_cannot_change_the_workspaces_git(
    workspace: Path, state_volume: str
) -> None:
    _git_workspace(workspace)
    launcher = ROOT / "plugins" / "codeact" / "ipybox-mcp.sh"
    env = {
        **os.environ,
        "IPYBOX_IMAGE": IMAGE,
        "IPYBOX_STATE_VOLUME": state_volume,
        "CLAUDE_PROJECT_DIR": str(workspace),
    }
    code = (
        "for path in ('.git/config', '.git/hooks/pre-commit', 'notes.txt'):\n"
        "    try:\n"
        "        open(path, 'a').write('[core]\\n\\tfsmonitor = touch /tmp/pwned\\n')\n"
        "        print(path, 'written')\n"
        "    except OSError:\n"
        "        print(path, 'refused')\n"
    )
    async with connected(StdioServerParameters(command=str(launcher), args=["docker"], env=env)) as client:
        result = await run(client, code)
    assert text_of(result).split("\n") == [
        ".git/config refused",
        ".git/hooks/pre-commit refused",
        "notes.txt written",
    ]
    assert (workspace / ".git" / "config").read_text() == "[core]\n"
    assert not (workspace / ".git" / "hooks" / "pre-commit").exists()
