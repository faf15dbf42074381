"""Kernels through a remote gateway vs local ones, in one run (issue 23).

The remote gateways run in a network namespace with one forwarded port (tests/remote_support.py),
with the same kernel arguments as ipybox's local kernel spec (`KERNEL_ARGS`; the extension is
loaded by the executor's setup cell): the stock Jupyter Kernel Gateway, and the same gateway run
through ipybox's own entry point (``ipybox.gateway._main``: TCP_NODELAY on its WebSockets), which
shows what the stock gateway's Nagle delays cost. For each: `CodeExecutor` start to the first
result, the trivial ``execute("x = 1")``, and 20 executors started at once (failures counted).

    .venv/bin/python benchmarks/remote.py [--executes N] [--starts N] [--concurrent N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipybox import CodeExecutor
from tests.remote_support import RemoteGateway, remote_gateway


def options(gateway: RemoteGateway | None) -> dict[str, Any]:
    if gateway is None:
        return {}
    return {
        "kernel_gateway_url": gateway.url,
        "kernel_gateway_token": gateway.token,
        "kernel_name": gateway.kernel_name,
    }


async def measure(
    gateway: RemoteGateway | None, executes: int, starts: int, concurrent: int
) -> dict[str, Any]:
    start_times = []
    for _ in range(starts):
        began = time.perf_counter()
        async with CodeExecutor(spare_kernel=False, **options(gateway)) as executor:
            await executor.execute("x = 1")
            start_times.append(time.perf_counter() - began)
    async with CodeExecutor(**options(gateway)) as executor:
        for _ in range(10):
            await executor.execute("x = 1")
        execute_times = []
        for _ in range(executes):
            began = time.perf_counter()
            await executor.execute("x = 1")
            execute_times.append(time.perf_counter() - began)
    executors = [CodeExecutor(spare_kernel=False, **options(gateway)) for _ in range(concurrent)]

    async def first_result(executor: CodeExecutor) -> None:
        await executor.start()
        await executor.execute("x = 1")

    began = time.perf_counter()
    outcomes = await asyncio.gather(
        *(first_result(executor) for executor in executors), return_exceptions=True
    )
    together = time.perf_counter() - began
    await asyncio.gather(*(executor.stop() for executor in executors), return_exceptions=True)
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    return {
        "start": statistics.median(start_times),
        "execute": statistics.median(execute_times),
        "execute_p90": statistics.quantiles(execute_times, n=10)[-1],
        "together": together,
        "failures": failures,
    }


@contextlib.contextmanager
def target(name: str) -> Iterator[RemoteGateway | None]:
    if name == "local":
        yield None
    else:
        with remote_gateway(name) as gateway:
            yield gateway


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--executes", type=int, default=200)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=20)
    args = parser.parse_args()
    names = {"local": "local", "kernel-gateway": "remote, stock KG", "ipybox-gateway": "remote, KG + NODELAY"}
    results = {}
    for name in names:
        with target(name) as gateway:
            results[name] = asyncio.run(measure(gateway, args.executes, args.starts, args.concurrent))
    local = results["local"]
    print(
        f"{'':22} {'start→result':>13} {'execute med':>12} {'p90':>9} {args.concurrent} at once {'failed':>7}"
    )
    for name, label in names.items():
        r = results[name]
        print(
            f"{label:22} {r['start'] * 1000:10.0f} ms {r['execute'] * 1000:9.2f} ms {r['execute_p90'] * 1000:6.2f} ms"
            f" {r['together']:9.2f} s {len(r['failures']):7d}"
        )
        for failure in r["failures"][:3]:
            print(f"    {type(failure).__name__}: {failure}")
    for name, label in list(names.items())[1:]:
        r = results[name]
        print(
            f"{label} / local: start {r['start'] / local['start']:.2f}x, execute {r['execute'] / local['execute']:.2f}x, "
            f"{args.concurrent} at once {r['together'] / local['together']:.2f}x"
        )


if __name__ == "__main__":
    main()
