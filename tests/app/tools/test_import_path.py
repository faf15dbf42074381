"""Servers whose API the application generated into a folder it put on the kernel's import path
(``kernel_env={"PYTHONPATH": ...}``) are the application's choice and run; a folder the kernel
chooses itself (its own ``sys.path`` or ``PYTHONPATH`` at run time, a package it writes) is not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources
from tests.conftest import DEMO_SERVER
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


def add(server: str) -> str:
    return f"from {server}.add import Params, run\nprint(run(Params(a=2, b=3)))"


async def test_a_server_generated_into_a_folder_on_the_kernels_pythonpath_runs(tmp_path: Path) -> None:
    """The reference's own usage: the API in a folder outside the working directory, that folder
    on the kernel's import path (two entries, one inside the working directory)."""
    work, api, more = tmp_path / "work", tmp_path / "api", tmp_path / "work" / "lib"
    work.mkdir()
    await generate_mcp_sources("demo_api", DEMO, api)
    await generate_mcp_sources("more_api", DEMO, more)
    pythonpath = os.pathsep.join([str(api), str(more)])
    async with CodeExecutor(
        working_dir=work, kernel_env={"PYTHONPATH": pythonpath}, approve_tool_calls=False
    ) as ex:
        first = await ex.execute(add("demo_api"), timeout=60)
        second = await ex.execute(add("more_api"), timeout=60)
    assert first.text == second.text
    assert first.text is not None and "5" in first.text


@pytest.mark.slow
async def test_a_kernel_cannot_reach_a_server_by_putting_its_folder_on_its_own_import_path(
    tmp_path: Path,
) -> None:
    """Attack from a sandboxed kernel: another application's server, its folder put on the
    kernel's ``sys.path`` and ``PYTHONPATH`` at run time, and a package the kernel writes
    itself into a folder of its own choosing, are all refused by name."""
    require_sandbox()
    work, mine, theirs = tmp_path / "work", tmp_path / "mine", tmp_path / "theirs"
    work.mkdir()
    await generate_mcp_sources("own_api", DEMO, mine)
    await generate_mcp_sources("their_api", DEMO, theirs)
    async with CodeExecutor(
        sandbox=True, working_dir=work, kernel_env={"PYTHONPATH": str(mine)}, approve_tool_calls=False
    ) as ex:
        own = await ex.execute(add("own_api"), timeout=60)
        # The kernel puts the other application's folder on its import path itself and names its server.
        chosen = (
            f"import os, sys\nos.environ['PYTHONPATH'] = {str(theirs)!r}\nsys.path.insert(0, {str(theirs)!r})\n"
            "from ipybox.tool_exec.client import run_tool\nprint(run_tool('their_api', 'add', {'a': 2, 'b': 3}))"
        )
        with pytest.raises(CodeExecutionError) as borrowed:
            await ex.execute(chosen, timeout=60)
        # A package of that name the kernel writes into a folder of its own and imports from there.
        planted = (
            "os.makedirs('planted/their_api', exist_ok=True)\n"
            "open('planted/their_api/__init__.py', 'w').close()\n"
            "open('planted/their_api/add.py', 'w').write("
            '\'from ipybox.tool_exec.client import run_tool\\nprint(run_tool("their_api", "add", {"a": 2, "b": 3}))\\n\')\n'
            "sys.path.insert(0, os.path.abspath('planted'))\n"
            "import their_api.add"
        )
        with pytest.raises(CodeExecutionError) as written:
            await ex.execute(planted, timeout=60)
        again = await ex.execute(add("own_api"), timeout=60)
    assert own.text is not None and "5" in own.text and again.text == own.text
    for refused in (borrowed, written):
        assert "'their_api' is not registered for this executor" in str(refused.value)
