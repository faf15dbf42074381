"""The ipybox MCP server beside the reference's (ipybox 0.7.1), through the same MCP client.

Figures, each for both servers over stdio, driven by the project's MCP SDK client:
- ``mcp_execute``: one ``execute_ipython_cell(code="x = 1")`` round trip, median of many; both
  servers are open at once and called in turn, so load changes hit both alike;
- ``mcp_start``: spawning the server to the first ``execute_ipython_cell`` result (runs alternate
  between the sides).
And for ours over streamable HTTP (the reference has no HTTP mode): the memory (PSS) of the
server's process tree with 1, 5 and 20 open sessions, each having run one cell.

The reference server runs from the environment ``benchmarks/setup_reference.sh`` makes
(``.bench/ref``), as its users configure it: ``python -m ipybox.mcp_server --workspace DIR``.

Usage (from the repository root):
    bash benchmarks/setup_reference.sh
    uv run python benchmarks/mcp_server.py [--quick] [--side ours|reference] [--no-memory] [--json PATH]
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
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

REPO = Path(__file__).resolve().parents[1]
SIDES = {"reference": REPO / ".bench" / "ref" / "bin" / "python", "ours": REPO / ".venv" / "bin" / "python"}
MODULE = {"reference": "ipybox.mcp_server", "ours": "ipybox"}
TARGETS = {"mcp_execute": 0.2, "mcp_start": 0.4}


def _params(side: str, workspace: Path) -> StdioServerParameters:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(SIDES[side].parent), env.get("PATH", "")])
    env["IPYBOX_STATE_DIR"] = str(workspace / ".state")
    args = ["-m", MODULE[side], "--workspace", str(workspace), "--log-level", "ERROR"]
    return StdioServerParameters(command=str(SIDES[side]), args=args, env=env, cwd=str(workspace))


def _text(result: Any) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


async def measure_start(side: str) -> float:
    """Seconds from spawning the server to the first result."""
    with tempfile.TemporaryDirectory(prefix=f"ipybox-bench-{side}-") as folder:
        started = time.perf_counter()
        async with Client(_params(side, Path(folder))) as client:
            first = await client.call_tool("execute_ipython_cell", {"code": "x = 1"})
            elapsed = time.perf_counter() - started
            if first.is_error:
                raise RuntimeError(f"{side}: {_text(first)}")
    return elapsed


async def measure_execute(sides: list[str], calls: int) -> dict[str, list[float]]:
    """Round trips of both servers, open side by side and called in turn, so that a change in
    the machine's load between the two measurements cannot skew their ratio."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for side in sides:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"ipybox-bench-{side}-"))
            clients[side] = await stack.enter_async_context(Client(_params(side, Path(folder))))
        for round_ in range(10 + calls):  # 10 warm-up rounds
            for side, client in clients.items():
                began = time.perf_counter()
                result = await client.call_tool("execute_ipython_cell", {"code": "x = 1"})
                if round_ >= 10:
                    times[side].append(time.perf_counter() - began)
                if result.is_error:
                    raise RuntimeError(f"{side}: {_text(result)}")
    return times


async def measure_sides(sides: list[str], runs: int, calls: int) -> dict[str, Any]:
    starts: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(runs):
        for side in sides:
            starts[side].append(await measure_start(side))
    times = await measure_execute(sides, calls)
    return {
        side: {
            "mcp_execute": {"median": statistics.median(times[side]), "p90": _p90(times[side]), "n": calls},
            "mcp_start": {"median": statistics.median(starts[side]), "min": min(starts[side]), "n": runs},
        }
        for side in sides
    }


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


def _tree_pss(pid: int) -> float:
    total = 0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            info = process.memory_full_info()
            total += getattr(info, "pss", info.rss)
    return total / (1024 * 1024)


@contextlib.asynccontextmanager
async def _session(url: str, token: str) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30, read=300)
        ) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


async def measure_http_memory(counts: list[int]) -> dict[str, float]:
    token = "bench-token"
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ipybox-bench-http-") as folder:
        workspace = Path(folder)
        log = workspace / "server.log"
        env = {**os.environ, "IPYBOX_MCP_TOKEN": token, "IPYBOX_STATE_DIR": str(workspace / ".state")}
        command = [str(SIDES["ours"]), "-m", "ipybox", "--workspace", str(workspace)]
        command += ["--transport", "streamable-http", "--port", "0", "--log-level", "ERROR"]
        with log.open("wb") as sink:
            process = subprocess.Popen(  # noqa: ASYNC220 - started once, outside the timed part
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=sink, env=env
            )
        try:
            url = ""
            deadline = time.monotonic() + 60
            while not url and time.monotonic() < deadline:
                if match := re.search(r"listening on (http://\S+)", log.read_text()):
                    url = match.group(1)
                await asyncio.sleep(0.05)
            results["idle"] = _tree_pss(process.pid)
            async with contextlib.AsyncExitStack() as stack:
                opened: list[Client] = []
                for count in counts:
                    while len(opened) < count:
                        client = await stack.enter_async_context(_session(url, token))
                        await client.call_tool("execute_ipython_cell", {"code": "x = 1"})
                        opened.append(client)
                    await asyncio.sleep(1)  # idle, as in the memory figure of benchmarks/run.py
                    results[f"{count} sessions"] = _tree_pss(process.pid)
        finally:
            process.terminate()
            process.wait(timeout=60)
            if os.environ.get("BENCH_DEBUG"):
                print(log.read_text(), file=sys.stderr)
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--side", choices=list(SIDES), help="measure one side only")
    parser.add_argument("--no-memory", action="store_true", help="skip the HTTP memory figure")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args()
    runs, calls = (2, 50) if args.quick else (5, 300)
    sides = [args.side] if args.side else list(SIDES)
    for side in sides:
        if not SIDES[side].exists():
            print(f"{side}: {SIDES[side]} is missing (run benchmarks/setup_reference.sh)", file=sys.stderr)
    results: dict[str, Any] = await measure_sides([s for s in sides if SIDES[s].exists()], runs, calls)
    print(
        f"{'figure':<12} | {'reference 0.7.1':>15} | {'ipybox (ours)':>13} | {'ratio':>6} | {'target':>7} | met?"
    )
    for figure, target in TARGETS.items():
        ref = results.get("reference", {}).get(figure, {}).get("median")
        ours = results.get("ours", {}).get(figure, {}).get("median")
        cells = [_fmt(ref), _fmt(ours)]
        ratio = ours / ref if ref and ours else None
        met = "yes" if ratio is not None and ratio <= target else ("no" if ratio is not None else "-")
        ratio_text = f"{ratio:.2f}x" if ratio is not None else "n/a"
        print(f"{figure:<12} | {cells[0]:>15} | {cells[1]:>13} | {ratio_text:>6} | <= {target}x | {met}")
    if not args.no_memory and "ours" in sides:
        memory = await measure_http_memory([1, 5] if args.quick else [1, 5, 20])
        results["http_memory_mb"] = memory
        base = memory.get("1 sessions", 0.0)
        for label, value in memory.items():
            if label == "idle":
                print(f"http memory (PSS), idle with the first session's executor started: {value:.0f} MB")
                continue
            sessions = int(label.split()[0])
            extra = f", {(value - base) / (sessions - 1):.0f} MB per added session" if sessions > 1 else ""
            print(f"http memory (PSS), {label}: {value:.0f} MB{extra}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    asyncio.run(main())
