"""One benchmark figure, measured through the public API of whichever `ipybox` this interpreter imports.

`benchmarks/run.py` starts this file twice per figure: with the reference environment's
interpreter (ipybox 0.7.1) and with the project's. Only names, paths and defaults that both
document are used, so the same code measures both. The result is printed as one line
`BENCH_RESULT {json}` (a failure as `BENCH_ERROR {json}`): the gateway and tool server of
either side may write their own logs to stdout, and the marker keeps the result findable.

Usage: python benchmarks/workload.py FIGURE [--quick] [--mcp-python PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH_SERVER = HERE / "servers" / "bench_server.py"
MANY_TOOLS_SERVER = HERE / "servers" / "many_tools_server.py"
TRIVIAL = "x = 1"


def _open_mode() -> dict[str, bool]:
    """The keyword that keeps this project's tool server in the open mode the reference always has
    (a request names its server, no token): the project's default became the secure set-up."""
    import inspect

    from ipybox.tool_exec.server import ToolServer

    return (
        {"trust_all_clients": True} if "trust_all_clients" in inspect.signature(ToolServer).parameters else {}
    )


def free_port() -> int:
    """A port that was free a moment ago, for the APIs that need an explicit one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def maybe_await(value: Any) -> Any:
    # Lifecycle methods are coroutines in the documented API; awaiting only when needed keeps
    # the workload correct should one side make a method such as `stop()` synchronous.
    if inspect.isawaitable(value):
        return await value
    return value


def ms(seconds: float) -> float:
    return seconds * 1000.0


def summary(samples_ms: list[float], unit: str = "ms") -> dict[str, Any]:
    ordered = sorted(samples_ms)
    return {
        "value": statistics.median(ordered),
        "unit": unit,
        "n": len(ordered),
        "min": ordered[0],
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }


async def timed(func: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await func()
    return time.perf_counter() - start


# --- kernel layer -------------------------------------------------------------------------


async def fig_execute(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox.kernel_mgr.client import KernelClient
    from ipybox.kernel_mgr.server import KernelGateway

    runs = 60 if args.quick else 300
    port = free_port()
    async with (
        KernelGateway(port=port),
        KernelClient(port=port, images_dir=Path("images")) as client,
    ):
        for _ in range(10):
            await client.execute(TRIVIAL)
        samples = [ms(await timed(lambda: client.execute(TRIVIAL))) for _ in range(runs)]
    return summary(samples)


# 2 MiB of output in one cell: 16384 lines of 128 characters (newline included), in one print
# or in one print per line.
LARGE_OUTPUT = 'print(("x" * 127 + "\\n") * 16384, end="")'
LARGE_OUTPUT_LINES = 'for _ in range(16384): print("x" * 127)'
LARGE_OUTPUT_CHARS = 128 * 16384


async def fig_large_output(args: argparse.Namespace) -> dict[str, Any]:
    """`KernelClient.execute` of a cell that prints 2 MiB at once, until its whole text is back."""
    return await large_output(LARGE_OUTPUT, runs=10 if args.quick else 40)


async def fig_large_output_lines(args: argparse.Namespace) -> dict[str, Any]:
    """The same 2 MiB printed one line at a time."""
    return await large_output(LARGE_OUTPUT_LINES, runs=5 if args.quick else 20)


async def large_output(code: str, runs: int) -> dict[str, Any]:
    """The median time of the runs whose result held the whole output; how many did not, beside it."""
    from ipybox.kernel_mgr.client import KernelClient
    from ipybox.kernel_mgr.server import KernelGateway

    port = free_port()
    async with (
        KernelGateway(port=port),
        KernelClient(port=port, images_dir=Path("images")) as client,
    ):
        whole: list[float] = []
        short: list[float] = []
        for run in range(3 + runs):
            start = time.perf_counter()
            result = await client.execute(code)
            elapsed = ms(time.perf_counter() - start)
            # Both sides strip the trailing newline of the result text. A result that came back
            # without its whole output (the reference returns some without any) collected less,
            # so it is counted apart and left out of the figure.
            if run >= 3:
                complete = result.text is not None and len(result.text) >= LARGE_OUTPUT_CHARS - 1
                (whole if complete else short).append(elapsed)
    return {**summary(whole or short), "short": len(short)}


async def fig_kernel_floor(args: argparse.Namespace) -> dict[str, Any]:
    """ipykernel's own time for the `execute` cell: from its busy to its idle status.

    No ipybox and no gateway are involved: jupyter_client talks to an ipykernel started with
    the arguments ipybox gives its kernels, and the figure is read off the kernel's own
    message timestamps. No client of a Jupyter kernel can answer faster than this, so
    `execute - kernel_floor` is what the gateway, the transport and ipybox add.
    """
    from jupyter_client.manager import start_new_async_kernel

    from ipybox.app.kernels._spec import KERNEL_ARGS

    runs = 60 if args.quick else 300
    manager, client = await start_new_async_kernel(kernel_name="python3", extra_arguments=list(KERNEL_ARGS))

    async def busy_to_idle() -> float:
        msg_id = client.execute(TRIVIAL)
        states: dict[str, float] = {}
        while "idle" not in states:
            message = await client.get_iopub_msg(timeout=30)
            if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "status":
                states[message["content"]["execution_state"]] = message["header"]["date"].timestamp()
        while (await client.get_shell_msg(timeout=30))["parent_header"].get("msg_id") != msg_id:
            pass
        return states["idle"] - states["busy"]

    try:
        for _ in range(10):
            await busy_to_idle()
        samples = [ms(await busy_to_idle()) for _ in range(runs)]
    finally:
        client.stop_channels()
        await manager.shutdown_kernel(now=True)
    return summary(samples)


async def fig_start(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox.kernel_mgr.client import KernelClient
    from ipybox.kernel_mgr.server import KernelGateway

    runs = 2 if args.quick else 5
    samples = []
    for _ in range(runs):
        port = free_port()
        gateway = KernelGateway(port=port)
        client = KernelClient(port=port, images_dir=Path("images"))
        start = time.perf_counter()
        try:
            await maybe_await(gateway.start())
            await maybe_await(client.connect())
            await client.execute(TRIVIAL)
            samples.append(ms(time.perf_counter() - start))
        finally:
            try:
                await maybe_await(client.disconnect())
            finally:
                await maybe_await(gateway.stop())
    return summary(samples)


async def fig_reset(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox.kernel_mgr.client import KernelClient
    from ipybox.kernel_mgr.server import KernelGateway

    runs = 4 if args.quick else 10

    async def reset_then_execute() -> None:
        await client.reset()
        await client.execute(TRIVIAL)

    port = free_port()
    samples = []
    async with (
        KernelGateway(port=port),
        KernelClient(port=port, images_dir=Path("images")) as client,
    ):
        await client.execute(TRIVIAL)
        for _ in range(runs):
            # An agent works between two resets; the gap stands for that work and is not timed.
            await asyncio.sleep(args.reset_gap)
            samples.append(ms(await timed(reset_then_execute)))
    return {**summary(samples), "gap_s": args.reset_gap}


async def fig_executor_start(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox import CodeExecutor

    runs = 2 if args.quick else 5
    samples = []
    for _ in range(runs):
        executor = CodeExecutor(images_dir=Path("images"))
        start = time.perf_counter()
        try:
            await maybe_await(executor.start())
            await executor.execute(TRIVIAL)
            samples.append(ms(time.perf_counter() - start))
        finally:
            await maybe_await(executor.stop())
    return summary(samples)


async def fig_executor_stop(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox import CodeExecutor

    runs = 2 if args.quick else 5
    samples = []
    for _ in range(runs):
        executor = CodeExecutor(images_dir=Path("images"))
        await maybe_await(executor.start())
        try:
            await executor.execute(TRIVIAL)
        finally:
            start = time.perf_counter()
            await maybe_await(executor.stop())
            samples.append(ms(time.perf_counter() - start))
    return summary(samples)


async def fig_executor_reset(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox import CodeExecutor

    runs = 4 if args.quick else 10

    async def reset_then_execute() -> None:
        await executor.reset()
        await executor.execute(TRIVIAL)

    samples = []
    async with CodeExecutor(images_dir=Path("images")) as executor:
        await executor.execute(TRIVIAL)
        for _ in range(runs):
            await asyncio.sleep(args.reset_gap)
            samples.append(ms(await timed(reset_then_execute)))
    return {**summary(samples), "gap_s": args.reset_gap}


PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
# Starts of an executor the first_plot figure tries before it gives up.
_START_TRIES = 6


async def fig_first_plot(args: argparse.Namespace) -> dict[str, Any]:
    """A started executor, idle for the agent's first think (the reset gap, not timed), then its
    first cell: import pyplot, draw one line, show it. A run whose result has no image counts as
    short and is left out of the median. ipybox runs with its defaults (it warms pyplot in the kernel it
    has taken into use, `warm_imports`); the reference has no such option."""
    from ipybox import CodeExecutor

    runs = 3 if args.quick else 7
    samples: list[float] = []
    short = 0
    retried = 0
    for _ in range(runs):
        for attempt in range(_START_TRIES):
            try:
                async with CodeExecutor(images_dir=Path("images")) as executor:
                    await asyncio.sleep(args.reset_gap)
                    start = time.perf_counter()
                    result = await executor.execute(PLOT)
                    elapsed = ms(time.perf_counter() - start)
                break
            except RuntimeError as exc:
                # The reference gives up connecting to its kernel after 10 s, which a busy machine
                # exceeds; the start is not what this figure times, so it is tried again.
                if "Failed to create kernel" not in str(exc) or attempt == _START_TRIES - 1:
                    raise
                retried += 1
        if len(result.images) == 1:
            samples.append(elapsed)
        else:
            short += 1
    if not samples:
        raise RuntimeError(f"none of {runs} plot cells returned an image")
    extra = {**({"short": short} if short else {}), **({"starts_retried": retried} if retried else {})}
    return {**summary(samples), "gap_s": args.reset_gap, **extra}


# --- tool layer ---------------------------------------------------------------------------


async def tool_calls(args: argparse.Namespace, approval: bool) -> dict[str, Any]:
    from ipybox.tool_exec.approval.client import ApprovalClient, ApprovalRequest
    from ipybox.tool_exec.client import ToolRunner
    from ipybox.tool_exec.server import ToolServer

    runs = 60 if args.quick else 300
    port = free_port()
    server_params = {"command": args.mcp_python, "args": [str(BENCH_SERVER)]}
    tool_args = {"text": "hello"}
    approvals = 0

    async def accept(request: ApprovalRequest) -> None:
        nonlocal approvals
        approvals += 1
        await request.accept()

    def call_loop() -> list[float]:
        # run_sync blocks, as it does inside a kernel: it runs in a worker thread so the tool
        # server and the approval client keep the event loop.
        runner = ToolRunner(server_name="bench", server_params=server_params, port=port)
        first = runner.run_sync("echo", tool_args)
        if "hello" not in str(first):
            raise RuntimeError(f"echo returned {first!r}, expected it to contain 'hello'")
        for _ in range(10):
            runner.run_sync("echo", tool_args)
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            runner.run_sync("echo", tool_args)
            samples.append(ms(time.perf_counter() - start))
        return samples

    async with ToolServer(port=port, approval_required=approval, **_open_mode()):
        if approval:
            async with ApprovalClient(callback=accept, port=port):
                samples = await asyncio.to_thread(call_loop)
            if approvals < runs:
                raise RuntimeError(f"only {approvals} approval requests for {runs} calls")
        else:
            samples = await asyncio.to_thread(call_loop)
    return summary(samples)


async def fig_tool_call(args: argparse.Namespace) -> dict[str, Any]:
    return await tool_calls(args, approval=False)


async def fig_approval_call(args: argparse.Namespace) -> dict[str, Any]:
    return await tool_calls(args, approval=True)


async def fig_concurrent_calls(args: argparse.Namespace) -> dict[str, Any]:
    """20 calls of a tool that sleeps 100 ms, gathered through `ToolRunner.run` (auto-approved).

    Both sides document `ToolRunner.run` as a coroutine; whether the calls overlap is up to
    the implementation (one after the other they take over 2 s).
    """
    from ipybox.tool_exec.client import ToolRunner
    from ipybox.tool_exec.server import ToolServer

    runs = 3 if args.quick else 10
    port = free_port()
    server_params = {"command": args.mcp_python, "args": [str(BENCH_SERVER)]}
    samples = []
    async with ToolServer(port=port, approval_required=False, **_open_mode()):
        runner = ToolRunner(server_name="bench", server_params=server_params, port=port)
        await runner.run("sleep", {"seconds": 0.0})

        async def gather() -> None:
            results = await asyncio.gather(*(runner.run("sleep", {"seconds": 0.1}) for _ in range(20)))
            if len(results) != 20 or any("done" not in str(r) for r in results):
                raise RuntimeError(f"unexpected results: {results[:3]!r}")

        for _ in range(runs):
            samples.append(ms(await timed(gather)))
        aclose = getattr(runner, "aclose", None)
        if aclose is not None:
            await aclose()
    return summary(samples)


async def fig_kernel_concurrent(args: argparse.Namespace) -> dict[str, Any]:
    """20 calls of a 100 ms tool from kernel code through the generated API, auto-approved.

    Timed inside the kernel. A generated module with ``arun`` (ours) gathers them; one without
    (the reference's, synchronous ``run`` only) can only make them one after the other.
    """
    from ipybox import CodeExecutor, generate_mcp_sources

    runs = 3 if args.quick else 10
    server_params = {"command": args.mcp_python, "args": [str(BENCH_SERVER)]}
    await generate_mcp_sources("bench", server_params, Path("mcptools"))
    code = """
import asyncio, time
from mcptools.bench import sleep
start = time.perf_counter()
if hasattr(sleep, "arun"):
    await asyncio.gather(*(sleep.arun(sleep.Params(seconds=0.1)) for _ in range(20)))
else:
    for _ in range(20):
        sleep.run(sleep.Params(seconds=0.1))
print((time.perf_counter() - start) * 1000)
"""
    samples = []
    async with CodeExecutor(images_dir=Path("images")) as executor:
        await executor.execute(code)
        for _ in range(runs):
            result = await executor.execute(code)
            samples.append(float(str(result.text).strip().splitlines()[-1]))
    return summary(samples)


async def fig_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Calls per second of `echo`: 200 gathered through `ToolRunner.run`, beside 200 in a row."""
    from ipybox.tool_exec.client import ToolRunner
    from ipybox.tool_exec.server import ToolServer

    runs = 2 if args.quick else 5
    calls = 200
    port = free_port()
    server_params = {"command": args.mcp_python, "args": [str(BENCH_SERVER)]}
    tool_args = {"text": "hello"}
    concurrent, sequential = [], []
    async with ToolServer(port=port, approval_required=False, **_open_mode()):
        runner = ToolRunner(server_name="bench", server_params=server_params, port=port)

        def in_a_row() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                runner.run_sync("echo", tool_args)
            return time.perf_counter() - start

        async def gathered() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(runner.run("echo", tool_args) for _ in range(calls)))
            return time.perf_counter() - start

        await gathered()
        await asyncio.to_thread(in_a_row)
        for _ in range(runs):
            concurrent.append(calls / await gathered())
            sequential.append(calls / await asyncio.to_thread(in_a_row))
        for close in ("close", "aclose"):
            method = getattr(runner, close, None)
            if method is not None:
                await maybe_await(method())
    return {
        "value": statistics.median(concurrent),
        "unit": "calls/s",
        "n": runs,
        "sequential": statistics.median(sequential),
    }


