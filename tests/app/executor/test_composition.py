"""`CodeExecutor` as one class holding its parts: what the MCP server and the integrations read of
it is public (`started`, `confinement`), and a failed start leaves it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipybox import CodeExecutor
from ipybox.app.sandbox import KernelConfinement


@pytest.mark.slow
async def test_started_and_confinement_follow_start_and_stop(tmp_path: Path) -> None:
    executor = CodeExecutor(working_dir=tmp_path)
    assert not executor.started and executor.confinement is None
    async with executor:
        assert executor.started
        assert isinstance(executor.confinement, KernelConfinement)
        assert (await executor.execute("print(1 + 1)")).text == "2"
        with pytest.raises(RuntimeError, match="already started"):
            await executor.start()
    assert not executor.started and executor.confinement is None
    with pytest.raises(RuntimeError, match="not started"):
        await executor.execute("1")


async def test_a_start_that_fails_leaves_the_executor_stopped_and_startable_again(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    executor = CodeExecutor(working_dir=missing)
    with pytest.raises(ValueError, match="missing"):
        await executor.start()
    assert not executor.started
    with pytest.raises(ValueError, match="missing"):
        await executor.start()
