"""memory_limit and max_processes: real kernels going over them, sandboxed and not."""

from __future__ import annotations

# private-ok: ipybox.gateway._limits is unit-tested here (size parsing, set-up without a control
# group), and which mechanism holds the limits decides what the end-to-end tests may expect.
import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from ipybox import CodeExecutionError, CodeExecutor
from ipybox.app.kernels import KernelHost
from ipybox.errors import GatewayError
from ipybox.gateway import _limits
from ipybox.kernel_mgr.server import KernelGateway
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

LAUNCHER = str(Path(_limits.__file__).resolve())
MEMORY = 400 * 2**20
PROCESSES = 64
# A fork bomb in a process of its own session, so that only the limit can stop it. It creates
# the file named by its second argument when a fork first fails: it has reached the limit.
BOMB = """
import os, subprocess, sys
code = (
    "import os, sys, time\\n"
    "while True:\\n"
    "    try:\\n"
    "        os.fork()\\n"
    "    except OSError:\\n"
    "        open(sys.argv[2], 'a').close()\\n"
    "        time.sleep(0.01)"
)
bomb = subprocess.Popen(
    [sys.executable, "-c", code, "ipybox-fork-bomb", {held!r}], start_new_session=True
)
print(bomb.pid)
"""


def bomb_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "ipybox-fork-bomb" in (proc.info["cmdline"] or []):
            found.append(proc)
    return found


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=[False, True], ids=["unsandboxed", "sandboxed"]
)
async def executor(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[CodeExecutor]:
    if request.param:
        require_sandbox()
    workdir = tmp_path_factory.mktemp("limited")
    ex = CodeExecutor(
        sandbox=request.param, working_dir=workdir, memory_limit=MEMORY, max_processes=PROCESSES
    )
    try:
        await ex.start()
    except GatewayError as exc:
        # Only where neither a cgroup nor RLIMIT_NPROC can hold the limit (root without cgroups).
        assert "cannot be enforced" in str(exc)
        pytest.skip(f"the limits cannot be enforced here: {exc}")
    try:
        yield ex
    finally:
        await ex.stop()


def how(ex: CodeExecutor) -> str:
    """Which mechanism holds the limits (private: not exposed, but the assertions depend on it)."""
    assert isinstance(ex._kernels, KernelHost)
    return ex._kernels.gateway._limits.how


async def test_a_kernel_over_its_memory_limit_is_stopped_and_the_executor_goes_on(
    executor: CodeExecutor,
) -> None:
    await executor.execute("survivor = 1")
    with pytest.raises(CodeExecutionError) as info:
        await executor.execute("hog = b'x' * (1024 * 2**20)\nprint(len(hog))", timeout=60)
    if how(executor).startswith("cgroup"):
        # Killed by the kernel's OOM killer, reported as such, and replaced.
        assert "memory limit" in str(info.value) and "fresh kernel" in str(info.value)
        assert (await executor.execute("print('survivor' in dir())")).text == "False"
    else:
        # RLIMIT_DATA: the allocation fails inside a kernel that keeps running.
        assert info.value.ename == "MemoryError"
        assert (await executor.execute("print(survivor)")).text == "1"
    assert (await executor.execute("print(sum(range(10)))")).text == "45"
    # Memory under the limit is fine.
    assert (await executor.execute("data = b'x' * (100 * 2**20)\nprint(len(data) // 2**20)")).text == "100"


async def test_a_fork_bomb_is_held_at_the_limit_and_cleared_with_the_next_kernel(
    executor: CodeExecutor,
) -> None:
    assert executor.settings.working_dir is not None
    held = executor.settings.working_dir / "fork-bomb-held"  # a file the sandboxed kernel may write too
    await executor.execute(BOMB.format(held=str(held)), timeout=30)
    # The bomb grows until a fork fails and stays there; the application keeps running meanwhile.
    deadline = time.monotonic() + 60
    while not held.exists() and time.monotonic() < deadline:  # noqa: ASYNC110  # no event: polled
        await asyncio.sleep(0.1)
    assert held.exists(), "the fork bomb never hit the process limit"
    assert 0 < len(bomb_processes()) <= PROCESSES
    await executor.reset()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # processes end on their own time: polled, under a deadline
        if not bomb_processes():
            break
        await asyncio.sleep(0.1)
    assert bomb_processes() == []
    assert (
        await executor.execute("import subprocess\nprint(subprocess.run(['true']).returncode)")
    ).text == "0"


async def test_stop_removes_the_control_groups() -> None:
    gateway = KernelGateway(port=None, memory_limit="256M", max_processes=32)
    try:
        await gateway.start()
    except GatewayError as exc:
        pytest.skip(f"the limits cannot be enforced here: {exc}")
    groups = [Path(group) for group in gateway._limits.groups]  # private: the groups are not exposed
    assert all(group.is_dir() for group in groups)
    await gateway.stop()
    assert not any(group.exists() for group in groups)


async def test_memory_sizes_are_parsed_and_bad_ones_refused() -> None:
    assert _limits.parse_memory("512M") == 512 * 2**20
    assert _limits.parse_memory("2g") == 2 * 2**30
    assert _limits.parse_memory(2**30) == 2**30
    with pytest.raises(ValueError, match="512M"):
        _limits.parse_memory("lots")
    with pytest.raises(ValueError, match="at least 32M"):
        _limits.parse_memory("1M")
    with pytest.raises(ValueError, match="at least 16"):
        KernelGateway(max_processes=2)


async def test_as_root_without_a_control_group_max_processes_is_refused_not_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = _limits.KernelLimits(None, 100)
    monkeypatch.setattr(limits, "_setup_v2", lambda name: False)
    monkeypatch.setattr(limits, "_setup_v1", lambda name: False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(_limits.LimitsUnavailableError, match="RLIMIT_NPROC"):
        limits.setup()
    memory_only = _limits.KernelLimits(MEMORY, None)
    monkeypatch.setattr(memory_only, "_setup_v2", lambda name: False)
    monkeypatch.setattr(memory_only, "_setup_v1", lambda name: False)
    memory_only.setup()
    assert memory_only.rlimits == {"RLIMIT_DATA": MEMORY}
    assert memory_only.launcher(["k"])[:4] == [
        sys.executable,
        "-I",
        "-S",
        LAUNCHER,
    ]


async def test_groups_left_by_an_application_that_was_killed_are_removed_by_the_next() -> None:
    first = _limits.KernelLimits(None, 64)
    first.setup()
    try:
        if not first.groups:
            pytest.skip("no writable control group here (the limits use rlimits)")
        finished = await asyncio.create_subprocess_exec("true")
        await finished.wait()
        stale = Path(next(iter(first.groups))).parent / f"ipybox-{finished.pid}-0000"
        stale.mkdir()
        (stale / "kernel-1").mkdir()
        second = _limits.KernelLimits(None, 64)
        second.setup()
        second.cleanup()
        assert not stale.exists()
    finally:
        first.cleanup()
