"""One smolagents step on `IpyboxExecutor` against smolagents' own local executor, in one run.

The same steps as a `CodeAgent` sends them (``executor(code)``), timed per step after a warm-up:
  - a trivial step (``x = x + 1``), and a step that prints;
  - a step that calls one of the agent's tools (``lookup(item=...)``): smolagents' local executor
    calls the Python object in its own process; ipybox reaches it from the kernel through the tool
    server (policy and approval on the way, auto-approved here) and runs it in the application;
  - ipybox unsandboxed and, with ``--sandbox``, in srt.
smolagents' ``DockerExecutor`` builds its image from a public Python base image, which cannot be
pulled on this machine (no registry but PyPI, npm and Debian), so it is not measured; the figure
it is compared on is the same per-step call.

    .venv/bin/python benchmarks/smolagents_step.py [--steps N] [--sandbox]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smolagents import tool
from smolagents.local_python_executor import LocalPythonExecutor

from ipybox.integrations.smolagents import IpyboxExecutor


@tool
def lookup(item: str) -> int:
    """Look up an item's price.

    Args:
        item: The item.
    """
    return len(item)


STEPS = {
    "trivial step (x = x + 1)": "x = x + 1",
    "printing step": "print('x is', x)",
    "step calling one agent tool": "y = lookup(item='tea')",
}


def timed(run: Callable[[str], Any], code: str, steps: int) -> tuple[float, float]:
    for _ in range(5):
        run(code)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run(code)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.9)]


def measure(name: str, executor: Any, steps: int) -> list[str]:
    executor.send_tools({"lookup": lookup})
    executor.send_variables({"x": 0})
    lines = []
    for label, code in STEPS.items():
        median, p90 = timed(executor, code, steps)
        lines.append(f"{name:<26}: {label:<28} median {median:7.2f} ms   p90 {p90:7.2f} ms   ({steps} steps)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sandbox", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("IPYBOX_STATE_DIR", tempfile.mkdtemp(prefix="ipybox-bench-state-"))
    os.chdir(tempfile.mkdtemp(prefix="ipybox-bench-"))
    lines = measure("smolagents local executor", LocalPythonExecutor([]), args.steps)
    with IpyboxExecutor() as executor:
        lines += measure("ipybox", executor, args.steps)
    if args.sandbox:
        with IpyboxExecutor(sandbox=True) as executor:
            lines += measure("ipybox, sandboxed", executor, args.steps)
    lines.append("load average: " + " ".join(f"{load:.2f}" for load in os.getloadavg()))
    text = "\n".join(lines)
    print(text)
    (Path(__file__).with_suffix(".txt")).write_text(text + "\n")


if __name__ == "__main__":
    main()
