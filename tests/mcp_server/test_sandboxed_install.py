"""``install_package`` under ``ipybox --sandbox``: wheels only, into a folder only the kernel reads."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of
from tests.sandbox_support import require_sandbox


@pytest.mark.timeout(300)
async def test_sandboxed_installs_go_to_a_kernel_only_folder_and_build_nothing(tmp_path: Path) -> None:
    require_sandbox()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env = server_env(IPYBOX_STATE_DIR=str(tmp_path / "state"))
    async with connected(stdio_params(workspace, "--sandbox", env=env)) as client:
        installed = await client.call_tool("install_package", {"package_name": "cowsay==6.1"})
        assert not installed.is_error, text_of(installed)
        where = await run(client, "import cowsay\nprint(cowsay.__file__)")
        assert text_of(where).startswith(str(workspace / ".ipybox" / "site-packages"))

        for url in ["git+https://github.com/x/y", "y @ git+https://github.com/x/y", "file:///tmp/y"]:
            refused = await client.call_tool("install_package", {"package_name": url})
            assert refused.is_error and "refused under --sandbox" in text_of(refused)

        await client.call_tool("reset", {})
        assert text_of(await run(client, "import cowsay\ncowsay.__version__")) == "'6.1'"

        # Kernel code that puts a link in place of the folder cannot send installs elsewhere.
        outside = tmp_path / "outside"
        outside.mkdir()
        swap = f"import os\nos.rename('.ipybox/site-packages', 'old')\nos.symlink({str(outside)!r}, '.ipybox/site-packages')"
        assert not (swapped := await run(client, swap)).is_error, text_of(swapped)
        refused = await client.call_tool("install_package", {"package_name": "six==1.17.0"})
        assert refused.is_error and "symbolic link" in text_of(refused), text_of(refused)
        assert list(outside.iterdir()) == []
    # Nothing reached the environment the server (outside the sandbox) imports from.
    check = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import cowsay", stderr=asyncio.subprocess.DEVNULL
    )
    assert await check.wait() != 0
