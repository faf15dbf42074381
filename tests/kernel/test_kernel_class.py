"""The kernel class of ipybox kernels (`ipybox.kernel._kernel`): ipykernel's, without its debugger,
which no ipybox kernel serves, while a cell may still import debugpy itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipybox import CodeExecutor

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

STATE = (
    "import sys\n"
    "print(type(get_ipython().kernel).__module__, 'debugpy' in sys.modules,"
    " any(m.startswith('_pydevd') for m in sys.modules))"
)
IMPORTED = "import debugpy\nprint(debugpy.__name__)"


async def test_a_kernel_starts_without_importing_the_debugger_and_a_cell_can_still_import_it(
    tmp_path: Path,
) -> None:
    async with CodeExecutor(working_dir=tmp_path, spare_kernel=False) as ex:
        state = await ex.execute(STATE)
        imported = await ex.execute(IMPORTED)
    assert state.text == "ipybox.kernel._kernel False False"
    assert imported.text == "debugpy"
