"""Tool calls over the kernel's stdin channel against the same calls over HTTP, in one run.

Two local executors side by side (``tool_channel="http"`` and ``"stdin"``, calls auto-approved), the
demo MCP server over stdio; from code in the kernel:
  - one generated tool call in a loop (``add.run``): median and 90th percentile per call;
  - 20 concurrent calls of a 100 ms tool (``asyncio.gather`` of ``slow.arun``): the whole gather.
With ``--netns``, also the loop through a Kernel Gateway in a network namespace (tests/remote_support.py),
the kernel reaching the application only over the gateway's WebSocket.

    .venv/bin/python benchmarks/stdin_channel.py [--calls N] [--rounds N] [--netns]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipybox import CodeExecutor, generate_mcp_sources
from ipybox._wire import StdinChannel, ToolServerEnv
from ipybox.app.kernels._client import KernelClient
from ipybox.app.tools._server import ToolServer
from ipybox.app.tools._stdin_channel import StdinToolCalls
from tests.remote_support import gateway_in_netns, kernel_gateway_argv

ROOT = Path(__file__).resolve().parents[1]
DEMO = {"command": sys.executable, "args": [str(ROOT / "tests" / "servers" / "demo_server.py")]}

LOOP = """
import json, time
from mcptools.demo import add
add.run(add.Params(a=0, b=0))
times = []
for i in range({calls}):
    start = time.perf_counter()
    add.run(add.Params(a=i, b=1))
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""

GATHER = """
import asyncio, json, time
from mcptools.demo import slow
start = time.perf_counter()
await asyncio.gather(*(slow.arun(slow.Params(seconds=0.1)) for _ in range(20)))
print(json.dumps(time.perf_counter() - start))
"""

REMOTE_LOOP = (
    "import os\n"
    + f"os.environ[{ToolServerEnv.CHANNEL!r}] = {StdinChannel.VALUE!r}\n"
    + LOOP.replace("from mcptools.demo import add", "from ipybox.kernel._tool_client import run_tool")
    .replace("add.run(add.Params(a=0, b=0))", 'run_tool("demo", "add", {{"a": 0, "b": 0}})')
    .replace("add.run(add.Params(a=i, b=1))", 'run_tool("demo", "add", {{"a": i, "b": 1}})')
)


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    return (
        f"median {statistics.median(ordered) * 1e3:6.2f} ms   p90 {ordered[int(len(ordered) * 0.9)] * 1e3:6.2f} ms"
        f"   ({len(ordered)} calls)"
    )


async def local(calls: int, rounds: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    async with (
        CodeExecutor(approve_tool_calls=False) as http,
        CodeExecutor(approve_tool_calls=False, tool_channel="stdin") as stdin,
    ):
        loops: dict[str, list[float]] = {"http": [], "stdin": []}
        gathers: dict[str, list[float]] = {"http": [], "stdin": []}
        for _ in range(rounds):  # interleaved: both sides see the same load
            for name, executor in (("http", http), ("stdin", stdin)):
                loops[name] += json.loads((await executor.execute(LOOP.format(calls=calls))).text or "[]")
                gathers[name].append(json.loads((await executor.execute(GATHER)).text or "0"))
        for name in ("http", "stdin"):
            print(f"local, {name:<5}: one call in a loop      {summary(loops[name])}")
            print(
                f"local, {name:<5}: 20 x 100 ms gathered     median {statistics.median(gathers[name]) * 1e3:6.1f} ms"
                f"   ({len(gathers[name])} gathers)"
            )
        found["local"] = {"loop": loops, "gather": gathers}
    return found


async def remote(calls: int) -> list[float]:
    with gateway_in_netns(kernel_gateway_argv(sys.executable)) as gateway:
        async with ToolServer(approval_required=False) as tools:
            handler = StdinToolCalls(tools)
            address = urlsplit(gateway.url)
            assert address.hostname is not None and address.port is not None
            async with KernelClient(
                address.hostname,
                address.port,
                auth_token=gateway.token,
                spare_kernel=False,
                stdin_handler=handler,
            ) as kernel:
                times: list[float] = json.loads(
                    (await kernel.execute(REMOTE_LOOP.format(calls=calls))).text or "[]"
                )
            await handler.aclose()
    print(f"netns Kernel Gateway, stdin: one call   {summary(times)}")
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--netns", action="store_true", help="also through a gateway in a network namespace")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ipybox-bench-stdin-") as folder:
        os.chdir(folder)
        os.environ["IPYBOX_STATE_DIR"] = str(Path(folder) / "state")
        await generate_mcp_sources("demo", DEMO, Path("mcptools"))
        await local(args.calls, args.rounds)
        if args.netns:
            await remote(args.calls)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    asyncio.run(main())
