"""Modules a kernel imports ahead (`CodeExecutor(warm_imports=...)`): in the background from the
kernel's start, so that a spare kernel has them before it is handed out, while a cell that needs
one at once still gets it whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipybox import CodeExecutor

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

# private: the kernel-side module's wait() is how a test knows the background imports are done.
IMPORTED = (
    "__import__('ipybox.kernel._warm', fromlist=['wait']).wait()\n"
    "import os, sys\n"
    "print(sorted(m for m in ('matplotlib.pyplot', 'no_such_module_x') if m in sys.modules),"
    " 'IPYBOX_WARM_IMPORTS' in os.environ)"
)
PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"


async def test_a_spare_kernel_has_the_warm_modules_and_a_first_cell_that_races_them_gets_them_whole(
    tmp_path: Path,
) -> None:
    async with CodeExecutor(
        working_dir=tmp_path, warm_imports=("no_such_module_x", "matplotlib.pyplot")
    ) as ex:
        # At once: the kernel may still be importing pyplot in the background.
        first = await ex.execute(PLOT)
        await ex.reset()
        # Nothing in the fresh kernel imported pyplot: its spare did, while it waited.
        spare = await ex.execute(IMPORTED)
        plotted = await ex.execute(PLOT)
    # No word from the background imports in the cell's output; a missing module is left alone.
    assert first.text is None and len(first.images) == 1
    assert spare.text == "['matplotlib.pyplot'] False"
    assert plotted.text is None and len(plotted.images) == 1


async def test_no_warm_imports_import_nothing_ahead(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path, warm_imports=()) as ex:
        assert (await ex.execute(IMPORTED)).text == "[] False"
