"""Kernels through a remote gateway vs local ones, in one run (issue 23).

The remote gateways run with the same kernel arguments as ipybox's local kernel spec
(`KERNEL_ARGS`; the extension is loaded by the executor's setup cell):

- the stock Jupyter Kernel Gateway reached over plain TCP (on this machine's loopback, no
  namespace): what the client sees of a gateway on another host;
- the stock gateway in a network namespace with one forwarded port (tests/remote_support.py);
  there the forwarding ``socat`` inside receives the gateway's messages and delays its ACKs, which
  the stock gateway's Nagle algorithm then waits for (~40 ms per execution): the client cannot
  help that hop;
- the same gateway run through ipybox's own entry point (``ipybox.gateway._main``: TCP_NODELAY on
  its WebSockets) in the namespace.

For each: `CodeExecutor` start to the first result, the trivial ``execute("x = 1")``, `reset()` to
the next result, and 20 executors started at once (failures counted).

    .venv/bin/python benchmarks/remote.py [--executes N] [--starts N] [--concurrent N] [--targets ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx2

from ipybox import CodeExecutor
from ipybox.app.kernels._spec import KERNEL_ARGS
from tests.remote_support import KERNEL_NAME, RemoteGateway, remote_gateway


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
        reset_times = []
        for _ in range(starts):
            await executor.execute("import time; time.sleep(1)")  # the spare kernel gets ready meanwhile
            began = time.perf_counter()
            await executor.reset()
            await executor.execute("x = 1")
            reset_times.append(time.perf_counter() - began)
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
        "reset": statistics.median(reset_times),
        "together": together,
        "failures": failures,
    }


@contextlib.contextmanager
def host_gateway() -> Iterator[RemoteGateway]:
    """The stock Kernel Gateway on this machine's loopback, with the suites' kernel spec."""
    folder = Path(tempfile.mkdtemp(prefix="ipybox-bench-"))
    spec_dir = folder / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    args = [arg for arg in KERNEL_ARGS if not arg.startswith("--IPKernelApp.extensions")]
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", *args]
    (spec_dir / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "k", "language": "python"})
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_urlsafe(24)
    log = folder / "gateway.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kernel_gateway",
                "--KernelGatewayApp.ip=127.0.0.1",
                f"--KernelGatewayApp.port={port}",
            ],
            env={**os.environ, "KG_AUTH_TOKEN": token, "JUPYTER_PATH": str(folder)},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"{url}/api", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield RemoteGateway("host", url, token, KERNEL_NAME, log)
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def target(name: str) -> Iterator[RemoteGateway | None]:
    if name == "local":
        yield None
    elif name == "host":
        with host_gateway() as gateway:
            yield gateway
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
    parser.add_argument("--targets", nargs="+", choices=["host", "kernel-gateway", "ipybox-gateway"])
    args = parser.parse_args()
    names = {
        "local": "local",
        "host": "stock KG over TCP",
        "kernel-gateway": "stock KG in netns",
        "ipybox-gateway": "KG+NODELAY in netns",
    }
    if args.targets:
        names = {name: label for name, label in names.items() if name == "local" or name in args.targets}
    results = {}
    for name in names:
        with target(name) as gateway:
            results[name] = asyncio.run(measure(gateway, args.executes, args.starts, args.concurrent))
    local = results["local"]
    print(
        f"{'':22} {'start→result':>13} {'execute med':>12} {'p90':>9} {'reset→result':>13} "
        f"{args.concurrent} at once {'failed':>7}"
    )
    for name, label in names.items():
        r = results[name]
        print(
            f"{label:22} {r['start'] * 1000:10.0f} ms {r['execute'] * 1000:9.2f} ms {r['execute_p90'] * 1000:6.2f} ms"
            f" {r['reset'] * 1000:10.0f} ms {r['together']:9.2f} s {len(r['failures']):7d}"
        )
        for failure in r["failures"][:3]:
            print(f"    {type(failure).__name__}: {failure}")
    for name, label in list(names.items())[1:]:
        r = results[name]
        print(
            f"{label} / local: start {r['start'] / local['start']:.2f}x, execute {r['execute'] / local['execute']:.2f}x, "
            f"reset {r['reset'] / local['reset']:.2f}x, "
            f"{args.concurrent} at once {r['together'] / local['together']:.2f}x"
        )


if __name__ == "__main__":
    main()
