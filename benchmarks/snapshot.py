"""Snapshot figures (ipybox only: the reference has no snapshots).

- ``trivial``: `save_snapshot` and `load_snapshot` of a namespace holding ``x = 1``, each load into a
  fresh kernel (the reset before it not timed); median of the runs. Beside it, a load into a kernel
  that has run a cell, and a fresh kernel's first cell without any snapshot: a fresh kernel's first
  execution costs what it costs, snapshot or not.
- ``large``: the same for a namespace holding 100 MB of numpy arrays (four float64 arrays of 25 MB)
  and 10,000 small objects (instances of a class defined in a cell, each with a dict and a string);
  median of the runs; and the snapshot's size against the bytes of the arrays.

Sandboxed (``srt``) and not, unless ``--no-sandbox``. Times are the application's, from the call to
its return (the kernel pickles and writes the file; the application checks and copies it).

    uv run --frozen python benchmarks/snapshot.py [--quick] [--no-sandbox] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ipybox import CodeExecutor

_MB = 1024 * 1024
LARGE = """
import numpy as np
arrays = [np.random.default_rng(i).random(25 * 1024 * 1024 // 8) for i in range(4)]
class Item:
    def __init__(self, i):
        self.i, self.tags, self.name = i, {"even": i % 2 == 0}, f"item-{i}"
items = [Item(i) for i in range(10_000)]
"""


async def _figure(executor: CodeExecutor, folder: Path, setup: str, runs: int) -> dict[str, Any]:
    saves, loads, warm_loads, first_cells, size = [], [], [], [], 0
    path = folder / "bench.snap"
    for _ in range(runs):
        await executor.reset()
        await executor.execute(setup, timeout=300)
        started = time.perf_counter()
        report = await executor.save_snapshot(path)
        saves.append(time.perf_counter() - started)
        size = report.size
        await executor.reset()
        started = time.perf_counter()
        loaded = await executor.load_snapshot(path)
        loads.append(time.perf_counter() - started)
        assert set(loaded.names) == set(report.names), (loaded, report)
        # Beside it: a load into a kernel that has run a cell, and a fresh kernel's first cell.
        started = time.perf_counter()
        await executor.load_snapshot(path)
        warm_loads.append(time.perf_counter() - started)
        await executor.reset()
        started = time.perf_counter()
        await executor.execute("pass")
        first_cells.append(time.perf_counter() - started)
    return {
        "save_ms": statistics.median(saves) * 1000,
        "load_ms": statistics.median(loads) * 1000,
        "load_warm_ms": statistics.median(warm_loads) * 1000,
        "first_cell_ms": statistics.median(first_cells) * 1000,
        "save_max_ms": max(saves) * 1000,
        "load_max_ms": max(loads) * 1000,
        "size_bytes": size,
        "runs": runs,
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-sandbox", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    for sandbox in (False,) if args.no_sandbox else (False, True):
        label = "sandboxed" if sandbox else "unsandboxed"
        with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory() as out:
            async with CodeExecutor(working_dir=work, sandbox=sandbox, spare_kernel=True) as executor:
                trivial = await _figure(executor, Path(out), "x = 1", 5 if args.quick else 20)
                large = await _figure(executor, Path(out), LARGE, 2 if args.quick else 5)
        results[label] = {"trivial": trivial, "large": large}
        print(
            f"trivial ({label}): save {trivial['save_ms']:.1f} ms, load {trivial['load_ms']:.1f} ms median "
            f"({trivial['runs']} runs; max {trivial['save_max_ms']:.1f} / {trivial['load_max_ms']:.1f} ms); "
            f"{trivial['size_bytes']} bytes; a load into a kernel that ran a cell {trivial['load_warm_ms']:.1f} ms, "
            f"a fresh kernel's first cell (no snapshot) {trivial['first_cell_ms']:.1f} ms"
        )
        print(
            f"large ({label}): 100 MB of numpy arrays + 10,000 small objects: save {large['save_ms']:.0f} ms, "
            f"load {large['load_ms']:.0f} ms median ({large['runs']} runs; max {large['save_max_ms']:.0f} / "
            f"{large['load_max_ms']:.0f} ms); snapshot {large['size_bytes'] / _MB:.1f} MiB for 100.0 MiB of arrays "
            f"({large['size_bytes'] / (100 * _MB):.3f} x); a load into a kernel that ran a cell "
            f"{large['load_warm_ms']:.0f} ms"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
