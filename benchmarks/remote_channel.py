"""Which channel carries tool calls from a remote kernel: a measurement (docs/remote-design.md).

Runs a gateway in a network namespace with one forwarded port (tests/remote_support.py) and, from
code in the middle of a cell, sends requests to the application and waits for its answers over the
two channels other than stdin (benchmarks/stdin_channel.py measures the one chosen):
  - a comm, answered on the shell channel (the main shell is busy with the cell);
  - a comm answered on an ipykernel 7 subshell (``create_subshell_request`` on the control channel).
Prints the median and 90th percentile round trip per channel and kernel, and whether the answer
reached the cell while it ran at all. Also the trivial execute through the same gateway.

    .venv/bin/python benchmarks/remote_channel.py [--eg-python PATH] [--calls N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._raw_kernel import RemoteKernel
from tests.remote_support import enterprise_gateway_argv, gateway_in_netns, kernel_gateway_argv

COMM_CELL = """
import json, threading, time
import ipykernel
from comm import create_comm
answered = threading.Event()
channel = create_comm(target_name="ipybox-bench", data={{}})
channel.on_msg(lambda msg: answered.set())
times, mid_cell = [], True
for i in range({calls}):
    answered.clear()
    start = time.perf_counter()
    channel.send({{"i": i}})
    if not answered.wait(3):
        mid_cell = False
        break
    times.append(time.perf_counter() - start)
print(json.dumps({{"ipykernel": ipykernel.__version__, "mid_cell": mid_cell, "times": times}}))
"""


class CommAnswering(RemoteKernel):
    """Answers every comm message from the kernel on the shell channel, optionally on a subshell."""

    subshell_id: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.control_replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def _dispatch(self, ws: Any, msg: dict[str, Any]) -> None:
        if msg.get("channel") == "iopub" and msg.get("msg_type") == "comm_msg":
            reply = self._message("comm_msg", "shell", {"comm_id": msg["content"]["comm_id"], "data": {}}, {})
            if self.subshell_id is not None:
                reply["header"]["subshell_id"] = self.subshell_id
            await ws.send(json.dumps(reply))
        elif msg.get("channel") == "control":
            self.control_replies.put_nowait(msg)
        else:
            await super()._dispatch(ws, msg)

    async def create_subshell(self) -> str | None:
        assert self._ws is not None
        request = self._message("create_subshell_request", "control", {}, {}, uuid.uuid4().hex)
        await self._ws.send(json.dumps(request))
        try:
            reply = await asyncio.wait_for(self.control_replies.get(), 10)
        except TimeoutError:  # ipykernel 6 does not answer a request it does not know
            return None
        return reply["content"].get("subshell_id")


def summary(name: str, found: dict[str, Any]) -> str:
    times = sorted(found["times"])
    if not found["mid_cell"] or not times:
        return f"{name:<34} ipykernel {found['ipykernel']:<7} the answer never reached the running cell"
    p90 = times[int(len(times) * 0.9)]
    return (
        f"{name:<34} ipykernel {found['ipykernel']:<7} median {statistics.median(times) * 1e3:6.2f} ms"
        f"   p90 {p90 * 1e3:6.2f} ms   ({len(times)} calls)"
    )


async def measure(label: str, argv: list[str], calls: int) -> None:
    with gateway_in_netns(argv) as gateway:
        async with CommAnswering(gateway.url, token=gateway.token) as kernel:
            await kernel.execute("pass")
            trivial = []
            for _ in range(max(20, calls // 5)):
                start = time.perf_counter()
                await kernel.execute("x = 1")
                trivial.append(time.perf_counter() - start)
            print(f"{label}: trivial execute median {statistics.median(trivial) * 1e3:.2f} ms")
            found = json.loads(await kernel.execute(COMM_CELL.format(calls=calls), timeout=60))
            print(summary(f"{label}: comm, answer on main shell", found))
            kernel.subshell_id = await kernel.create_subshell()
            if kernel.subshell_id is None:
                print(f"{label}: comm on a subshell: this kernel has no subshells")
                return
            found = json.loads(await kernel.execute(COMM_CELL.format(calls=calls), timeout=60))
            print(summary(f"{label}: comm, answer on a subshell", found))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eg-python", help="the Python of an Enterprise Gateway 3.3 environment")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    await measure("Kernel Gateway", kernel_gateway_argv(sys.executable), args.calls)
    if args.eg_python:
        await measure("Enterprise Gateway", enterprise_gateway_argv(args.eg_python), args.calls)


if __name__ == "__main__":
    asyncio.run(main())