async def fig_mcp_floor(args: argparse.Namespace) -> dict[str, Any]:
    """The MCP part of a tool call alone: the project's SDK calling `echo` on the same server.

    No ipybox is involved; it shows how much of `tool_call` the MCP server and SDK take, a
    floor under which no tool server can go. It runs on the project's interpreter only (the
    reference environment's mcp 1.x client has another API).
    """
    from mcp.client import Client
    from mcp.client.stdio import StdioServerParameters

    runs = 60 if args.quick else 300
    server = StdioServerParameters(command=args.mcp_python, args=[str(BENCH_SERVER)])
    samples = []
    async with Client(server, mode="legacy") as client:
        for _ in range(10):
            await client.call_tool("echo", {"text": "hello"})
        for _ in range(runs):
            samples.append(ms(await timed(lambda: client.call_tool("echo", {"text": "hello"}))))
    return summary(samples)


async def fig_tool_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """ipybox's own cost per tool call, measured in pairs against the MCP SDK alone.

    `tool_call`, `approval_call` and `mcp_floor` run minutes apart, and the SDK's round trip
    alone moves by more than ipybox's cost between such runs. Here one process holds all
    three paths, each to its own copy of the echo server, and calls them in turn from a worker
    thread (as `tool_call` does): the SDK directly, then `run_sync` through an auto-approving
    `ToolServer`, then `run_sync` through one whose `ApprovalClient` accepts at once. The figure is the median of the per-round
    differences from the SDK call (`approval` beside it).
    """
    from mcp.client import Client
    from mcp.client.stdio import StdioServerParameters

    from ipybox.tool_exec.approval.client import ApprovalClient, ApprovalRequest
    from ipybox.tool_exec.client import ToolRunner
    from ipybox.tool_exec.server import ToolServer

    runs = 60 if args.quick else 300
    server_params = {"command": args.mcp_python, "args": [str(BENCH_SERVER)]}
    tool_args = {"text": "hello"}
    auto_port, approval_port = free_port(), free_port()

    async def accept(request: ApprovalRequest) -> None:
        await request.accept()

    auto = ToolRunner(server_name="bench", server_params=server_params, port=auto_port)
    approved = ToolRunner(server_name="bench", server_params=server_params, port=approval_port)

    # Process CPU time per call (every thread of this process: the caller, the tool server and the
    # approval client; the echo server is a child, the same for all three paths). Unlike the wall
    # time, it hardly moves with the load of other processes on the machine.
    cpu: dict[str, list[float]] = {"floor": [], "tool": [], "approval": []}

    def timed_call(runner: ToolRunner, name: str) -> float:
        cpu_start, start = time.process_time(), time.perf_counter()
        runner.run_sync("echo", tool_args)
        wall = ms(time.perf_counter() - start)
        cpu[name].append(ms(time.process_time() - cpu_start))
        return wall

    direct = StdioServerParameters(command=args.mcp_python, args=[str(BENCH_SERVER)])
    tool_minus_floor: list[float] = []
    approval_minus_floor: list[float] = []
    async with (
        ToolServer(port=auto_port, approval_required=False, **_open_mode()),
        ToolServer(port=approval_port, approval_required=True, **_open_mode()),
        ApprovalClient(callback=accept, port=approval_port),
        Client(direct, mode="legacy") as client,
    ):
        loop = asyncio.get_running_loop()

        def timed_floor() -> float:
            # From a worker thread too, so that both sides pay the same hop to the event loop.
            cpu_start, start = time.process_time(), time.perf_counter()
            asyncio.run_coroutine_threadsafe(client.call_tool("echo", tool_args), loop).result()
            wall = ms(time.perf_counter() - start)
            cpu["floor"].append(ms(time.process_time() - cpu_start))
            return wall

        for round_ in range(10 + runs):
            floor = await asyncio.to_thread(timed_floor)
            tool = await asyncio.to_thread(timed_call, auto, "tool")
            approval = await asyncio.to_thread(timed_call, approved, "approval")
            if round_ >= 10:
                tool_minus_floor.append(tool - floor)
                approval_minus_floor.append(approval - floor)
    floor_cpu = cpu["floor"][10:]
    return {
        **summary(tool_minus_floor),
        "approval": statistics.median(approval_minus_floor),
        # Median process CPU per call of each path (the SDK alone, auto-approved, with approval),
        # and of the per-round differences from the SDK call (ipybox's own CPU per call).
        "cpu_ms": {name: statistics.median(samples[10:]) for name, samples in cpu.items()},
        "cpu_over_floor_ms": {
            name: statistics.median(a - b for a, b in zip(cpu[name][10:], floor_cpu, strict=True))
            for name in ("tool", "approval")
        },
    }


