"""Soak: one `CodeExecutor` running an agent-like mix for a while, with its resources watched.

The mix, drawn at random with fixed weights: cells that define and reuse state, cells that
print a lot, plots, cells that raise, cells that time out, loops of auto-approved tool calls
(`execute()`), tool calls approved one by one through `stream()`, and now and then a reset.
Every outcome is checked (a wrong answer or an unexpected error fails the run at once).

Every few seconds the script samples the whole process tree (this process, the gateway,
kernels, MCP servers): memory (PSS), open file descriptors and the number of processes.
After a warm-up it fits a line through memory and descriptors over time (samples with the
usual number of processes) and fails if either grows faster than its limit by more than a
healthy tree swings (the allowances); at the end it fails if any process of the tree is
left over after `stop()`. It prints a summary, and optionally writes every sample and
per-minute latency percentiles as JSON and memory over time as a PNG plot.

Usage (from the repository root):
    uv run python benchmarks/soak.py --duration 120              # the short run CI makes
    uv run python benchmarks/soak.py --duration 3600 --json benchmarks/soak-1h.json \\
        --plot benchmarks/soak-1h.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ipybox import (
    ApprovalRequest,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)

HERE = Path(__file__).resolve().parent
BENCH_SERVER = HERE / "servers" / "bench_server.py"
MB = 1024 * 1024


@dataclass
class Tally:
    """What the run did and how long each kind of step took."""

    executions: int = 0
    tool_calls: int = 0
    resets: int = 0
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # minute -> kind -> latencies in ms
    latencies: dict[int, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )


@dataclass(frozen=True)
class Sample:
    seconds: float
    pss_mb: float
    fds: int
    processes: int


def tree_sample(start: float) -> Sample:
    """Memory, descriptors and process count of this process and all its descendants."""
    me = psutil.Process()
    pss = fds = count = 0
    for process in [me, *me.children(recursive=True)]:
        try:
            pss += process.memory_full_info().pss
            fds += process.num_fds()
            count += 1
        except psutil.Error:
            continue  # it ended while we looked
    return Sample(time.monotonic() - start, pss / MB, fds, count)


def slope_per_minute(samples: list[Sample], value: Callable[[Sample], float], windows: int = 8) -> float:
    """Slope per minute of the floor of `value`: the least-squares line through each window's minimum.

    A reset swaps kernels and boots a spare, so memory jumps up and down by a kernel's size;
    a leak shows as a rising floor, which the window minima follow and the jumps do not move.
    """
    if len(samples) < 2 * windows:
        windows = max(2, len(samples) // 2)
    size = max(1, len(samples) // windows)
    floors = [min(samples[i : i + size], key=value) for i in range(0, len(samples) - size + 1, size)]
    if len(floors) < 2:
        return 0.0
    return statistics.linear_regression([s.seconds / 60 for s in floors], [value(s) for s in floors]).slope


def floor_growth(samples: list[Sample], value: Callable[[Sample], float]) -> float:
    """How far the floor of `value` rose: the last quarter's minimum less the first quarter's.

    What a leak adds up to, measured rather than extrapolated: a line fitted through a few window
    minima of a short run swings with the level a tree sits at for a while (a spare kernel, a kept
    connection), even when it ends lower than it began.
    """
    if len(samples) < 4:
        return 0.0
    quarter = len(samples) // 4
    return min(map(value, samples[-quarter:])) - min(map(value, samples[:quarter]))


class Mix:
    """The steps of the agent mix; each checks its own outcome."""

    def __init__(self, executor: CodeExecutor, tally: Tally, rng: random.Random) -> None:
        self.ex = executor
        self.tally = tally
        self.rng = rng
        self.counter = 0

    async def state(self) -> None:
        self.counter += 1
        n = self.counter
        await self.ex.execute(f"soak_{n % 50} = {n}\nsoak_total = globals().get('soak_total', 0) + {n}")
        result = await self.ex.execute(f"print(soak_{n % 50})")
        assert result.text == str(n), result
        self.tally.executions += 2

    async def print_a_lot(self) -> None:
        result = await self.ex.execute("for i in range(2000):\n    print('line', i, 'x' * 60)")
        assert result.text is not None and result.text.count("\n") == 1999
        self.tally.executions += 1

    async def plot(self) -> None:
        code = (
            "import matplotlib.pyplot as plt\nplt.figure(figsize=(3, 2))\n"
            "plt.plot(range(50), [i * i for i in range(50)])\nplt.show()"
        )
        result = await self.ex.execute(code)
        assert len(result.images) == 1, result
        result.images[0].unlink()  # the soak watches memory, not the disk
        self.tally.executions += 1

    async def raise_(self) -> None:
        try:
            await self.ex.execute("raise ValueError('soak error')")
        except CodeExecutionError as exc:
            assert exc.ename == "ValueError"
        else:
            raise AssertionError("the cell did not raise")
        self.tally.executions += 1

    async def time_out(self) -> None:
        try:
            await self.ex.execute("import time\ntime.sleep(10)", timeout=0.3)
        except TimeoutError:
            pass
        else:
            raise AssertionError("the cell did not time out")
        self.tally.executions += 1

    async def tool_loop(self) -> None:
        calls = 20
        code = (
            "from mcptools.bench import echo\n"
            f"print(sum(len(echo.run(echo.Params(text='x' * i))) for i in range({calls})))"
        )
        result = await self.ex.execute(code)
        assert result.text == str(sum(range(calls))), result
        self.tally.executions += 1
        self.tally.tool_calls += calls

    async def approved_tools(self) -> None:
        calls = 5
        code = f"from mcptools.bench import echo\nprint([echo.run(echo.Params(text=str(i))) for i in range({calls})])"
        seen = 0
        result: CodeExecutionResult | None = None
        async for item in self.ex.stream(code):
            if isinstance(item, ApprovalRequest):
                seen += 1
                await item.accept()
            elif isinstance(item, CodeExecutionResult):
                result = item
        assert seen == calls and result is not None and result.text == str([str(i) for i in range(calls)])
        self.tally.executions += 1
        self.tally.tool_calls += calls

    async def reset(self) -> None:
        await self.ex.reset()
        result = await self.ex.execute("print(globals().get('soak_total'))")
        assert result.text == "None", result
        self.tally.resets += 1
        self.tally.executions += 1

    def steps(self) -> list[tuple[str, Callable[[], Awaitable[None]], int]]:
        return [
            ("state", self.state, 30),
            ("print", self.print_a_lot, 5),
            ("plot", self.plot, 3),
            ("raise", self.raise_, 5),
            ("timeout", self.time_out, 1),
            ("tool_loop", self.tool_loop, 25),
            ("approved_tools", self.approved_tools, 10),
            ("reset", self.reset, 1),
        ]


async def soak(duration: float, sample_every: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tally = Tally()
    samples: list[Sample] = []
    workdir = Path(tempfile.mkdtemp(prefix="ipybox-soak-"))
    os.environ["IPYBOX_STATE_DIR"] = str(workdir / "state")
    os.chdir(workdir)
    await generate_mcp_sources(
        "bench", {"command": sys.executable, "args": [str(BENCH_SERVER)]}, workdir / "mcptools"
    )
    start = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    async with CodeExecutor(images_dir=workdir / "images") as executor:
        mix = Mix(executor, tally, rng)
        steps = mix.steps()
        names, actions, weights = zip(*steps, strict=True)
        next_sample = 0.0
        while (now := time.monotonic() - start) < duration:
            if now >= next_sample:
                samples.append(tree_sample(start))
                next_sample = now + sample_every
            index = rng.choices(range(len(actions)), weights=weights)[0]
            began = time.perf_counter()
            await actions[index]()
            elapsed = (time.perf_counter() - began) * 1000
            tally.counts[names[index]] += 1
            tally.latencies[int(now // 60)][names[index]].append(elapsed)
        samples.append(tree_sample(start))
    leftover = [
        f"{p.pid} {' '.join(p.cmdline())[:120]}"
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    return {"tally": tally, "samples": samples, "leftover": leftover, "seconds": time.monotonic() - start}


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def plot(samples: list[Sample], warmup: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.seconds / 60 for s in samples]
    fig, (mem, fds) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    mem.plot(minutes, [s.pss_mb for s in samples], color="tab:blue")
    mem.set_ylabel("PSS of the process tree (MB)")
    mem.axvline(warmup / 60, color="grey", linestyle=":", label="end of warm-up")
    mem.legend(loc="lower right")
    fds.plot(minutes, [s.fds for s in samples], color="tab:orange")
    fds.set_ylabel("open file descriptors")
    fds.set_xlabel("minutes")
    fig.suptitle("ipybox soak: one CodeExecutor under an agent mix")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120, help="seconds to run (default 120)")
    parser.add_argument("--sample-every", type=float, default=5, help="seconds between resource samples")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds before slopes count (default: a quarter)"
    )
    parser.add_argument(
        "--max-memory-slope", type=float, default=2.0, help="MB per minute allowed after warm-up"
    )
    parser.add_argument(
        "--max-fd-slope", type=float, default=1.0, help="descriptors per minute allowed after warm-up"
    )
    parser.add_argument(
        "--memory-allowance", type=float, default=64, help="MB of growth that counts as noise (default 64)"
    )
    parser.add_argument(
        "--fd-allowance",
        type=float,
        default=24,
        help="descriptors of growth that count as noise (default 24)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write samples and per-minute latencies here")
    parser.add_argument("--plot", type=Path, help="write a PNG of memory and descriptors over time here")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else args.duration / 4

    outcome = asyncio.run(soak(args.duration, args.sample_every, args.seed))
    tally: Tally = outcome["tally"]
    samples: list[Sample] = outcome["samples"]
    steady = [s for s in samples if s.seconds >= warmup]
    # Each process of the tree holds dozens of descriptors and tens of MB, and a reset or an
    # MCP server's restart changes the count for a moment: a window floor caught then is one
    # process short, a jump bigger than a short run's allowance. Memory and descriptors are
    # compared across samples of the usual number of processes, where a leak still shows and
    # those jumps do not.
    usual = statistics.mode(s.processes for s in steady) if steady else 0
    usual_samples = [s for s in steady if s.processes == usual]
    memory_slope = slope_per_minute(usual_samples, lambda s: s.pss_mb)
    fd_slope = slope_per_minute(usual_samples, lambda s: s.fds)
    minutes = {
        minute: {kind: percentiles(values) for kind, values in kinds.items()}
        for minute, kinds in sorted(tally.latencies.items())
    }

    print(f"soak: {outcome['seconds']:.0f} s, {tally.executions} executions, {tally.tool_calls} tool calls, "
          f"{tally.resets} resets; steps {dict(tally.counts)}")  # fmt: skip
    first, last = steady[0] if steady else samples[0], samples[-1]
    print(f"memory (PSS of the tree): {first.pss_mb:.0f} MB after warm-up, {last.pss_mb:.0f} MB at the end, "
          f"max {max(s.pss_mb for s in samples):.0f} MB; slope {memory_slope:+.2f} MB/min "
          f"(limit {args.max_memory_slope})")  # fmt: skip
    print(f"file descriptors: {first.fds} -> {last.fds}; slope {fd_slope:+.2f}/min (limit {args.max_fd_slope}), "
          f"floor {floor_growth(usual_samples, lambda s: s.fds):+.0f}; processes {first.processes} -> {last.processes}")  # fmt: skip
    overall: dict[str, list[float]] = defaultdict(list)
    for kinds in tally.latencies.values():
        for kind, values in kinds.items():
            overall[kind].extend(values)
    for kind, values in sorted(overall.items()):
        p = percentiles(values)
        print(
            f"  {kind:15} n={p['n']:6}  p50 {p['p50']:8.1f} ms  p90 {p['p90']:8.1f} ms  p99 {p['p99']:8.1f} ms"
        )

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "seconds": outcome["seconds"],
                    "executions": tally.executions,
                    "tool_calls": tally.tool_calls,
                    "resets": tally.resets,
                    "steps": dict(tally.counts),
                    "memory_slope_mb_per_min": memory_slope,
                    "fd_slope_per_min": fd_slope,
                    "warmup_s": warmup,
                    "samples": [s.__dict__ for s in samples],
                    "latency_per_minute_ms": minutes,
                    "leftover_processes": outcome["leftover"],
                },
                indent=1,
            )
        )
    if args.plot:
        plot(samples, warmup, args.plot)

    # A slope only counts when the floor has risen by more than the ups and downs of a healthy
    # tree (a spare kernel, an MCP server coming and going, a kept connection): in a 2-minute run
    # a few descriptors' swing is a steep slope, in an hour it is nothing.
    memory_growth = floor_growth(usual_samples, lambda s: s.pss_mb)
    fd_growth = floor_growth(usual_samples, lambda s: s.fds)
    failures = []
    if memory_slope > args.max_memory_slope and memory_growth > args.memory_allowance:
        failures.append(
            f"memory grows {memory_slope:.2f} MB/min after warm-up (limit {args.max_memory_slope}), its floor "
            f"{memory_growth:.0f} MB in all (allowance {args.memory_allowance})"
        )
    if fd_slope > args.max_fd_slope and fd_growth > args.fd_allowance:
        failures.append(
            f"file descriptors grow {fd_slope:.2f}/min after warm-up (limit {args.max_fd_slope}), their floor "
            f"{fd_growth:.0f} in all (allowance {args.fd_allowance})"
        )
    if outcome["leftover"]:
        failures.append("processes left after stop(): " + "; ".join(outcome["leftover"]))
    for failure in failures:
        print(f"SOAK FAILED: {failure}", file=sys.stderr)
    if not failures:
        print("soak passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
