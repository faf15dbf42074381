"""OpenTelemetry traces: a cell, its tool calls, their approval waits and MCP server starts, linked;
checked with the SDK's in-memory exporter against real kernels, tool server and MCP servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ipybox import ApprovalRequest, CodeExecutionError, CodeExecutor, generate_mcp_sources

# Private: the hostile cell forges a tool call by hand, so it needs the names of the variables
# that tell the kernel where the tool server is (the wire contract is internal).
from ipybox._wire import ToolServerEnv
from tests.conftest import DEMO_SERVER

pytestmark = pytest.mark.asyncio(loop_scope="module")
DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


class Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name == name]


@pytest.fixture(scope="module")
def traced() -> Iterator[Traced]:
    traced = Traced()
    yield traced
    traced.provider.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["http", "stdin"])
async def executor(
    workdir: Path, traced: Traced, request: pytest.FixtureRequest
) -> AsyncIterator[CodeExecutor]:
    """Each test runs with tool calls over HTTP and over the kernel's stdin channel (the same spans)."""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(tracing=traced.provider, tool_channel=request.param) as ex:
        yield ex


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_trace_shows_the_cell_its_calls_their_approval_waits_and_the_server_start(
    executor: CodeExecutor, traced: Traced
) -> None:
    traced.exporter.clear()
    code = "from mcptools.demo import add\nprint(add.run(add.Params(a=1, b=2)).sum, add.run(add.Params(a=3, b=4)).sum)"
    async for item in executor.stream(code):
        if isinstance(item, ApprovalRequest):
            await item.accept()
    [cell] = traced.spans("ipybox.execute")
    calls = traced.spans("ipybox.tool_call")
    approvals = traced.spans("ipybox.approval")
    starts = traced.spans("ipybox.mcp_server.start")
    assert cell.attributes is not None and cell.attributes["ipybox.code"] == code
    assert [(c.attributes or {}).get("ipybox.tool") for c in calls] == ["add", "add"]
    assert {_parent(call) for call in calls} == {cell.context.span_id}
    assert sorted(_parent(a) or 0 for a in approvals) == sorted(c.context.span_id for c in calls)
    assert all((a.attributes or {}).get("ipybox.accepted") is True for a in approvals)
    [start] = starts  # the demo server started once, for the first call
    assert _parent(start) == calls[0].context.span_id
    trace_ids = {span.context.trace_id for span in [cell, *calls, *approvals, start]}
    assert trace_ids == {cell.context.trace_id}


async def test_a_rejected_call_and_a_failed_cell_are_marked_as_errors(
    executor: CodeExecutor, traced: Traced
) -> None:
    traced.exporter.clear()
    with pytest.raises(CodeExecutionError):
        async for item in executor.stream("from mcptools.demo import add\nadd.run(add.Params(a=1, b=2))"):
            if isinstance(item, ApprovalRequest):
                await item.reject()
    [cell] = traced.spans("ipybox.execute")
    [call] = traced.spans("ipybox.tool_call")
    [approval] = traced.spans("ipybox.approval")
    assert not cell.status.is_ok and not call.status.is_ok
    assert (call.attributes or {})["ipybox.status"] == 403
    assert (approval.attributes or {})["ipybox.accepted"] is False


async def test_kernel_code_cannot_put_its_calls_into_another_trace(
    executor: CodeExecutor, traced: Traced
) -> None:
    """Attack: the kernel sends a call with a W3C ``traceparent`` naming a trace of its choice (here
    one it was told, as if it had learnt another session's); the call still lands under its own cell."""
    traced.exporter.clear()
    foreign_trace, foreign_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    code = f"""
import json, os, urllib.request
body = json.dumps({{"server_name": "demo", "tool_name": "add", "tool_args": {{"a": 1, "b": 1}}}}).encode()
request = urllib.request.Request(
    f"http://{{os.environ['{ToolServerEnv.HOST}']}}:{{os.environ['{ToolServerEnv.PORT}']}}/run", data=body,
    headers={{"Authorization": "Bearer " + os.environ["{ToolServerEnv.TOKEN}"], "Content-Type": "application/json",
             "traceparent": "00-{foreign_trace}-{foreign_span}-01"}},
)
print(json.loads(urllib.request.urlopen(request).read())["result"]["sum"])
"""
    result = await executor.execute(code)
    assert result.text == "2"
    [cell] = traced.spans("ipybox.execute")
    [call] = traced.spans("ipybox.tool_call")
    assert call.context.trace_id == cell.context.trace_id != int(foreign_trace, 16)
    assert _parent(call) == cell.context.span_id


async def test_a_call_from_a_thread_a_cell_left_behind_goes_under_the_cell_running_when_it_arrives(
    executor: CodeExecutor, traced: Traced
) -> None:
    traced.exporter.clear()
    # A thread the cell leaves behind calls a tool once the next cell has started: the call's
    # span is the child of the running cell of the same kernel, never of a cell elsewhere.
    await executor.execute(
        "import threading\nfrom mcptools.demo import add\n"
        "go = threading.Event()\n"
        "def late():\n    go.wait(60)\n    try: add.run(add.Params(a=1, b=1))\n    except Exception: pass\n"
        "t = threading.Thread(target=late); t.start()"
    )
    await executor.execute("go.set(); t.join(60)")
    first, second = sorted(traced.spans("ipybox.execute"), key=lambda span: span.start_time or 0)
    [call] = traced.spans("ipybox.tool_call")
    assert _parent(call) == second.context.span_id != first.context.span_id


@pytest.mark.slow
async def test_with_tracing_off_nothing_of_opentelemetry_is_imported_for_it() -> None:
    code = (
        "import asyncio, sys\n"
        "from ipybox import CodeExecutor\n"
        "async def main():\n"
        "    async with CodeExecutor() as ex:\n"
        "        await ex.execute('x = 1')\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'ipybox.app._tracing'))))\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, stderr.decode()
    assert stdout.decode().strip().splitlines()[-1] == "[]"
