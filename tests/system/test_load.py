"""Load: many executors in one process, and many tool calls in flight on one executor.

Each executor keeps its own state and sees only its own approvals; nothing fails under load.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from ipybox import ApprovalRequest, CodeExecutionResult, CodeExecutor, generate_mcp_sources
from tests.conftest import DEMO_SERVER

# Load tests run long on a busy machine: their own bounds (asyncio timeouts) apply, not the default.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900), pytest.mark.slow]

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
EXECUTORS = 8
CELLS = 500  # per executor, each with one tool call


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


async def _agent(number: int, workdir: Path) -> int:
    """One executor's run: its own variable in every cell, its own text in every tool call.

    Even cells approve through `stream()` and check that the request is this executor's own;
    odd cells use `execute()`. Returns the number of approvals it saw.
    """
    approvals = 0
    async with CodeExecutor(images_dir=workdir / f"images-{number}") as executor:
        await executor.execute(f"from mcptools.demo import echo\nmine = {number}\ncount = 0")
        for cell in range(1, CELLS + 1):
            code = (
                "count += 1\n"
                f"assert (mine, count) == ({number}, {cell}), (mine, count)\n"
                "print(echo.run(echo.Params(text=f'{mine}:{count}')))"
            )
            expected = f"{number}:{cell}"
            if cell % 2:
                result = await executor.execute(code)
            else:
                async for item in executor.stream(code):
                    if isinstance(item, ApprovalRequest):
                        assert (item.server_name, item.tool_name, item.tool_args) == (
                            "demo",
                            "echo",
                            {"text": expected},
                        )
                        approvals += 1
                        await item.accept()
                    elif isinstance(item, CodeExecutionResult):
                        result = item
            assert result.text == expected
    return approvals


async def test_eight_executors_in_one_process_each_keep_their_own_state_and_approvals(workdir: Path) -> None:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    approvals = await asyncio.wait_for(
        asyncio.gather(*(_agent(number, workdir) for number in range(EXECUTORS))), 900
    )
    assert approvals == [CELLS // 2] * EXECUTORS


async def test_two_hundred_tool_calls_in_flight_at_once_on_one_executor(workdir: Path) -> None:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    # Every call waits until all 200 are in flight together: run one by one, none would end.
    code = """
import asyncio, os
from ipybox.tool_exec.client import ToolRunner

runner = ToolRunner("demo", {}, os.environ["TOOL_SERVER_HOST"], int(os.environ["TOOL_SERVER_PORT"]))
answers = await asyncio.gather(
    *(runner.run("rendezvous", {"key": "flight", "count": 200, "timeout": 60}) for _ in range(200))
)
print(len(answers), set(answers))
"""
    seen = 0
    async with CodeExecutor(images_dir=workdir / "images") as executor:
        async with asyncio.timeout(300):
            async for item in executor.stream(code, timeout=300):
                if isinstance(item, ApprovalRequest):
                    assert item.tool_name == "rendezvous"
                    seen += 1
                    await item.accept()
                elif isinstance(item, CodeExecutionResult):
                    assert item.text == "200 {'200 together'}"
    assert seen == 200
