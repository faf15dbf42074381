"""HTTP sessions of ``ipybox --sandbox`` each work in a folder of their own, inside the workspace:
no session's kernel can read another's folder, or plant there (or in the shared packages folder)
anything that runs in another's kernel."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipybox.mcp_server._install import packages_dir  # private: where installed packages go
from tests.mcp_server.support import connected, run, text_of
from tests.mcp_server.test_http import TOKEN, HttpServer, start_server, stop_server
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.slow]

# Kernel code of the first session: code that would steal the next session's tool server token,
# in the shared packages folder (sitecustomize.py) and as packages shadowing installed ones.
PLANT = """
import os
steal = 'import os\\nopen({path!r}, "w").write(os.environ.get("TOOL_SERVER_TOKEN", ""))\\n'
outcome = []
for folder, name in [(os.environ['PYTHONPATH'], 'sitecustomize.py'), ('ipybox', '__init__.py')]:
    try:
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, name), 'w').write(steal.format(path=os.path.abspath('stolen-' + name)))
        outcome.append('planted')
    except OSError:
        outcome.append('refused')
print(' '.join(outcome))
"""

# Kernel code of a hostile session that knows where the victim's folder is (as if its name had
# leaked): it lists the folder that holds every session's folder and the victim's, reads the
# victim's file, and plants modules the victim's kernel would import from its working directory.
# It prints what it saw, as JSON.
ATTACK = """
import json, os
victim, workspace = {victim!r}, {workspace!r}
seen = {{}}
for folder in (os.path.join(workspace, 'sessions'), victim):
    try:
        seen['list ' + folder] = sorted(os.listdir(folder))
    except OSError as exc:
        seen['list ' + folder] = type(exc).__name__
try:
    seen['read'] = open(os.path.join(victim, 'secret.txt')).read()
except OSError as exc:
    seen['read'] = type(exc).__name__
planted = {{
    'planted_mod.py': 'print("PLANTED planted_mod")',
    'mcptools/__init__.py': '',
    'mcptools/planted_tool.py': 'print("PLANTED planted_tool")',
}}
for root in (victim, workspace):
    for name, body in planted.items():
        path = os.path.join(root, name)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as file:
                file.write(body)
            seen['wrote ' + path] = 'yes'
        except OSError as exc:
            seen['wrote ' + path] = type(exc).__name__
print(json.dumps(seen))
"""

IMPORTS = """
import importlib
for name in ('planted_mod', 'mcptools.planted_tool'):
    try:
        importlib.import_module(name)
        print(name, 'imported')
    except ImportError:
        print(name, 'missing')
print(open('secret.txt').read())
"""


def _start(tmp_path: Path, *extra: str) -> tuple[HttpServer, Path]:
    require_sandbox()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN, "IPYBOX_STATE_DIR": str(tmp_path / "state")}
    return start_server(workspace, tmp_path / "server.log", env, "--sandbox", *extra), workspace


@pytest.fixture
def sandboxed_server(tmp_path: Path) -> Iterator[tuple[HttpServer, Path]]:
    started, workspace = _start(tmp_path)
    try:
        yield started, workspace
    finally:
        stop_server(started.process)


# Under the default settings the temporary folder (and the home folder) are hidden from kernels
# anyway; the custom settings hide nothing and let every kernel write its working folder, so
# only the rule that sessions' folders are hidden from each other stands between them, as for
# a workspace outside the home and temporary folders.
_OPEN_CONFIG = {
    "network": {"allowedDomains": [], "deniedDomains": []},
    "filesystem": {"denyRead": [], "allowWrite": ["."], "denyWrite": []},
}


@pytest.fixture(params=["default settings", "settings that hide nothing"])
def attacked_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[HttpServer, Path]]:
    extra: list[str] = []
    if request.param != "default settings":
        config = tmp_path / "open.json"
        config.write_text(json.dumps(_OPEN_CONFIG))
        extra = ["--sandbox-config", str(config)]
    started, workspace = _start(tmp_path, *extra)
    try:
        yield started, workspace
    finally:
        stop_server(started.process)


async def test_a_hostile_session_can_neither_plant_nor_read_nor_list_in_another_sessions_folder(
    attacked_server: tuple[HttpServer, Path],
) -> None:
    server, workspace = attacked_server
    secret = secrets.token_hex(16)
    async with (
        connected(server.url, url_token=TOKEN) as victim,
        connected(server.url, url_token=TOKEN) as hostile,
    ):
        written = await run(
            victim, f"import os\nopen('secret.txt', 'w').write({secret!r})\nprint(os.getcwd())"
        )
        victim_dir = Path(text_of(written))
        hostile_dir = Path(text_of(await run(hostile, "import os; print(os.getcwd())")))

        attack = ATTACK.format(victim=str(victim_dir), workspace=str(workspace.resolve()))
        seen = json.loads(text_of(await run(hostile, attack)))
        imports = text_of(await run(victim, IMPORTS))

    # (a) Nothing planted reached the victim's kernel, or the disk outside the hostile folder.
    assert imports.splitlines() == ["planted_mod missing", "mcptools.planted_tool missing", secret]
    for folder in (victim_dir, workspace):
        assert not (folder / "planted_mod.py").exists() and not (folder / "mcptools").exists()
    # (b) The victim's file could not be read.
    assert seen["read"] != secret and secret not in json.dumps(seen)
    # (c) The sessions folder shows the hostile session nothing but its own folder.
    assert seen[f"list {workspace.resolve() / 'sessions'}"] in ([hostile_dir.name], "PermissionError")
    assert victim_dir.name not in json.dumps(seen[f"list {victim_dir}"])
    assert victim_dir != hostile_dir
    assert {victim_dir.parent, hostile_dir.parent} == {workspace.resolve() / "sessions"}


async def test_one_sessions_kernel_plants_nothing_that_runs_in_the_next_sessions_kernel(
    sandboxed_server: tuple[HttpServer, Path],
) -> None:
    server, workspace = sandboxed_server
    async with connected(server.url, url_token=TOKEN) as first:
        planted = text_of(await run(first, PLANT))
        first_dir = Path(text_of(await run(first, "import os; print(os.getcwd())")))
    # The packages folder (in the state folder, one per session) is not writable; the session's
    # own folder is, but shadows nothing in the next session's kernel.
    assert planted == "refused planted"
    async with connected(server.url, url_token=TOKEN) as second:
        result = await run(second, "import ipybox.tool_exec.client\nprint('imported')")
        assert text_of(result) == "imported"
    assert (first_dir / "ipybox" / "__init__.py").exists()
    assert sorted(path.name for path in workspace.rglob("stolen*")) == []


async def test_a_package_one_session_installs_is_on_that_sessions_path_only(
    sandboxed_server: tuple[HttpServer, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = sandboxed_server
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(tmp_path / "state"))  # the server's
    where = "import os\nprint(os.getcwd())\nprint(os.environ['PYTHONPATH'])"
    async with (
        connected(server.url, url_token=TOKEN) as first,
        connected(server.url, url_token=TOKEN) as second,
    ):
        installed = await first.call_tool("install_package", {"package_name": "cowsay==6.1"})
        assert not installed.is_error, text_of(installed)
        assert text_of(await run(first, "import cowsay\ncowsay.__version__")) == "'6.1'"
        missing = await run(second, "import cowsay")
        assert missing.is_error and "ModuleNotFoundError" in text_of(missing)
        for client in (first, second):
            folder, packages = text_of(await run(client, where)).splitlines()
            assert Path(packages) == packages_dir(Path(folder))
