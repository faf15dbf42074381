"""`KernelSource`: the one protocol the executor's three kernel sources meet.

mypy checks each class against it (`_sources` below). At run time, `isinstance` checks sources that
are started (on Python 3.11 it reads their properties, which a source not yet started refuses), and
`getattr_static` (what `isinstance` uses from Python 3.12) checks sources as the executor makes them.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ipybox import CodeExecutor, KernelPool

# private: the kernel sources are made here as the executor makes them, from its parts' inputs
from ipybox._wire import ToolServerEnv

# private: as above
from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels import KernelHost, KernelSource, RemoteKernelHost
from ipybox.app.pool import PooledKernels
from ipybox.app.sandbox import KernelConfinement

_MEMBERS = ("client", "start", "stop", "recover")


def _sources(local: KernelHost, remote: RemoteKernelHost, pooled: PooledKernels) -> list[KernelSource]:
    # Never called: mypy refuses this function if one of the three does not meet the protocol.
    return [local, remote, pooled]


def _ignore(confinement: KernelConfinement) -> None:
    del confinement


def test_the_protocol_is_client_start_stop_and_recover() -> None:
    assert sorted(name for name in vars(KernelSource) if not name.startswith("_")) == sorted(_MEMBERS)


def test_each_kernel_source_as_the_executor_makes_it_has_every_member_of_the_protocol() -> None:
    local = KernelHost(ExecutorSettings(), {}, on_start=_ignore)
    remote = RemoteKernelHost(ExecutorSettings(kernel_gateway_url="http://gateway.invalid:8888"), {}, _ignore)
    pool = KernelPool(size=0)
    pooled = pool.kernels_for(pool.settings, ToolServerEnv(token="t"), _ignore)
    for source in (local, remote, pooled):
        for name in _MEMBERS:
            member = inspect.getattr_static(source, name)
            assert isinstance(member, property) if name == "client" else inspect.iscoroutinefunction(member)
        with pytest.raises(RuntimeError, match="not started"):
            source.client  # noqa: B018
    assert not isinstance(object(), KernelSource)


@pytest.mark.slow
async def test_started_sources_of_an_own_gateway_and_of_a_pool_pass_isinstance(tmp_path: Path) -> None:
    async with CodeExecutor(working_dir=tmp_path) as own:
        # private: the executor does not expose its kernel source
        assert isinstance(own._kernels, KernelHost) and isinstance(own._kernels, KernelSource)
        assert (await own.execute("x = 6 * 7\nprint(x)")).text == "42"
        await own.reset()
        assert (await own.execute("print('x' in globals())")).text == "False"
    async with (
        KernelPool(size=1, working_dir=tmp_path) as pool,
        CodeExecutor(pool=pool, working_dir=tmp_path) as pooled,
    ):
        # private: as above
        assert isinstance(pooled._kernels, PooledKernels) and isinstance(pooled._kernels, KernelSource)
        assert (await pooled.execute("x = 6 * 7\nprint(x)")).text == "42"
        await pooled.reset()
        assert (await pooled.execute("print('x' in globals())")).text == "False"
