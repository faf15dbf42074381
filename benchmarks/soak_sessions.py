"""Soak of the HTTP MCP server: many concurrent sessions on one kernel pool, watched for minutes.

It starts a real ``ipybox --transport streamable-http --pool N`` server (bearer token from
``IPYBOX_MCP_TOKEN``, ``--max-sessions`` set above the number of sessions) and opens the sessions
with the MCP SDK's streamable HTTP client, one HTTP client each as separate agents have, one
every ``--ramp`` seconds. Each session registers the demo MCP server (tests/servers/demo_server.py)
through the server's ``register_mcp_server`` tool, then loops until the run's end over three steps
drawn at random, sleeping ``--pause`` (default 0.5 to 1 s, uniform) between requests:

- ``set`` / ``get``: a cell sets ``soak_value`` (the same name in every session) to a value unique to
  the session and the step, the next cell prints it back; any other value is a cross-session leak;
- ``compute``: a small computation whose result is checked;
- ``tool``: a cell calls the demo server's ``echo`` tool with a session-unique text and prints the answer.

Every request's latency and outcome is recorded (an error result, an exception or a wrong answer is a
failure). Every ``--sample-every`` seconds the PSS of the server's process tree (``/proc/PID/smaps_rollup``
of the server and all its descendants) is sampled. At the end the sessions close, the server is
stopped (SIGTERM) and every process its tree had is checked to be gone.

It prints requests, failures, leaks, p50/p90/p99 latency per minute, memory at the end of warm-up
against the end, and processes left; it fails (exit 1) on any failure, leak or leftover process, or
when memory in the last minute is more than ``--memory-tolerance`` percent above the minute after
warm-up.

Usage (from the repository root):
    uv run --frozen python benchmarks/soak_sessions.py --duration 600 --sessions 50 \\
        --json benchmarks/soak-sessions-10m.json --plot benchmarks/soak-sessions-10m.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import psutil
from mcp.client import Client
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parents[1]
DEMO_SERVER = ROOT / "tests" / "servers" / "demo_server.py"
TOKEN = "soak-sessions-token-0123456789"
MB = 1024 * 1024


@dataclass(frozen=True)
class Request:
    seconds: float  # since the start of the run, when the request was sent
    session: int
    kind: str
    ms: float
    ok: bool


@dataclass
class Run:
    start: float = field(default_factory=time.monotonic)
    requests: list[Request] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # seconds, PSS MB, processes
    ready: list[float] = field(default_factory=list)  # when each session finished registering

    def now(self) -> float:
        return time.monotonic() - self.start


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sum_pss(processes: list[psutil.Process]) -> int:
    return sum(_pss(process.pid) for process in processes)


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def sampler(run: Run, pid: int, every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        processes = await asyncio.to_thread(tree, pid)
        pss = await asyncio.to_thread(sum_pss, processes)
        run.samples.append((run.now(), pss / MB, len(processes)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def timed(
    run: Run, session: int, kind: str, client: Client, tool: str, arguments: dict[str, Any]
) -> str | None:
    """Call `tool`; record the latency; the text of the result, or None (a failure, recorded)."""
    sent = run.now()
    began = time.perf_counter()
    try:
        result = await client.call_tool(tool, arguments)
    except Exception as exc:  # every failure counts, whatever its kind
        run.requests.append(Request(sent, session, kind, (time.perf_counter() - began) * 1000, False))
        run.failures.append(f"session {session} {kind} at {sent:.0f} s: {type(exc).__name__}: {exc}")
        return None
    ms = (time.perf_counter() - began) * 1000
    text = text_of(result)
    run.requests.append(Request(sent, session, kind, ms, not result.is_error))
    if result.is_error:
        run.failures.append(f"session {session} {kind} at {sent:.0f} s: error result: {text[:300]}")
        return None
    return text


class Session:
    """One agent: its own HTTP client and MCP session, its steps, each answer checked."""

    def __init__(self, run: Run, index: int, pause: tuple[float, float], seed: int) -> None:
        self.run = run
        self.index = index
        self.pause = pause
        self.rng = random.Random(seed * 1000 + index)
        self.step = 0

    async def cell(self, kind: str, client: Client, code: str) -> str | None:
        return await timed(self.run, self.index, kind, client, "execute_ipython_cell", {"code": code})

    def check(self, kind: str, expected: str, got: str | None, foreign: str) -> None:
        """A wrong answer is a leak when it has another session's mark (`foreign` is the pattern
        of any session's), a failure otherwise; a failed request was counted already."""
        if got is None or got == expected:
            return
        if re.fullmatch(foreign, got) and not got.startswith(expected.rsplit("-", 1)[0] + "-"):
            self.run.leaks.append(f"session {self.index} {kind}: got {got!r}, expected {expected!r}")
        else:
            self.run.failures.append(f"session {self.index} {kind}: expected {expected!r}, got {got[:200]!r}")

    async def state(self, client: Client) -> None:
        value = f"s{self.index}-{self.step}"
        if await self.cell("set", client, f"soak_value = {value!r}") is not None:
            await asyncio.sleep(self.rng.uniform(*self.pause))
            self.check("get", value, await self.cell("get", client, "print(soak_value)"), r"s\d+-\d+")

    async def compute(self, client: Client) -> None:
        n = self.rng.randint(1000, 20000)
        got = await self.cell("compute", client, f"print(sum(i * i for i in range({n})))")
        self.check("compute", str(sum(i * i for i in range(n))), got, r"$^")

    async def tool(self, client: Client) -> None:
        text = f"echo-{self.index}-{self.step}"
        code = f"from mcptools.demo import echo\nprint(echo.run(echo.Params(text={text!r})))"
        self.check("tool", text, await self.cell("tool", client, code), r"echo-\d+-\d+")

    async def loop(self, url: str, end: float) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        try:
            async with (
                httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(60, read=600)) as http,
                Client(streamable_http_client(url, http_client=http)) as client,
            ):
                demo = {
                    "server_name": "demo",
                    "server_params": {"command": sys.executable, "args": [str(DEMO_SERVER)]},
                }
                if await timed(self.run, self.index, "register", client, "register_mcp_server", demo) is None:
                    return
                self.run.ready.append(self.run.now())
                steps = (self.state, self.compute, self.tool)
                while self.run.now() < end:
                    self.step += 1
                    await self.rng.choice(steps)(client)
                    await asyncio.sleep(self.rng.uniform(*self.pause))
        except Exception as exc:  # a session that breaks is a failure; the others go on
            self.run.failures.append(f"session {self.index}: {type(exc).__name__}: {exc!r}"[:500])


