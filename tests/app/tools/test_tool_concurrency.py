"""Concurrent tool calls end to end: `await arun(...)` in kernel code, gathered, through
`CodeExecutor` with an approval for each call, against real MCP servers."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import ApprovalRequest, CodeExecutionResult, CodeExecutor, generate_mcp_sources
from tests.conftest import DEMO_SERVER

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["http", "stdin"])
async def executor(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[CodeExecutor]:
    """Each test runs with tool calls over HTTP and over the kernel's stdin channel (batched there)."""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    await generate_mcp_sources("other", DEMO, workdir / "mcptools")
    async with CodeExecutor(images_dir=workdir / "images", tool_channel=request.param) as ex:
        yield ex


async def test_a_gather_of_20_calls_runs_them_together_each_approved_on_its_own_and_one_rejection_fails_one(
    executor: CodeExecutor,
) -> None:
    # The rendezvous answers only once 19 calls wait in it together: run one by one, they never could.
    code = """
import asyncio
from mcptools.demo import rendezvous
results = await asyncio.gather(
    *(rendezvous.arun(rendezvous.Params(key="gather", count=19, timeout=60)) for _ in range(20)),
    return_exceptions=True,
)
for r in results:
    print(r if isinstance(r, str) else f"{type(r).__name__}: {r}")
"""
    requests: list[ApprovalRequest] = []
    result: CodeExecutionResult | None = None
    async for item in executor.stream(code):
        if isinstance(item, ApprovalRequest):
            # Every request arrives while none is decided yet: each call waits on its own approval.
            requests.append(item)
            if len(requests) == 20:
                await requests[7].reject()
                for request in reversed(requests[:7] + requests[8:]):
                    await request.accept()
        elif isinstance(item, CodeExecutionResult):
            result = item
    assert len(requests) == 20
    assert {(r.server_name, r.tool_name) for r in requests} == {("demo", "rendezvous")}
    assert result is not None and result.text is not None
    lines = result.text.splitlines()
    assert sorted(lines) == ["19 together"] * 19 + [
        "ToolRunnerError: Tool call demo.rendezvous was rejected by the application."
    ]


async def test_a_slow_call_holds_up_neither_other_servers_nor_other_calls_to_its_own_server(
    executor: CodeExecutor,
) -> None:
    code = """
import asyncio
from mcptools.demo import echo, slow
from mcptools.other import echo as other_echo
pending = asyncio.ensure_future(slow.arun(slow.Params(seconds=60)))
print(await other_echo.arun(other_echo.Params(text="other server")), pending.done())
print(await echo.arun(echo.Params(text="same server")), pending.done())
cancelled = pending.cancel()
"""
    assert (await executor.execute(code)).text == "other server False\nsame server False"


async def test_sync_and_async_calls_mix_in_one_cell(executor: CodeExecutor) -> None:
    code = """
import asyncio
from mcptools.demo import add, echo
first = add.run(add.Params(a=1, b=2)).sum
sums = await asyncio.gather(*(add.arun(add.Params(a=first, b=n)) for n in range(5)))
print([s.sum for s in sums], echo.run(echo.Params(text="done")))
"""
    assert (await executor.execute(code)).text == "[3, 4, 5, 6, 7] done"
