"""Soak: one `CodeExecutor` running an agent-like mix for a while, with its resources watched.

The mix, drawn at random with fixed weights: cells that define and reuse state, cells that
print a lot, plots, cells that raise, cells that time out, loops of auto-approved tool calls
(`execute()`), tool calls approved one by one through `stream()`, and now and then a reset.
Every outcome is checked (a wrong answer or an unexpected error fails the run at once).

Leaks are judged at checkpoints where the process tree is in the same state each time: every
`--cycle-steps` steps (or `--cycle-seconds`, whichever comes first) the executor is reset and left to settle (the old kernel shut down, the
spare kernel ready, no MCP server running: each waited for, never slept for), then the whole
tree (this process, the gateway, kernels) is sampled: memory (PSS), open file descriptors,
processes. Between checkpoints the tree swings with what the mix does (a spare kernel booting,
a kept connection, an MCP server coming and going), and a verdict drawn there follows that
noise. After the warm-up checkpoints the script takes the robust slope per cycle of memory and
of descriptors (Theil-Sen: the median of the slopes between every two checkpoints) and fails if
either is above its bound; the bounds come from the spread measured over healthy runs
(`benchmarks/soak-spread.txt`). At the end it fails if any process of the tree is left over
after `stop()`. `--plant-leak` leaks a descriptor and/or memory per cycle on purpose, to show
that the check catches one.

Every `--sample-every` seconds the tree is also sampled between checkpoints, for the JSON and
the plot (the hour-long figures), not for the verdict.

Usage (from the repository root):
    uv run python benchmarks/soak.py --duration 120              # the short run CI makes
    uv run python benchmarks/soak.py --duration 120 --plant-leak fd   # must fail
    uv run python benchmarks/soak.py --duration 3600 --json benchmarks/soak-1h.json \\
        --plot benchmarks/soak-1h.png
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
# Bounds of the slopes per cycle at the checkpoints, set from the spread measured over healthy runs
# (benchmarks/soak-spread.txt): well above the largest a healthy tree showed, well below a leak of
# one descriptor or a few MB per cycle.
MAX_FD_SLOPE = 0.5
MAX_MEMORY_SLOPE = 1.0
MIN_JUDGED = 8
"""Checkpoints judged at the least: a run goes on past its duration until it has taken them."""


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


def slope_per_cycle(values: list[float]) -> float:
    """The Theil-Sen slope of `values` (one per checkpoint): the median of the slopes between every
    two of them. One checkpoint caught at an odd level (a connection kept a moment longer) moves it
    little, where it tilts a least-squares line; a leak moves every pair the same way."""
    slopes = [
        (values[j] - values[i]) / (j - i) for i in range(len(values)) for j in range(i + 1, len(values))
    ]
    return statistics.median(slopes) if slopes else 0.0


async def settle(executor: CodeExecutor) -> None:
    """Wait until the executor is idle in the same state as at every checkpoint: the replaced kernel
    shut down (the gateway answers its deletion once the process has ended) and the spare kernel up."""
    # private: the soak waits on the executor's own tasks, which the public API does not expose
    kernels = executor._kernels
    assert kernels is not None
    client = kernels.client
    supply = client._supply
    pending = {*([client._spare] if client._spare is not None else []), *(supply._closing if supply else ())}
    if pending:
        await asyncio.wait(pending)
    gc.collect()


class Leak:
    """What `--plant-leak` keeps: one descriptor and/or `megabytes` of memory more per cycle."""

    def __init__(self, kind: str, megabytes: float) -> None:
        self.kind = kind
        self.size = int(megabytes * MB)
        self.kept: list[int | bytes] = []

    def cycle(self) -> None:
        if self.kind in ("fd", "both"):
            self.kept.append(os.open(os.devnull, os.O_RDONLY))
        if self.kind in ("memory", "both"):
            self.kept.append(os.urandom(self.size))  # written, so it counts in PSS

    def close(self) -> None:
        for item in self.kept:
            if isinstance(item, int):
                os.close(item)
        self.kept.clear()


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


async def soak(
    duration: float,
    sample_every: float,
    seed: int,
    cycle: tuple[int, float],
    least_checkpoints: int,
    leak: Leak,
) -> dict[str, Any]:
    """Run the mix for `duration` seconds, and on until `least_checkpoints` were taken; a cycle
    ends after `cycle` = (steps, seconds), whichever comes first."""
    cycle_steps, cycle_seconds = cycle
    rng = random.Random(seed)
    tally = Tally()
    samples: list[Sample] = []
    checkpoints: list[Sample] = []
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
        steps_done = 0
        cycle_began = 0.0
        while (now := time.monotonic() - start) < duration or len(checkpoints) < least_checkpoints:
            if now >= next_sample:
                samples.append(tree_sample(start))
                next_sample = now + sample_every
            index = rng.choices(range(len(actions)), weights=weights)[0]
            began = time.perf_counter()
            await actions[index]()
            elapsed = (time.perf_counter() - began) * 1000
            tally.counts[names[index]] += 1
            tally.latencies[int(now // 60)][names[index]].append(elapsed)
            steps_done += 1
            # A loaded machine makes steps slow: the seconds keep the number of checkpoints up.
            if steps_done >= cycle_steps or time.monotonic() - start - cycle_began >= cycle_seconds:
                await mix.reset()
                leak.cycle()
                await settle(executor)
                checkpoints.append(tree_sample(start))
                steps_done, cycle_began = 0, time.monotonic() - start
        samples.append(tree_sample(start))
    leak.close()
    leftover = [
        f"{p.pid} {' '.join(p.cmdline())[:120]}"
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    return {
        "tally": tally,
        "samples": samples,
        "checkpoints": checkpoints,
        "leftover": leftover,
        "seconds": time.monotonic() - start,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def plot(samples: list[Sample], checkpoints: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, fds) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for axis, value, label in (
        (mem, lambda s: s.pss_mb, "PSS of the process tree (MB)"),
        (fds, lambda s: s.fds, "open file descriptors"),
    ):
        axis.plot(
            [s.seconds / 60 for s in samples], [value(s) for s in samples], color="tab:blue", label="samples"
        )
        axis.plot(
            [s.seconds / 60 for s in checkpoints],
            [value(s) for s in checkpoints],
            "o",
            markersize=3,
            color="tab:orange",
            label="checkpoints (settled)",
        )
        axis.set_ylabel(label)
    mem.legend(loc="lower right")
    fds.set_xlabel("minutes")
    fig.suptitle("ipybox soak: one CodeExecutor under an agent mix")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120, help="seconds to run (default 120)")
    parser.add_argument(
        "--sample-every", type=float, default=5, help="seconds between samples for the JSON and plot"
    )
    parser.add_argument(
        "--cycle-steps", type=int, default=20, help="mix steps between two checkpoints (default 20)"
    )
    parser.add_argument(
        "--cycle-seconds",
        type=float,
        default=None,
        help="seconds after which a cycle ends even with fewer steps (default: the duration / 25)",
    )
    parser.add_argument(
        "--warmup-cycles", type=int, default=3, help="checkpoints left out of the verdict (default 3)"
    )
    parser.add_argument(
        "--max-memory-slope",
        type=float,
        default=MAX_MEMORY_SLOPE,
        help=f"MB per cycle allowed (default {MAX_MEMORY_SLOPE}, from benchmarks/soak-spread.txt)",
    )
    parser.add_argument(
        "--max-fd-slope",
        type=float,
        default=MAX_FD_SLOPE,
        help=f"descriptors per cycle allowed (default {MAX_FD_SLOPE}, from benchmarks/soak-spread.txt)",
    )
    parser.add_argument(
        "--plant-leak",
        choices=["none", "fd", "memory", "both"],
        default="none",
        help="leak on purpose, per cycle: a descriptor, memory, or both (the check must then fail)",
    )
    parser.add_argument(
        "--leak-mb", type=float, default=4.0, help="MB that --plant-leak memory keeps per cycle (default 4)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write samples, checkpoints and per-minute latencies here")
    parser.add_argument("--plot", type=Path, help="write a PNG of memory and descriptors over time here")
    args = parser.parse_args()
    if args.cycle_steps < 1:
        parser.error("--cycle-steps must be at least 1")

    leak = Leak(args.plant_leak, args.leak_mb)
    cycle = (args.cycle_steps, args.cycle_seconds if args.cycle_seconds is not None else args.duration / 25)
    least = args.warmup_cycles + MIN_JUDGED
    outcome = asyncio.run(soak(args.duration, args.sample_every, args.seed, cycle, least, leak))
    tally: Tally = outcome["tally"]
    samples: list[Sample] = outcome["samples"]
    checkpoints: list[Sample] = outcome["checkpoints"]
    judged = checkpoints[args.warmup_cycles :]
    memory_slope = slope_per_cycle([s.pss_mb for s in judged])
    fd_slope = slope_per_cycle([s.fds for s in judged])
    minutes = {
        minute: {kind: percentiles(values) for kind, values in kinds.items()}
        for minute, kinds in sorted(tally.latencies.items())
    }

    print(f"soak: {outcome['seconds']:.0f} s, {tally.executions} executions, {tally.tool_calls} tool calls, "
          f"{tally.resets} resets; steps {dict(tally.counts)}"
          + (f"; planted leak: {args.plant_leak}" if args.plant_leak != "none" else ""))  # fmt: skip
    print(f"checkpoints: {len(checkpoints)} ({len(judged)} judged, after {args.warmup_cycles} of warm-up), "
          f"every {cycle[0]} steps or {cycle[1]:g} s")  # fmt: skip
    if judged:
        first, last = judged[0], judged[-1]
        print(f"memory (PSS of the tree) at checkpoints: {first.pss_mb:.0f} -> {last.pss_mb:.0f} MB "
              f"(min {min(s.pss_mb for s in judged):.0f}, max {max(s.pss_mb for s in judged):.0f}); "
              f"slope {memory_slope:+.3f} MB/cycle (bound {args.max_memory_slope})")  # fmt: skip
        print(f"file descriptors at checkpoints: {first.fds} -> {last.fds} "
              f"(min {min(s.fds for s in judged)}, max {max(s.fds for s in judged)}); "
              f"slope {fd_slope:+.3f}/cycle (bound {args.max_fd_slope}); "
              f"processes {first.processes} -> {last.processes}")  # fmt: skip
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
                    "cycle_steps": cycle[0],
                    "cycle_seconds": cycle[1],
                    "warmup_cycles": args.warmup_cycles,
                    "memory_slope_mb_per_cycle": memory_slope,
                    "fd_slope_per_cycle": fd_slope,
                    "planted_leak": args.plant_leak,
                    "checkpoints": [s.__dict__ for s in checkpoints],
                    "samples": [s.__dict__ for s in samples],
                    "latency_per_minute_ms": minutes,
                    "leftover_processes": outcome["leftover"],
                },
                indent=1,
            )
        )
    if args.plot:
        plot(samples, checkpoints, args.plot)

    failures = []
    if memory_slope > args.max_memory_slope:
        failures.append(
            f"memory grows {memory_slope:.3f} MB per cycle at the checkpoints (bound {args.max_memory_slope})"
        )
    if fd_slope > args.max_fd_slope:
        failures.append(
            f"file descriptors grow {fd_slope:.3f} per cycle at the checkpoints (bound {args.max_fd_slope})"
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