def start_server(workspace: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    log = workspace.parent / "server.log"
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN, "IPYBOX_STATE_DIR": str(workspace.parent / "state")}
    command = [sys.executable, "-m", "ipybox", "--workspace", str(workspace)]
    command += ["--transport", "streamable-http", "--port", "0", "--log-level", "ERROR"]
    command += ["--pool", str(args.pool), "--max-sessions", str(args.max_sessions)]
    command += ["--sandbox"] if args.sandbox else []
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink, env=env
        )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if match := re.search(r"listening on (http://\S+)", log.read_text()):
            return process, match.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()}")


def stop_server(process: subprocess.Popen[bytes]) -> list[str]:
    """SIGTERM the server, wait for it, and list the processes of its tree still alive after 30 s."""
    members = tree(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

    def alive() -> list[psutil.Process]:
        left = []
        for member in members:
            with contextlib.suppress(psutil.Error):
                if member.is_running() and member.status() != psutil.STATUS_ZOMBIE:
                    left.append(member)
        return left

    deadline = time.monotonic() + 30
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for member in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{member.pid} {' '.join(member.cmdline())[:120]}")
    return described


async def soak(args: argparse.Namespace) -> tuple[Run, list[str], float]:
    folder = Path(tempfile.mkdtemp(prefix="ipybox-soak-sessions-"))
    workspace = folder / "workspace"
    workspace.mkdir()
    process, url = await asyncio.to_thread(start_server, workspace, args)
    run = Run()
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(run, process.pid, args.sample_every, stop))
    try:
        end = args.duration
        tasks = []
        for index in range(args.sessions):
            agent = Session(run, index, (args.pause_min, args.pause_max), args.seed)
            tasks.append(asyncio.create_task(agent.loop(url, end)))
            await asyncio.sleep(args.ramp)
        await asyncio.gather(*tasks)
        # The sessions are closed; one more sample of the idle server before it stops.
        await asyncio.sleep(args.sample_every)
    finally:
        stop.set()
        await sampling
        left = await asyncio.to_thread(stop_server, process)
    return run, left, run.now()


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def mean_pss(samples: list[tuple[float, float, int]], start: float, stop: float) -> float:
    window = [pss for seconds, pss, _ in samples if start <= seconds < stop]
    return statistics.fmean(window) if window else float("nan")


