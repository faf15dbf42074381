"""Modules a kernel imports ahead (`CodeExecutor(warm_imports=...)`, pyplot by default): in the
background once the executor has taken the kernel into use and it is idle, while a cell that needs
one at once still gets it whole; a spare kernel waits until it is handed out."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
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


def kernel_processes() -> list[psutil.Process]:
    """The ipykernel processes this test process started (through its gateway)."""
    found = []
    for process in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "ipykernel_launcher" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def has_matplotlib(process: psutil.Process) -> bool:
    """Whether `process` has loaded matplotlib's compiled font module (pyplot imports it)."""
    return "ft2font" in Path(f"/proc/{process.pid}/maps").read_text()


async def test_a_spare_kernel_imports_nothing_until_it_is_handed_out(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path) as ex:  # the default warms pyplot
        pid = int((await ex.execute("import os\nprint(os.getpid())")).text or "0")
        for _ in range(600):  # the spare starts after the first execution
            spares = [process for process in kernel_processes() if process.pid != pid]
            if spares:
                break
            await asyncio.sleep(0.1)  # sleep: the spare's process has no event to wait on; bounded
        else:
            pytest.fail("no spare kernel started within a minute")
        # sleep: idle time is what the test needs; a spare that warmed itself would have by then.
        await asyncio.sleep(5)
        assert not has_matplotlib(spares[0])
        await ex.reset()
        for _ in range(240):
            if (await ex.execute(WARMED)).text == "True":
                break
            await asyncio.sleep(0.5)
        else:
            pytest.fail("the kernel handed out did not import the warm modules within 2 minutes")
        assert (await ex.execute("import os\nprint(os.getpid())")).text == str(spares[0].pid)


async def test_no_warm_imports_import_nothing_ahead(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path, warm_imports=()) as ex:
        assert (await ex.execute(FORCED)).text == "[] False"
