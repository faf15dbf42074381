"""``register_mcp_server`` under ``ipybox --sandbox``: no server runs from where kernels write."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
async def test_a_server_in_the_workspace_is_refused_and_one_outside_it_works(tmp_path: Path) -> None:
    require_sandbox()
    workspace, marker = tmp_path / "workspace", tmp_path / "pwned"
    workspace.mkdir()
    shutil.copy(DEMO_SERVER, workspace / "server.py")
    async with connected(stdio_params(workspace, "--sandbox", env=server_env())) as client:
        # The kernel rewrites the script before anyone registers it.
        payload = f"open({str(marker)!r}, 'w').write('ran')"
        rewrite = f"open('server.py', 'w').write({payload!r})"
        assert not (await run(client, rewrite)).is_error
        inside = {"command": sys.executable, "args": [str(workspace / "server.py")]}
        refused = await client.call_tool(
            "register_mcp_server", {"server_name": "inside", "server_params": inside}
        )
        assert refused.is_error and "sandboxed kernel can write" in text_of(refused)
        assert not marker.exists()
        outside = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": outside}
        )
        assert not registered.is_error, text_of(registered)
        result = await run(client, "from mcptools.demo import add\nprint(add.run(add.Params(a=2, b=3)).sum)")
        assert text_of(result) == "5"
