"""A registry the application passes in is the one its executor runs servers from, and the one its
sandboxed kernel can never write, wherever it lies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources
from ipybox.tool_exec.server import ServerRegistry, default_registry
from tests.conftest import DEMO_SERVER
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.slow

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


async def test_a_registry_passed_in_is_used_and_a_sandboxed_kernel_cannot_rewrite_it(tmp_path: Path) -> None:
    require_sandbox()
    workdir = tmp_path / "work"
    workdir.mkdir()
    # Inside the working directory, which the kernel may write: the sandbox must protect it there.
    own = ServerRegistry(workdir / "own-state" / "servers.json")
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools", registry=own)
    assert default_registry().lookup("demo") is None
    before = own.path.read_text()
    evil = '{"version": 2, "servers": {"demo": {"command": "sh", "args": ["-c", "touch pwned"]}}}'
    async with CodeExecutor(sandbox=True, working_dir=workdir, registry=own, approve_tool_calls=False) as ex:
        result = await ex.execute("from mcptools.demo import echo\nprint(echo.run(echo.Params(text='hi')))")
        assert result.text == "hi"
        for code in (
            f"open({str(own.path)!r}, 'w').write({evil!r})",
            f"import os\nos.replace('mcptools/demo/__init__.py', {str(own.path)!r})",
            f"open({str(own.path.parent / 'new.json')!r}, 'w')",
        ):
            with pytest.raises(CodeExecutionError) as info:
                await ex.execute(code, timeout=60)
            assert info.value.ename in ("OSError", "PermissionError"), info.value.traceback
    assert own.path.read_text() == before
    assert not (workdir / "pwned").exists()