async def fig_apigen(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox import generate_mcp_sources

    runs = 1 if args.quick else 3
    server_params = {"command": args.mcp_python, "args": [str(MANY_TOOLS_SERVER)]}
    samples = []
    modules: list[str] = []
    for i in range(runs):
        root = Path(tempfile.mkdtemp(prefix=f"apigen{i}-", dir="."))
        start = time.perf_counter()
        modules = list(await generate_mcp_sources("many_tools", server_params, root))
        samples.append(ms(time.perf_counter() - start))
        written = sorted(p.name for p in (root / "many_tools").glob("*.py") if p.name != "__init__.py")
        if len(modules) != 100 or len(written) != 100:
            raise RuntimeError(f"expected 100 modules, got {len(modules)} names and {len(written)} files")
    return summary(samples)


# --- memory -------------------------------------------------------------------------------


def tree_memory_mb() -> dict[str, Any]:
    import psutil

    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    pss = rss = 0
    counted = 0
    for process in processes:
        try:
            info = process.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        pss += info.pss
        rss += info.rss
        counted += 1
    mb = 1024.0 * 1024.0
    return {"value": pss / mb, "unit": "MB", "rss_mb": rss / mb, "processes": counted}


async def fig_memory(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox import CodeExecutor

    async with CodeExecutor(images_dir=Path("images")) as executor:
        await executor.execute(TRIVIAL)
        # Let start-up work (background threads, spare processes) settle before measuring idle memory.
        await asyncio.sleep(1.0)
        return tree_memory_mb()


FIGURES: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]]] = {
    "execute": fig_execute,
    "kernel_floor": fig_kernel_floor,
    "large_output": fig_large_output,
    "large_output_lines": fig_large_output_lines,
    "start": fig_start,
    "reset": fig_reset,
    "executor_start": fig_executor_start,
    "executor_reset": fig_executor_reset,
    "executor_stop": fig_executor_stop,
    "first_plot": fig_first_plot,
    "tool_call": fig_tool_call,
    "approval_call": fig_approval_call,
    "mcp_floor": fig_mcp_floor,
    "tool_overhead": fig_tool_overhead,
    "concurrent_calls": fig_concurrent_calls,
    "kernel_concurrent": fig_kernel_concurrent,
    "throughput": fig_throughput,
    "apigen": fig_apigen,
    "memory": fig_memory,
}


