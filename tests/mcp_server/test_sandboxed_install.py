"""``install_package`` under ``ipybox --sandbox``: wheels only, by a confined installer, into a
folder that kernels read but cannot write."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

# Private: where installed packages go, and the installer run on its own (no MCP round trip).
from ipybox.mcp_server._install import Installer, InstallError, packages_dir
from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.slow

# Kernel code: a uv.toml that moves uv's cache into the workspace and asks for hard links, and a
# `pip` package that would run as the application if the installer imported it.
PLANT = """
import os
open('uv.toml', 'w').write('cache-dir = "' + os.getcwd() + '/uvcache"\\nlink-mode = "hardlink"\\n')
os.makedirs('pip', exist_ok=True)
open('pip/__init__.py', 'w').write('')
open('pip/__main__.py', 'w').write("open(" + repr(os.getcwd() + '/../pwned') + ", 'w').write('pip')")
print('planted')
"""


def links(path: Path) -> int:
    return path.stat().st_nlink


@pytest.mark.timeout(300)
async def test_sandboxed_installs_take_nothing_from_the_workspace_and_land_where_kernels_cannot_write(
    tmp_path: Path,
) -> None:
    require_sandbox()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env = server_env()  # the test's own state folder (IPYBOX_STATE_DIR)
    # Started in the workspace, as `ipybox` is from a project folder.
    params = stdio_params(workspace, "--sandbox", env=env).model_copy(update={"cwd": workspace})
    async with connected(params) as client:
        assert text_of(await run(client, PLANT)) == "planted"
        installed = await client.call_tool("install_package", {"package_name": "cowsay==6.1"})
        assert not installed.is_error, text_of(installed)
        where = await run(client, "import cowsay\nprint(cowsay.__file__)")
        installed_file = Path(text_of(where))
        assert installed_file.parent.parent == packages_dir(workspace)
        assert not str(installed_file).startswith(str(workspace))
        # A copy, not a hard link into a cache: editing it edits nothing else.
        assert links(installed_file) == 1
        assert not (workspace / "uvcache").exists() and not (tmp_path / "pwned").exists()

        for url in ["git+https://github.com/x/y", "y @ git+https://github.com/x/y", "file:///tmp/y"]:
            refused = await client.call_tool("install_package", {"package_name": url})
            assert refused.is_error and "refused under --sandbox" in text_of(refused)

        # The packages folder is on every session's path: no kernel may plant code there, nor
        # change what is installed.
        plant = (
            "import os, cowsay\n"
            "for path in [os.path.join(os.environ['PYTHONPATH'], 'sitecustomize.py'), cowsay.__file__]:\n"
            "    try:\n"
            "        open(path, 'a').write('print(1)')\n"
            "        print('wrote', path)\n"
            "    except OSError as exc:\n"
            "        print('refused', type(exc).__name__)\n"
        )
        assert text_of(await run(client, plant)).splitlines() == ["refused OSError"] * 2
        await client.call_tool("reset", {})
        assert text_of(await run(client, "import cowsay\ncowsay.__version__")) == "'6.1'"
    # Installs outlive the server: the next server for this workspace finds them.
    async with connected(params) as client:
        assert text_of(await run(client, "import cowsay\ncowsay.__version__")) == "'6.1'"
    # Nothing reached the environment the server (outside the sandbox) imports from.
    check = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", "import cowsay", stderr=asyncio.subprocess.DEVNULL
    )
    assert await check.wait() != 0


async def test_pip_is_never_imported_from_the_folder_the_installer_is_started_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = tmp_path / "workspace"
    (workspace / "pip").mkdir(parents=True)
    marker = tmp_path / "pwned"
    (workspace / "pip" / "__init__.py").write_text("")
    (workspace / "pip" / "__main__.py").write_text(f"open({str(marker)!r}, 'w').write('pip')\n")
    monkeypatch.chdir(workspace)
    # No uv anywhere it is looked for, so the installer is `python -m pip`.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("HOME", str(tmp_path))
    installer = Installer(tmp_path / "site", python=sys.executable, environ={"PATH": "/usr/bin:/bin"})
    assert installer.command("six")[:4] == [sys.executable, "-I", "-m", "pip"]
    with pytest.raises(InstallError):  # this uv-made environment has no pip of its own
        await installer.install("cowsay==6.1", timeout=60)
    assert not marker.exists()