def plot(run: Run, warmup: float, end: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets: dict[int, list[float]] = defaultdict(list)
    for request in run.requests:
        buckets[int(request.seconds // 15)].append(request.ms)
    keys = sorted(buckets)
    x = [(k * 15 + 7.5) / 60 for k in keys]
    fig, (lat, mem) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for q, color in (("p50", "tab:green"), ("p90", "tab:orange"), ("p99", "tab:red")):
        lat.plot(x, [percentiles(buckets[k])[q] for k in keys], color=color, label=q)
    lat.set_yscale("log")
    lat.set_ylabel("request latency (ms), per 15 s")
    lat.legend(loc="upper right")
    mem.plot([s[0] / 60 for s in run.samples], [s[1] for s in run.samples], color="tab:blue")
    mem.set_ylabel("PSS of the server's tree (MB)")
    mem.set_xlabel("minutes")
    for axis in (lat, mem):
        axis.axvline(warmup / 60, color="grey", linestyle=":", label="end of warm-up")
        axis.axvline(end / 60, color="grey", linestyle="--", label="sessions close")
    mem.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=50, help="concurrent MCP sessions (default 50)")
    parser.add_argument(
        "--duration", type=float, default=600, help="seconds from the start to the end of the loops"
    )
    parser.add_argument("--pool", type=int, default=4, help="the server's --pool (default 4)")
    parser.add_argument(
        "--max-sessions", type=int, default=None, help="the server's --max-sessions (default sessions + 10)"
    )
    parser.add_argument("--sandbox", action="store_true", help="run the server with --sandbox")
    parser.add_argument(
        "--ramp", type=float, default=0.5, help="seconds between opening two sessions (default 0.5)"
    )
    parser.add_argument(
        "--pause-min", type=float, default=0.5, help="least pause between a session's requests (s)"
    )
    parser.add_argument(
        "--pause-max", type=float, default=1.0, help="longest pause between a session's requests (s)"
    )
    parser.add_argument("--sample-every", type=float, default=5, help="seconds between memory samples")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds of warm-up (default: all sessions ready + 60 s)"
    )
    parser.add_argument(
        "--memory-tolerance", type=float, default=5, help="percent memory may grow after warm-up"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write every request and sample here")
    parser.add_argument("--plot", type=Path, help="write a PNG of latency and memory over time here")
    args = parser.parse_args()
    if args.max_sessions is None:
        args.max_sessions = args.sessions + 10

    load_before = os.getloadavg()
    run, left, seconds = asyncio.run(soak(args))
    all_ready = max(run.ready) if run.ready else args.duration
    warmup = args.warmup if args.warmup is not None else min(all_ready + 60, args.duration - 120)
    end = args.duration
    at_warmup = mean_pss(run.samples, warmup, warmup + 60)
    at_end = mean_pss(run.samples, end - 60, end)
    growth = (at_end - at_warmup) / at_warmup * 100
    per_minute: dict[int, dict[str, float]] = {}
    minutes: dict[int, list[float]] = defaultdict(list)
    kinds: dict[str, list[float]] = defaultdict(list)
    for request in run.requests:
        minutes[int(request.seconds // 60)].append(request.ms)
        kinds[request.kind].append(request.ms)
    per_minute = {minute: percentiles(values) for minute, values in sorted(minutes.items())}
    sandbox = "sandboxed" if args.sandbox else "unsandboxed"

    lines = [
        f"soak_sessions: {args.sessions} {sandbox} HTTP MCP sessions, --pool {args.pool}, --max-sessions "
        f"{args.max_sessions}, loops until {args.duration:.0f} s, pause {args.pause_min}-{args.pause_max} s, "
        f"ramp {args.ramp} s; {seconds:.0f} s in all; load average before {load_before[0]:.2f}, "
        f"at the end {os.getloadavg()[0]:.2f} (2 cores)",
        f"sessions ready (registered the demo server): {len(run.ready)} of {args.sessions}, "
        f"the last at {all_ready:.0f} s; warm-up ends at {warmup:.0f} s",
        f"requests: {len(run.requests)}, failures: {len(run.failures)}, cross-session leaks: {len(run.leaks)}",
        "latency per minute (ms, all kinds):",
    ]
    for minute, p in per_minute.items():
        lines.append(
            f"  minute {minute:2}: n={p['n']:5}  p50 {p['p50']:7.1f}  p90 {p['p90']:7.1f}  p99 {p['p99']:7.1f}  max {p['max']:8.1f}"
        )
    lines.append("latency per kind (ms, whole run):")
    for kind, values in sorted(kinds.items()):
        p = percentiles(values)
        lines.append(
            f"  {kind:9} n={p['n']:5}  p50 {p['p50']:7.1f}  p90 {p['p90']:7.1f}  p99 {p['p99']:7.1f}  max {p['max']:8.1f}"
        )
    lines += [
        f"memory (PSS of the server's tree, mean over a minute): {at_warmup:.0f} MB after warm-up "
        f"({warmup:.0f}-{warmup + 60:.0f} s), {at_end:.0f} MB at the end ({end - 60:.0f}-{end:.0f} s): "
        f"{growth:+.1f} % (tolerance {args.memory_tolerance} %); max {max(s[1] for s in run.samples):.0f} MB; "
        f"processes {max(s[2] for s in run.samples)} at most",
        f"processes left after the server stopped: {len(left)}",
    ]
    print("\n".join(lines))

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "seconds": seconds,
                    "warmup_s": warmup,
                    "requests": len(run.requests),
                    "failures": run.failures,
                    "leaks": run.leaks,
                    "memory_after_warmup_mb": at_warmup,
                    "memory_at_end_mb": at_end,
                    "memory_growth_percent": growth,
                    "leftover_processes": left,
                    "latency_per_minute_ms": per_minute,
                    "latency_per_kind_ms": {kind: percentiles(values) for kind, values in kinds.items()},
                    "samples": [{"seconds": s, "pss_mb": m, "processes": n} for s, m, n in run.samples],
                    "request_log": [
                        [round(r.seconds, 3), r.session, r.kind, round(r.ms, 1), r.ok] for r in run.requests
                    ],
                },
                indent=1,
            )
        )
    if args.plot:
        title = f"ipybox soak: {args.sessions} {sandbox} HTTP MCP sessions on one pool (--pool {args.pool})"
        plot(run, warmup, end, title, args.plot)

    problems = [f"failed request: {f}" for f in run.failures[:20]] + [
        f"leak: {leak}" for leak in run.leaks[:20]
    ]
    if growth > args.memory_tolerance:
        problems.append(f"memory grew {growth:.1f} % after warm-up (tolerance {args.memory_tolerance} %)")
    problems += [f"left running: {item}" for item in left]
    for problem in problems:
        print(f"SOAK FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("soak_sessions passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
