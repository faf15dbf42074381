"""A sandboxed kernel's matplotlib starts from the user's font list (`gateway._kernel_launch`): its
matplotlib folder is private and new for every kernel, and without a list there its first import of
matplotlib scanned every font on the system, seconds of CPU in a first plot (or in every warmed
kernel). The list is copied in; what the kernel writes never reaches the user's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from ipybox import CodeExecutor
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.timeout(300)]

# matplotlib says at INFO level when it scans the fonts instead of reading its list.
FONTS = (
    "import logging, os\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "import matplotlib, matplotlib.font_manager as fm\n"
    "print(matplotlib.get_cachedir().startswith(os.environ['TMPDIR']), len(fm.fontManager.ttflist) > 0)\n"
    "_ = open(os.path.join(matplotlib.get_cachedir(), os.listdir(matplotlib.get_cachedir())[0]), 'w').write('{}')"
)


async def test_a_sandboxed_kernel_reads_the_users_font_list_and_writes_only_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_sandbox()
    user_cache = tmp_path / "mpl"
    # The user's list, made by matplotlib itself outside any sandbox, as any plot of the user's would.
    await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", "import matplotlib.font_manager"],
        env={"MPLCONFIGDIR": str(user_cache), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    (font_list,) = user_cache.glob("fontlist-v*.json")
    before = font_list.read_bytes()
    monkeypatch.setenv("MPLCONFIGDIR", str(user_cache))
    work = tmp_path / "work"
    work.mkdir()
    async with CodeExecutor(sandbox=True, working_dir=work, warm_imports=()) as ex:
        result = await ex.execute(FONTS)
    assert result.text is not None
    assert "generated new fontManager" not in result.text
    assert result.text.splitlines()[-1] == "True True"
    assert font_list.read_bytes() == before