def reap_leftovers(deadline_s: float = 5.0) -> int:
    """Wait for the processes the figure started to end; kill the ones that outlive the deadline.

    Returns how many had to be killed: a number above zero means the API under test left
    processes behind after its documented `stop()` / `async with` exit.
    """
    try:
        import psutil
    except ImportError:
        return 0
    children = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(children, timeout=deadline_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return len(alive)


def emit(marker: str, payload: dict[str, Any]) -> None:
    sys.stdout.flush()
    print(f"{marker} {json.dumps(payload)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("figure", choices=sorted(FIGURES))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--mcp-python", default=sys.executable, help="interpreter that runs the MCP servers")
    parser.add_argument("--reset-gap", type=float, default=2.0, help="idle seconds before each timed reset")
    args = parser.parse_args()

    import ipybox

    try:
        from importlib.metadata import version

        ipybox_version = version("ipybox")
    except Exception:
        ipybox_version = "unknown"

    # A fresh working directory: both APIs write `images/`, generated packages and the like
    # relative to it, and a `.env` there would be loaded by CodeExecutor.
    workdir = tempfile.mkdtemp(prefix=f"ipybox-bench-{args.figure}-")
    os.chdir(workdir)
    try:
        result = asyncio.run(FIGURES[args.figure](args))
    except BaseException as exc:
        leaked = reap_leftovers()
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # First line says what failed; for multi-line messages (a gateway's own output) the
        # last line usually says why.
        detail = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
        message = f"{type(exc).__name__}: {detail}" if lines else type(exc).__name__
        traceback.print_exc(file=sys.stderr)
        emit("BENCH_ERROR", {"figure": args.figure, "error": message, "leaked_processes": leaked})
        return 1
    finally:
        os.chdir(tempfile.gettempdir())
        shutil.rmtree(workdir, ignore_errors=True)
    leaked = reap_leftovers()
    emit(
        "BENCH_RESULT",
        {
            "figure": args.figure,
            **result,
            "leaked_processes": leaked,
            "ipybox": ipybox_version,
            "ipybox_path": str(Path(ipybox.__file__).parent),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
