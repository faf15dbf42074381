"""Sandboxed beside unsandboxed, in one run: what ``sandbox=True`` costs.

Usage: ``uv run python benchmarks/sandbox.py [--rounds N]``. Each figure is measured on both
sides in turn (unsandboxed, sandboxed, unsandboxed, ...), so load on the machine hits both
alike; medians are reported with the ratio and the target:

- ``start``: ``CodeExecutor`` start to the first result (target: at most unsandboxed + 1 s);
- ``execute``: a trivial ``execute("x = 1")`` (target: at most 1.2 x);
- ``tool_call``: one generated tool call in a loop inside the kernel, auto-approved (1.5 x);
- ``reset``: ``reset()`` to the next result (1.5 x);
- ``memory``: PSS of the whole process tree when idle (no target: each sandboxed kernel, the
  spare one too, brings its own srt process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from ipybox import CodeExecutor, generate_mcp_sources

ROOT = Path(__file__).resolve().parents[1]
SERVER = {"command": sys.executable, "args": [str(ROOT / "benchmarks" / "servers" / "bench_server.py")]}
TOOL_LOOP = """
import time
from mcptools.bench import echo
echo.run(echo.Params(text="warm"))
times = []
for _ in range({n}):
    t = time.perf_counter()
    echo.run(echo.Params(text="x"))
    times.append(time.perf_counter() - t)
times.sort()
print(times[len(times) // 2])
"""


async def start_time(sandbox: bool, workdir: Path) -> tuple[float, CodeExecutor]:
    begin = time.perf_counter()
    executor = CodeExecutor(sandbox=sandbox, working_dir=workdir, approve_tool_calls=False)
    await executor.start()
    await executor.execute("x = 1")
    return time.perf_counter() - begin, executor


async def execute_time(executor: CodeExecutor, n: int) -> float:
    times = []
    for _ in range(n):
        begin = time.perf_counter()
        await executor.execute("x = 1")
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


async def tool_call_time(executor: CodeExecutor, n: int) -> float:
    return float((await executor.execute(TOOL_LOOP.format(n=n), timeout=300)).text or "nan")


def tree_memory() -> float:
    """PSS of this process and all its descendants, in bytes."""
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_full_info().pss
    return float(total)


async def reset_time(executor: CodeExecutor) -> float:
    # The executor keeps a spare kernel started in the background: give it time to be ready,
    # as an application between two tasks would.
    await asyncio.sleep(2)
    begin = time.perf_counter()
    await executor.reset()
    await executor.execute("x = 1")
    return time.perf_counter() - begin


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="starts and resets per side")
    parser.add_argument("--executions", type=int, default=200, help="trivial executions per side and round")
    parser.add_argument("--calls", type=int, default=200, help="tool calls per side and round")
    args = parser.parse_args()

    figures: dict[str, dict[bool, list[float]]] = {
        name: {False: [], True: []} for name in ("start", "execute", "tool_call", "reset", "memory")
    }
    with tempfile.TemporaryDirectory(prefix="ipybox-bench-sandbox-") as folder:
        workdir = Path(folder)
        os.environ.setdefault("IPYBOX_STATE_DIR", str(workdir / "state"))
        await generate_mcp_sources("bench", SERVER, workdir / "mcptools")
        for _ in range(args.rounds):
            for sandbox in (False, True):
                elapsed, executor = await start_time(sandbox, workdir)
                figures["start"][sandbox].append(elapsed)
                try:
                    figures["execute"][sandbox].append(await execute_time(executor, args.executions))
                    figures["tool_call"][sandbox].append(await tool_call_time(executor, args.calls))
                    figures["reset"][sandbox].append(await reset_time(executor))
                    await asyncio.sleep(2)  # the spare kernel is up: the tree is complete and idle
                    figures["memory"][sandbox].append(tree_memory())
                finally:
                    await executor.stop()

    targets = {"start": ("+", 1.0), "execute": ("x", 1.2), "tool_call": ("x", 1.5), "reset": ("x", 1.5)}
    memory = figures.pop("memory")
    print(f"{'figure':<10} {'unsandboxed':>12} {'sandboxed':>12} {'ratio':>7}   target")
    failed = False
    for name, sides in figures.items():
        plain, boxed = statistics.median(sides[False]), statistics.median(sides[True])
        kind, limit = targets[name]
        ok = boxed - plain <= limit if kind == "+" else boxed / plain <= limit
        failed |= not ok
        target = f"<= unsandboxed + {limit:g} s" if kind == "+" else f"<= {limit:g} x"
        print(
            f"{name:<10} {_fmt(plain):>12} {_fmt(boxed):>12} {boxed / plain:>6.2f}x   {target}"
            f"  ({'met' if ok else 'MISSED'}; sandboxed - unsandboxed = {_fmt(boxed - plain)})"
        )
    plain, boxed = statistics.median(memory[False]), statistics.median(memory[True])
    print(
        f"{'memory':<10} {plain / 2**20:>9.0f} MB {boxed / 2**20:>9.0f} MB {boxed / plain:>6.2f}x   (no target)"
    )
    return 1 if failed else 0


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
