"""Measure ipybox beside the reference package ipybox 0.7.1, figure by figure, in one run.

For each figure, `benchmarks/workload.py` runs once under the reference environment's
interpreter (`.bench/ref`, made by `benchmarks/setup_reference.sh`) and once under the
project's (`.venv`), one after the other on the same machine. The table shows both medians,
their ratio (ours / reference) and the target ratio (`FIGURES` below, benchmarks/README.md). A figure that
fails on one side shows `n/a` and the error's first line; the run goes on.

Usage (from the repository root, with the project's interpreter):
    uv run python benchmarks/run.py [--only execute,start] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "benchmarks" / "workload.py"
REF_VENV = REPO / ".bench" / "ref"
OUR_VENV = REPO / ".venv"
LOG_DIR = REPO / ".bench" / "logs"


@dataclass(frozen=True)
class Figure:
    name: str
    description: str
    target: float | None
    # A baseline without ipybox (target None) runs on the project's interpreter only.
    sides: tuple[str, ...] = ("reference", "ours")


FIGURES = [
    Figure("execute", 'KernelClient.execute("x = 1"), median', 0.1),
    Figure("kernel_floor", "baseline: ipykernel alone, busy to idle of that cell", None, ("ours",)),
    # The target: no slower than the reference (ratio <= 1).
    Figure("large_output", "KernelClient.execute of a cell printing 2 MiB, median of whole results", 1.0),
    Figure("large_output_lines", "the same 2 MiB printed a line at a time (16384 prints)", 1.0),
    Figure("start", "KernelGateway start to first result", 0.4),
    Figure("reset", "KernelClient.reset() to next result", 0.15),
    Figure("executor_start", "CodeExecutor start to first result", 0.4),
    Figure("executor_reset", "CodeExecutor.reset() to next result", 0.15),
    # The target is an absolute 0.2 s, against the reference's ~0.6 s.
    Figure("executor_stop", "CodeExecutor.stop() after a result", 0.35),
    Figure("first_plot", "first cell of a started CodeExecutor: import pyplot, plot, show()", 0.5),
    Figure("tool_call", "ToolRunner.run_sync, auto-approved", 0.3),
    Figure("approval_call", "ToolRunner.run_sync, approval round trip", 0.4),
    # An absolute target (<= 250 ms, under the table); one after the other the calls take over 2 s.
    Figure("concurrent_calls", "20 gathered ToolRunner.run of a 100 ms tool", None),
    # The agent's path: ours gathers `await arun(...)`, the reference has only the synchronous `run()`.
    Figure("kernel_concurrent", "20 calls of a 100 ms tool from kernel code, generated API", None),
    # Higher is better: shown beside the sequential figure, no ratio target.
    Figure("throughput", "echo calls/s: 200 gathered ToolRunner.run (sequential below)", None),
    Figure("mcp_floor", "baseline: the MCP SDK alone calling the same echo server", None, ("ours",)),
    # Paired with mcp_floor in one process; the approval figure is shown beside it.
    Figure(
        "tool_overhead", "ipybox's own cost per call: run_sync minus the SDK alone, paired", None, ("ours",)
    ),
    Figure("apigen", "generate_mcp_sources, 100 nested tools", 0.2),
    Figure("memory", "CodeExecutor process tree, idle (PSS)", 1.0),
]
BY_NAME = {figure.name: figure for figure in FIGURES}


@dataclass(frozen=True)
class Outcome:
    """What one workload run produced: a result, or the first line of its error."""

    result: dict[str, Any] | None
    error: str | None
    seconds: float


def side_env(venv: Path, state_dir: str, extra_path: Path | None) -> dict[str, str]:
    """The environment for one side: its own venv first on PATH, nothing of the other side's.

    The gateway and kernels of either package may look up executables on PATH, and `uv run`
    puts the project's venv there: each side gets exactly its own.
    """
    env = dict(os.environ)
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(REPO))]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *parts])
    env["VIRTUAL_ENV"] = str(venv)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    # generate_mcp_sources of this project records servers in a registry under this folder;
    # a throwaway one keeps the benchmark out of the user's state.
    env["IPYBOX_STATE_DIR"] = state_dir
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_workload(
    side: str, python: Path, venv: Path, figure: str, args: argparse.Namespace, extra_path: Path | None
) -> Outcome:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{figure}-{side}.log"
    cmd = [str(python), str(WORKLOAD), figure, "--mcp-python", str(args.mcp_python)]
    cmd += ["--reset-gap", str(args.reset_gap)]
    if args.quick:
        cmd.append("--quick")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ipybox-bench-state-") as state_dir, log_path.open("w") as log:
        env = side_env(venv, state_dir, extra_path)
        # A session of its own, so a run that hangs can be ended with everything it started.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO, text=True, start_new_session=True
        )
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, _ = proc.communicate()
            log.write(stdout)
            return Outcome(None, f"timed out after {args.timeout:.0f} s (log: {log_path})", args.timeout)
        log.write("\n--- stdout ---\n" + stdout)
    seconds = time.perf_counter() - start
    for line in reversed(stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return Outcome(json.loads(line.removeprefix("BENCH_RESULT ")), None, seconds)
        if line.startswith("BENCH_ERROR "):
            payload = json.loads(line.removeprefix("BENCH_ERROR "))
            return Outcome(None, str(payload["error"]), seconds)
    tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    last = tail[-1] if tail else "no output"
    return Outcome(None, f"exit code {proc.returncode}: {last.strip()[:200]} (log: {log_path})", seconds)


def fmt_value(result: dict[str, Any] | None) -> str:
    if result is None:
        return "n/a"
    value = float(result["value"])
    if "approval" in result:
        return f"{value:.2f} ms (approval {float(result['approval']):.2f} ms)"
    if result["unit"] == "calls/s":
        return f"{value:.0f} calls/s (in a row {float(result['sequential']):.0f})"
    if result["unit"] == "MB":
        return f"{value:.0f} MB (RSS {float(result['rss_mb']):.0f}, {result['processes']} proc)"
    if result.get("short"):
        return f"{value:.1f} ms (+{result['short']} short)"
    if value >= 1000:
        return f"{value / 1000:.2f} s"
    if value >= 100:
        return f"{value:.0f} ms"
    return f"{value:.2f} ms" if value < 10 else f"{value:.1f} ms"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ["figure", "reference 0.7.1", "ipybox (ours)", "ratio", "target", "met?"]
    body = [
        [
            row["figure"],
            *(
                fmt_value(row[side]) if side in BY_NAME[row["figure"]].sides else "-"
                for side in ("reference", "ours")
            ),
            ("n/a" if row["target"] is not None else "-") if row["ratio"] is None else f"{row['ratio']:.3f}x",
            "-" if row["target"] is None else f"<= {row['target']}x",
            {True: "yes", False: "NO", None: "-"}[row["met"]],
        ]
        for row in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for line in body:
        print(" | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)))
    notes = [
        f"  {row['figure']} ({side}): {row[side + '_error']}"
        for row in rows
        for side in ("reference", "ours")
        if row[side + "_error"]
    ]
    leaks = [
        f"  {row['figure']} ({side}): {row[side]['leaked_processes']} process(es) outlived stop() and were killed"
        for row in rows
        for side in ("reference", "ours")
        if row[side] and row[side].get("leaked_processes")
    ]
    gaps = {
        row[side]["gap_s"]
        for row in rows
        for side in ("reference", "ours")
        if row[side] and "gap_s" in row[side]
    }
    if gaps:
        print(
            f"\nreset figures: each timed reset follows {', '.join(f'{g:g}' for g in sorted(gaps))} s idle (--reset-gap)"
        )
    ours = {row["figure"]: row["ours"] for row in rows if row["ours"]}
    if "kernel_floor" in ours and "execute" in ours:
        floor = float(ours["kernel_floor"]["value"])
        print(
            f"\ngateway, transport and ipybox per execute (ours): execute - kernel_floor = "
            f"{float(ours['execute']['value']) - floor:.2f} ms of {float(ours['execute']['value']):.2f} ms"
        )
    if "mcp_floor" in ours and ("tool_call" in ours or "approval_call" in ours):
        floor = float(ours["mcp_floor"]["value"])
        costs = [
            f"{name} - mcp_floor = {float(ours[name]['value']) - floor:.3f} ms (target <= {limit} ms)"
            for name, limit in (("tool_call", 0.25), ("approval_call", 0.5))
            if name in ours
        ]
        print("\nipybox's own cost per tool call (ours, figures run apart): " + "; ".join(costs))
    if "tool_overhead" in ours:
        paired = ours["tool_overhead"]
        print(
            f"ipybox's own cost per tool call (ours, paired in one process): {float(paired['value']):.3f} ms "
            f"auto-approved (target <= 0.25 ms), {float(paired['approval']):.3f} ms with approval (target <= 0.5 ms)"
        )
        if "cpu_ms" in paired:
            cpu, own = paired["cpu_ms"], paired["cpu_over_floor_ms"]
            print(
                f"  process CPU per call (this process; load moves it less): SDK alone {cpu['floor']:.3f} ms, "
                f"auto-approved {cpu['tool']:.3f} ms (own +{own['tool']:.3f}), with approval "
                f"{cpu['approval']:.3f} ms (own +{own['approval']:.3f})"
            )
    if "concurrent_calls" in ours:
        print(
            f"20 concurrent calls of a 100 ms tool (ours): {float(ours['concurrent_calls']['value']):.0f} ms "
            "(target <= 250 ms; one after the other > 2000 ms)"
        )
    if "kernel_concurrent" in ours:
        print(
            f"20 calls of a 100 ms tool from kernel code (ours, gathered arun): "
            f"{float(ours['kernel_concurrent']['value']):.0f} ms (target <= 250 ms)"
        )
    if "throughput" in ours:
        print(
            f"echo throughput (ours): {float(ours['throughput']['value']):.0f} calls/s with 200 calls gathered, "
            f"{float(ours['throughput']['sequential']):.0f} calls/s one after the other"
        )
    if "executor_stop" in ours:
        print(
            f"CodeExecutor.stop() (ours): {float(ours['executor_stop']['value']):.0f} ms (target <= 200 ms)"
        )
    if notes:
        print("\nerrors:")
        print("\n".join(notes))
    if leaks:
        print("\nleftover processes:")
        print("\n".join(leaks))


def main() -> int:
    parser = argparse.ArgumentParser(description="ipybox vs reference ipybox 0.7.1, side by side.")
    parser.add_argument("--only", default="", help="comma-separated figures: " + ",".join(BY_NAME))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for development)")
    parser.add_argument(
        "--side",
        choices=["both", "reference", "ours"],
        default="both",
        help="run one side only (development)",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one workload run")
    parser.add_argument("--reset-gap", type=float, default=2.0, help="idle seconds before each timed reset")
    parser.add_argument("--ref-python", type=Path, default=REF_VENV / "bin" / "python")
    parser.add_argument("--ours-python", type=Path, default=OUR_VENV / "bin" / "python")
    parser.add_argument(
        "--mcp-python",
        type=Path,
        default=OUR_VENV / "bin" / "python",
        help="interpreter that runs the benchmark MCP servers for both sides (mcp 2.x)",
    )
    args = parser.parse_args()

    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    if not args.ref_python.exists():
        parser.error(f"{args.ref_python} is missing: run `bash benchmarks/setup_reference.sh` first")

    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"Python {platform.python_version()}; {'quick' if args.quick else 'full'} run"
    )
    if load[0] > (os.cpu_count() or 1) * 0.5:
        print("note: the machine is busy; timings will be noisy")

    rows: list[dict[str, Any]] = []
    for name in names:
        figure = BY_NAME[name]
        outcomes: dict[str, Outcome] = {}
        for side, python, venv, extra in (
            ("reference", args.ref_python, REF_VENV, None),
            # The project is imported from src/ directly, whatever state its editable install is in.
            ("ours", args.ours_python, OUR_VENV, REPO / "src"),
        ):
            if args.side not in ("both", side):
                outcomes[side] = Outcome(None, "not run (--side)", 0.0)
                continue
            if side not in figure.sides:
                outcomes[side] = Outcome(None, None, 0.0)
                continue
            print(f"{name:<15} {side:<10} ...", end="", flush=True)
            outcome = run_workload(side, python, venv, name, args, extra)
            shown = fmt_value(outcome.result) if outcome.result else f"n/a ({outcome.error})"
            print(f" {shown}  [{outcome.seconds:.0f} s]", flush=True)
            outcomes[side] = outcome
        ref, ours = outcomes["reference"].result, outcomes["ours"].result
        ratio = float(ours["value"]) / float(ref["value"]) if ref and ours and ref["value"] else None
        rows.append(
            {
                "figure": name,
                "description": figure.description,
                "reference": ref,
                "ours": ours,
                "reference_error": outcomes["reference"].error,
                "ours_error": outcomes["ours"].error,
                "ratio": ratio,
                "target": figure.target,
                "met": None if ratio is None or figure.target is None else ratio <= figure.target,
            }
        )

    print_table(rows)
    if args.json:
        args.json.write_text(
            json.dumps({"quick": args.quick, "load_average": load, "figures": rows}, indent=2) + "\n"
        )
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
