"""Kernel code cannot make the server write or delete outside the workspace through symbolic links."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of


@pytest.mark.timeout(180)
@pytest.mark.slow
async def test_the_server_refuses_folders_kernel_code_replaced_with_links(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    outside = tmp_path / "outside"
    (outside / "demo").mkdir(parents=True)
    (outside / "demo" / "keep.txt").write_text("precious")
    (outside / "outputs").mkdir()
    env = server_env(IPYBOX_STATE_DIR=str(tmp_path / "state"))
    async with connected(stdio_params(workspace, env=env)) as client:
        code = (
            "import os\n"
            f"os.symlink({str(outside)!r}, 'mcptools')\n"
            "os.makedirs('.ipybox', exist_ok=True)\n"
            f"os.symlink({str(outside / 'outputs')!r}, '.ipybox/outputs')\n"
        )
        assert not (await run(client, code)).is_error
        demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": demo}
        )
        assert registered.is_error and "symbolic link" in text_of(registered), text_of(registered)
        assert sorted(os.listdir(outside)) == ["demo", "outputs"]
        assert os.listdir(outside / "demo") == ["keep.txt"]
        assert (outside / "demo" / "keep.txt").read_text() == "precious"

        long = await run(client, "print('HEAD'); print('x' * 20000); print('TAIL')", max_output_chars=1000)
        text = text_of(long)
        assert not long.is_error and text.startswith("HEAD") and text.endswith("TAIL")
        assert "the complete output was not saved" in text and "symbolic link" in text
        assert os.listdir(outside / "outputs") == []

        # With the links gone, both work again.
        assert not (await run(client, "os.unlink('mcptools'); os.unlink('.ipybox/outputs')")).is_error
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": demo}
        )
        assert not registered.is_error, text_of(registered)
        assert (workspace / "mcptools" / "demo").is_dir() and not (workspace / "mcptools").is_symlink()
