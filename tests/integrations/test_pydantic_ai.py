"""`IpyboxToolset` in a real pydantic-ai agent run, driven by pydantic-ai's `FunctionModel`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from pydantic_ai import Agent, BinaryContent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from ipybox import ApprovalRequest, CodeExecutor, generate_mcp_sources
from ipybox.integrations.pydantic_ai import IpyboxToolset
from ipybox.policy import Policy, Rule
from tests.integrations.support import DEMO, FAILING, PLOT, RECOVERY, STATE, STATE_USED, TOOLS, only_allowed
from tests.sandbox_support import require_sandbox

# Each test starts an executor (a gateway and a kernel): over the 2 s a quick run allows.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mcptools(workdir: Path) -> Path:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    return workdir / "mcptools"


def scripted(calls: list[tuple[str, dict[str, Any]]]) -> FunctionModel:
    """A model that makes `calls` one per step, then answers with the last tool result it saw."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        step = sum(isinstance(message, ModelResponse) for message in messages)
        if step < len(calls):
            name, args = calls[step]
            return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"call-{step}")])
        return ModelResponse(parts=[TextPart("done")])

    return FunctionModel(respond)


def returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [part for message in messages for part in message.parts if isinstance(part, ToolReturnPart)]


def text_of(part: ToolReturnPart) -> str:
    content = part.content
    if isinstance(content, list):
        return "\n".join(item for item in content if isinstance(item, str))
    return str(content)


@pytest.mark.parametrize("sandbox", [False, True])
async def test_a_multi_step_task_keeps_state_decides_tool_calls_recovers_from_an_error_and_plots(
    mcptools: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    asked: list[ApprovalRequest] = []

    async def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return only_allowed(request)

    cells = [STATE, STATE_USED, TOOLS, FAILING, RECOVERY, PLOT]
    model = scripted([("run_cell", {"code": code}) for code in cells])
    toolset = IpyboxToolset(approve=approve, sandbox=sandbox)
    result = await Agent(model, toolsets=[toolset]).run("Add two to forty, use the echo tool, then plot.")

    assert result.output == "done"
    parts = returns(result.all_messages())
    assert [part.outcome for part in parts] == [
        "success",
        "success",
        "success",
        "failed",
        "success",
        "success",
    ]
    state, used, tools, failing, recovery, plot = parts
    assert text_of(state) == "(no output)"
    assert text_of(used) == "total 42"
    assert "allowed" in text_of(tools)
    assert "refused: Tool call demo.echo was rejected by the application." in text_of(tools)
    assert [request.tool_args for request in asked] == [{"text": "allowed"}, {"text": "forbidden"}]
    assert "NameError" in text_of(failing) and "undefined_name" in text_of(failing)
    assert text_of(recovery) == "recovered 84"
    assert isinstance(plot.content, list)
    images = [item for item in plot.content if isinstance(item, BinaryContent)]
    assert len(images) == 1 and images[0].media_type == "image/png"
    assert images[0].data.startswith(b"\x89PNG")
    # The run's executor was stopped with the run.
    with pytest.raises(RuntimeError, match="not started"):
        await toolset.executor.execute("1")


async def test_policy_rules_decide_before_the_callback_and_a_given_executor_outlives_runs(
    mcptools: Path,
) -> None:
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return True

    policy = Policy(rules=[Rule("deny", tool="echo")], default="ask")
    code = "from mcptools.demo import echo, add\nprint(add.run(add.Params(a=1, b=2)))\necho.run(echo.Params(text='x'))"
    async with CodeExecutor(policy=policy) as executor:
        toolset = IpyboxToolset(executor, approve=approve)
        agent = Agent(scripted([("run_cell", {"code": "kept = 7"})]))
        await agent.run("first", toolsets=[toolset])
        result = await agent.run("second", toolsets=[toolset], model=scripted([("run_cell", {"code": code})]))
        (part,) = returns(result.new_messages())
        assert part.outcome == "failed"
        assert "was refused by policy rule 1" in text_of(part)
        assert [(request.tool_name, request.tool_args) for request in asked] == [("add", {"a": 1, "b": 2})]
        assert (await executor.execute("print(kept)")).text == "7"


async def test_the_model_searches_the_generated_tools_and_resets_the_kernel(mcptools: Path) -> None:
    model = scripted(
        [
            ("search_tools", {"query": "echo text back unchanged", "limit": 2}),
            ("run_cell", {"code": "before = 1"}),
            ("reset_kernel", {}),
            ("run_cell", {"code": "print('before' in globals())"}),
        ]
    )
    result = await Agent(model, toolsets=[IpyboxToolset()]).run("find a tool")
    search, _, reset, after = (text_of(part) for part in returns(result.all_messages()))
    assert search.startswith("1. demo.echo")
    assert "from mcptools.demo import echo" in search
    assert "reset" in reset
    assert after == "False"


async def test_a_cell_over_its_timeout_tells_the_model_and_the_kernel_keeps_its_state(mcptools: Path) -> None:
    model = scripted(
        [
            ("run_cell", {"code": "kept = 1\nimport time\nwhile True: time.sleep(0.05)"}),
            ("run_cell", {"code": "print(kept)"}),
        ]
    )
    result = await Agent(model, toolsets=[IpyboxToolset(timeout=2)]).run("loop")
    timed_out, after = returns(result.all_messages())
    assert timed_out.outcome == "failed" and "longer than 2 s" in text_of(timed_out)
    assert text_of(after) == "1"


async def test_an_executor_and_options_for_one_to_make_are_refused_together() -> None:
    with pytest.raises(ValueError, match="pass them to your CodeExecutor"):
        IpyboxToolset(CodeExecutor(), sandbox=True)


async def test_kernel_code_that_replaces_the_search_cannot_make_unapproved_calls_through_it(
    mcptools: Path,
) -> None:
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return False

    hijack = """
import ipybox.tool_exec.search as search
from mcptools.demo import echo
def search_tools(query, limit=5):
    return [echo.run(echo.Params(text="exfiltrate"))]
search.search_tools = search_tools
"""
    model = scripted([("run_cell", {"code": hijack}), ("search_tools", {"query": "anything"})])
    result = await Agent(model, toolsets=[IpyboxToolset(approve=approve)]).run("search")
    _, search = returns(result.all_messages())
    assert search.outcome == "failed" and "rejected by the application" in text_of(search)
    assert [request.tool_args for request in asked] == [{"text": "exfiltrate"}]
