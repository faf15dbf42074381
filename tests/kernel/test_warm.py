"""Modules a kernel imports ahead (`CodeExecutor(warm_imports=...)`): in the background once the
kernel is idle, so that a spare kernel has them before it is handed out, while a cell that needs
one at once still gets it whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ipybox import CodeExecutor

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

WARMED = (
    "import sys\n"
    # private: the kernel-side module's thread says when the background imports are done.
    "_w = sys.modules.get('ipybox.kernel._warm')\n"
    "print(_w is not None and _w._thread is not None and not _w._thread.is_alive()"
    " and 'matplotlib.pyplot' in sys.modules and 'no_such_module_x' not in sys.modules)\n"
    "del _w"
)
# private: wait() makes the imports now, whether the kernel is idle or not.
FORCED = (
    "__import__('ipybox.kernel._warm', fromlist=['wait']).wait()\n"
    "import os, sys\n"
    "print(sorted(m for m in ('matplotlib.pyplot',) if m in sys.modules), 'IPYBOX_WARM_IMPORTS' in os.environ)"
)
PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
WARM = ("no_such_module_x", "matplotlib.pyplot")


async def test_an_idle_kernel_imports_the_warm_modules_and_a_cell_then_finds_them(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path, warm_imports=WARM) as ex:
        # The kernel after a reset is the spare: nothing in it imported pyplot but the background.
        await ex.reset()
        for _ in range(240):
            if (await ex.execute(WARMED)).text == "True":
                break
            # sleep: idle time is what the test needs; the imports start once the kernel is idle.
            await asyncio.sleep(0.5)
        else:
            pytest.fail("the idle kernel did not import the warm modules within 2 minutes")
        plotted = await ex.execute(PLOT)
    # No word from the background imports in any output; a missing module is left alone.
    assert plotted.text is None and len(plotted.images) == 1


async def test_a_first_cell_that_races_the_warm_imports_gets_them_whole(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path, warm_imports=WARM) as ex:
        first = await ex.execute(PLOT)
        forced = await ex.execute(FORCED)
    assert first.text is None and len(first.images) == 1
    assert forced.text == "['matplotlib.pyplot'] False"


async def test_no_warm_imports_import_nothing_ahead(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path, warm_imports=()) as ex:
        assert (await ex.execute(FORCED)).text == "[] False"
