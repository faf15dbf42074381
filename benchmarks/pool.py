"""Kernel pool figures (ipybox only: the reference has no pool), beside today's path in the same run.

- ``first_result``: a new `CodeExecutor`'s ``start()`` to the result of its first ``execute("x = 1")``,
  from a warm `KernelPool` (every kernel ready before each run, not timed) and cold (its own gateway
  and kernel, as without a pool); sandboxed and not; median of the runs.
- ``pss_per_session``: memory (PSS, from ``/proc/PID/smaps_rollup``) of this process and every process
  under it, with 1 and then 6 idle executors that each ran one cell; the figure is the growth per
  additional executor. Without a pool each executor has its own gateway and kernel (no spare kernel,
  as the MCP server's HTTP sessions run); with one, they share the pool's gateway (the pool's ready
  kernels are there in both counts, so they are not counted per session).
- ``mcp_first_result``: the ``ipybox`` MCP server over streamable HTTP, with ``--pool 2`` and
  without: opening a new MCP session (initialize) to the result of its first ``execute_ipython_cell``,
  for sessions after the first (the server starts the first session's executor with itself), each
  opened once the pool is full again (not timed); median.
- ``pool_idle``: a started pool of N ready kernels left alone for 60 s: CPU seconds its processes
  (gateway and kernels) used, and their PSS.

    uv run --frozen python benchmarks/pool.py [--quick] [--json PATH] [--no-sandbox]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import psutil
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ipybox import CodeExecutor, KernelPool

_MB = 1024 * 1024
_FIGURES = ("first_result", "pss_per_session", "mcp_first_result", "pool_idle")


def _pss(pid: int) -> int:
    """Bytes of PSS of one process (0 if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_pss(include_self: bool = True) -> int:
    me = psutil.Process()
    pids = [child.pid for child in me.children(recursive=True)]
    return sum(_pss(pid) for pid in ([me.pid] if include_self else []) + pids)


def _tree_cpu() -> float:
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


async def _until(predicate: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not fill up in time")
        await asyncio.sleep(0.05)


async def first_result(sandbox: bool, runs: int, cold_runs: int, work: Path) -> dict[str, Any]:
    warm: list[float] = []
    async with KernelPool(size=2, sandbox=sandbox, working_dir=work) as pool:
        for i in range(runs + 1):
            await _until(lambda: pool.ready == pool.size)
            await asyncio.sleep(0.5)  # the last refill's kernel settles (not timed)
            start = time.perf_counter()
            executor = CodeExecutor(sandbox=sandbox, working_dir=work, pool=pool)
            await executor.start()
            await executor.execute("x = 1")
            elapsed = time.perf_counter() - start
            await executor.stop()
            if i:  # the first run warms this process's imports
                warm.append(elapsed)
    cold: list[float] = []
    for _ in range(cold_runs):
        start = time.perf_counter()
        executor = CodeExecutor(sandbox=sandbox, working_dir=work)
        await executor.start()
        await executor.execute("x = 1")
        cold.append(time.perf_counter() - start)
        await executor.stop()
    return {
        "warm_ms": statistics.median(warm) * 1000,
        "warm_p90_ms": sorted(warm)[int(len(warm) * 0.9) - 1] * 1000,
        "cold_ms": statistics.median(cold) * 1000,
        "runs": len(warm),
        "cold_runs": len(cold),
    }


async def _settle() -> None:
    # Kernels finish their start-up imports and the allocator settles; PSS is read after.
    await asyncio.sleep(3)


async def pss_per_session(
    sandbox: bool, work: Path, more: int = 5, warm: dict[str, Any] | None = None
) -> dict[str, float]:
    """`warm`: ``{"warm_imports": ...}`` for the pool and its executors (default: ipybox's)."""
    warm = warm or {}
    results: dict[str, float] = {}
    for label, pooled in (("today", False), ("pool", True)):
        executors: list[CodeExecutor] = []
        pool = KernelPool(size=2, sandbox=sandbox, working_dir=work, **warm) if pooled else None
        try:
            if pool is not None:
                await pool.start()
            for count in (1, 1 + more):
                while len(executors) < count:
                    executor = CodeExecutor(
                        sandbox=sandbox, working_dir=work, pool=pool, spare_kernel=False, **warm
                    )
                    await executor.start()
                    await executor.execute("x = 1")
                    executors.append(executor)
                if pool is not None:
                    await _until(lambda pool=pool: pool.ready == pool.size)
                await _settle()
                results[f"{label}_{count}"] = _tree_pss() / _MB
        finally:
            for executor in executors:
                await executor.stop()
            if pool is not None:
                await pool.stop()
        results[f"{label}_per_session_mb"] = (results[f"{label}_{1 + more}"] - results[f"{label}_1"]) / more
    return results


def _kernels_under(pid: int) -> int:
    count = 0
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE and "ipykernel_launcher" in " ".join(child.cmdline()):
                count += 1
    return count


@contextlib.asynccontextmanager
async def _session(url: str, http: httpx2.AsyncClient) -> AsyncIterator[Client]:
    async with Client(streamable_http_client(url, http_client=http)) as client:
        yield client


async def mcp_first_result(pool: int | None, sessions: int) -> list[float]:
    token = "bench-token"
    times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ipybox-bench-pool-") as folder:
        workspace = Path(folder)
        log = workspace / "server.log"
        env = {**os.environ, "IPYBOX_MCP_TOKEN": token, "IPYBOX_STATE_DIR": str(workspace / ".state")}
        command = [sys.executable, "-m", "ipybox", "--workspace", str(workspace)]
        command += ["--transport", "streamable-http", "--port", "0", "--log-level", "ERROR"]
        command += ["--pool", str(pool)] if pool is not None else []
        with log.open("wb") as sink:
            process = subprocess.Popen(  # noqa: ASYNC220 - started once, outside the timed part
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink, env=env
            )
        try:
            url = ""
            deadline = time.monotonic() + 120
            while not url and time.monotonic() < deadline:
                if match := re.search(r"listening on (http://\S+)", log.read_text()):
                    url = match.group(1)
                await asyncio.sleep(0.05)
            async with contextlib.AsyncExitStack() as stack:
                # One HTTP client for every session, as an agent platform keeps one (making one costs
                # tens of milliseconds, which would count against the server).
                http = await stack.enter_async_context(
                    httpx2.AsyncClient(
                        headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30, read=300)
                    )
                )
                first = await stack.enter_async_context(_session(url, http))
                await first.call_tool("execute_ipython_cell", {"code": "x = 1"})
                for opened in range(1, sessions + 1):
                    # Every session's kernel, and the pool's ready ones, are up before the next opens.
                    await _until(lambda opened=opened: _kernels_under(process.pid) >= opened + (pool or 0))
                    await asyncio.sleep(0.5)
                    start = time.perf_counter()
                    client = await stack.enter_async_context(_session(url, http))
                    await client.call_tool("execute_ipython_cell", {"code": "x = 1"})
                    times.append(time.perf_counter() - start)
        finally:
            process.terminate()
            process.wait(timeout=60)
    return times


async def pool_idle(sandbox: bool, size: int, seconds: float, work: Path) -> dict[str, float]:
    async with KernelPool(size=size, sandbox=sandbox, working_dir=work) as pool:
        await _until(lambda: pool.ready == pool.size)
        await _settle()
        cpu = _tree_cpu()
        await asyncio.sleep(seconds)
        used = _tree_cpu() - cpu
        return {
            "size": size,
            "seconds": seconds,
            "cpu_seconds": used,
            "cpu_percent": 100 * used / seconds,
            "pss_mb": _tree_pss(include_self=False) / _MB,
        }


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-sandbox", action="store_true", help="leave the sandboxed figures out")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--no-warm-imports",
        action="store_true",
        help="kernels import nothing ahead (warm_imports=()), to measure what the default costs",
    )
    parser.add_argument(
        "--only", default=",".join(_FIGURES), help=f"comma-separated, of {', '.join(_FIGURES)}"
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    modes = [False] if args.no_sandbox else [False, True]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = await asyncio.to_thread(lambda: Path(tmp).resolve())
        for sandbox in modes if "first_result" in only else []:
            name = "sandboxed" if sandbox else "unsandboxed"
            figure = await first_result(
                sandbox, runs=5 if args.quick else 20, cold_runs=2 if args.quick else 5, work=work
            )
            results[f"first_result_{name}"] = figure
            print(
                f"first_result ({name}): from a warm pool {figure['warm_ms']:.1f} ms median "
                f"(p90 {figure['warm_p90_ms']:.1f} ms, {figure['runs']} runs); cold, today's path "
                f"{figure['cold_ms']:.0f} ms ({figure['cold_runs']} runs)"
            )
        for sandbox in modes if "pss_per_session" in only else []:
            name = "sandboxed" if sandbox else "unsandboxed"
            warm = {"warm_imports": ()} if args.no_warm_imports else None
            memory = await pss_per_session(sandbox, work, more=3 if args.quick else 5, warm=warm)
            results[f"pss_per_session_{name}"] = memory
            print(
                f"pss_per_session ({name}): {memory['pool_per_session_mb']:.1f} MB with a shared gateway, "
                f"{memory['today_per_session_mb']:.1f} MB today (own gateway each); "
                + ", ".join(
                    f"{key} {value:.0f} MB" for key, value in memory.items() if not key.endswith("_mb")
                )
            )
        if "mcp_first_result" in only:
            pooled = await mcp_first_result(2, 3 if args.quick else 8)
            cold = await mcp_first_result(None, 3 if args.quick else 4)
            results["mcp_first_result"] = {
                "pool_ms": statistics.median(pooled) * 1000,
                "today_ms": statistics.median(cold) * 1000,
                "runs": len(pooled),
            }
            print(
                f"mcp_first_result (HTTP, unsandboxed): new session to its first cell's result "
                f"{statistics.median(pooled) * 1000:.0f} ms median with --pool 2 ({len(pooled)} sessions), "
                f"{statistics.median(cold) * 1000:.0f} ms today ({len(cold)} sessions)"
            )
        for sandbox in modes if "pool_idle" in only else []:
            name = "sandboxed" if sandbox else "unsandboxed"
            idle = await pool_idle(
                sandbox, size=2 if args.quick else 4, seconds=10 if args.quick else 60, work=work
            )
            results[f"pool_idle_{name}"] = idle
            print(
                f"pool_idle ({name}): {idle['size']} ready kernels, {idle['cpu_seconds']:.2f} CPU s in "
                f"{idle['seconds']:.0f} s ({idle['cpu_percent']:.2f} % of a core), {idle['pss_mb']:.0f} MB PSS"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
