"""`IpyboxExecutor` in a real smolagents `CodeAgent`, driven by a `Model` with canned replies.

The agent's tools are Python objects of this test (the application): they run here, reached from
the kernel through the tool server, and every call is put to the application's callback.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
from PIL import Image
from smolagents import CodeAgent, Tool, tool
from smolagents.memory import ActionStep
from smolagents.models import ChatMessage, MessageRole, Model

from ipybox import ApprovalRequest, CodeExecutor
from ipybox.errors import CodeExecutionError
from ipybox.integrations.smolagents import IpyboxExecutor
from ipybox.policy import Policy, Rule
from tests.integrations.support import FAILING, PLOT, RECOVERY, STATE, STATE_USED
from tests.sandbox_support import require_sandbox

# Each test starts an executor (a gateway and a kernel): over the 2 s a quick run allows.
pytestmark = pytest.mark.slow

APPLICATION_THREADS: set[str] = set()


@tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
def lookup_price(item: str) -> int:
    """Look up the price of an item in the application's catalogue.

    Args:
        item: The item's name.
    """
    APPLICATION_THREADS.add(threading.current_thread().name)
    return {"tea": 4, "cup": 9}[item]


@tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
def delete_catalogue(reason: str) -> str:
    """Delete the whole catalogue.

    Args:
        reason: Why.
    """
    raise AssertionError("a rejected call must never run")


TOOLS = """
price = lookup_price("tea") + lookup_price(item="cup")
print("price", price)
try:
    delete_catalogue(reason="tidy up")
except Exception as exc:
    print("refused:", exc)
"""


class Scripted(Model):  # type: ignore[misc]  # smolagents ships no type information
    """A model that answers each step with the next canned code block."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.steps = steps
        self.calls = 0

    def generate(self, messages: list[Any], **kwargs: Any) -> ChatMessage:
        code = self.steps[self.calls]
        self.calls += 1
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: next.\n<code>\n{code}\n</code>")


def only_reads(request: ApprovalRequest) -> bool:
    """The application's decision, a plain function (it runs in a worker thread)."""
    return request.tool_name != "delete_catalogue"


def observations(agent: CodeAgent) -> list[tuple[str | None, str | None]]:
    return [
        (step.observations, str(step.error) if step.error else None)
        for step in agent.memory.steps
        if isinstance(step, ActionStep)
    ]


@pytest.mark.parametrize("sandbox", [False, True])
def test_a_code_agent_keeps_state_decides_tool_calls_recovers_from_an_error_plots_and_answers(
    workdir: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    asked: list[ApprovalRequest] = []

    def approve(request: ApprovalRequest) -> bool:
        asked.append(request)
        return only_reads(request)

    steps = [
        STATE,
        STATE_USED,
        TOOLS,
        FAILING,
        RECOVERY,
        PLOT,
        "final_answer({'total': total, 'price': price})",
    ]
    model = Scripted(steps)
    executor = IpyboxExecutor(approve=approve, sandbox=sandbox)
    with CodeAgent(
        tools=[lookup_price, delete_catalogue], model=model, executor=executor, max_steps=10
    ) as agent:
        answer = agent.run("Work out the total, price the tea set, then plot.")
    assert answer == {"total": 42, "price": 13}
    seen = observations(agent)
    assert len(seen) == len(steps)
    _, used, tools, failing, recovery, plot, _ = seen
    assert used[0] is not None and "total 42" in used[0]
    assert tools[0] is not None and "price 13" in tools[0]
    assert "refused: Tool call smolagents.delete_catalogue was rejected by the application." in tools[0]
    assert [(r.server_name, r.tool_name, r.tool_args) for r in asked] == [
        ("smolagents", "lookup_price", {"item": "tea"}),
        ("smolagents", "lookup_price", {"item": "cup"}),
        ("smolagents", "delete_catalogue", {"reason": "tidy up"}),
    ]
    assert APPLICATION_THREADS, "the tool ran in the application"
    assert failing[1] is not None and "NameError" in failing[1] and "undefined_name" in failing[1]
    assert recovery[0] is not None and "recovered 84" in recovery[0]
    assert plot[0] is not None and "plotted" in plot[0]
    plot_step = [step for step in agent.memory.steps if isinstance(step, ActionStep)][5]
    assert isinstance(plot_step.action_output, Image.Image)
    with pytest.raises(RuntimeError, match="cleaned up"):
        executor("1")


def test_variables_sent_in_and_a_tool_error_reach_the_agents_code(workdir: Path) -> None:
    @tool  # type: ignore[untyped-decorator]  # smolagents ships no type information
    def broken(x: int) -> int:
        """Always fails.

        Args:
            x: Anything.
        """
        raise ValueError(f"no luck with {x}")

    code = """
try:
    broken(3)
except Exception as exc:
    print("tool said:", exc)
final_answer(f"{city} has {len(numbers)} numbers")
"""
    model = Scripted([code])
    with IpyboxExecutor() as executor:
        agent = CodeAgent(tools=[broken], model=model, executor=executor)
        answer = agent.run("go", additional_args={"city": "Paris", "numbers": [1, 2, 3]})
        assert answer == "Paris has 3 numbers"
        (step,) = observations(agent)
        assert step[0] is not None and "tool said:" in step[0] and "ValueError: no luck with 3" in step[0]


def test_a_given_executor_with_policy_rules_runs_the_agents_tools(workdir: Path) -> None:
    policy = Policy(rules=[Rule("allow", tool="lookup_price")], default="deny")
    executor = CodeExecutor(policy=policy)
    code = 'print(lookup_price("tea"))\ndelete_catalogue(reason="x")'
    with IpyboxExecutor(executor) as ipybox_executor:
        agent = CodeAgent(
            tools=[lookup_price, delete_catalogue],
            model=Scripted([code, "final_answer(lookup_price('cup'))"]),
            executor=ipybox_executor,
        )
        assert agent.run("price") == 9
    ((_, error), _) = observations(agent)
    assert error is not None and error.startswith("4\nExecuting code yielded an error:")
    assert "was refused by the policy's default decision" in error
    with pytest.raises(RuntimeError, match="not started"):
        executor.policy = None
        asyncio.run(executor.execute("1"))


async def test_a_started_executor_is_refused_with_what_to_pass_instead(workdir: Path) -> None:
    async with CodeExecutor() as executor:
        with pytest.raises(ValueError, match="already started"):
            IpyboxExecutor(executor)


def test_an_executor_and_options_for_one_to_make_are_refused_together() -> None:
    with pytest.raises(ValueError, match="pass them to your CodeExecutor"):
        IpyboxExecutor(CodeExecutor(), sandbox=True)


def test_a_tool_whose_name_code_cannot_call_is_refused_with_the_name() -> None:
    class Odd(Tool):  # type: ignore[misc]  # smolagents ships no type information
        name = "odd_tool"
        description = "x"
        inputs: ClassVar[dict[str, Any]] = {}
        output_type = "string"

        def forward(self) -> str:
            return "x"

    odd = Odd()
    odd.name = "class"
    with IpyboxExecutor() as executor, pytest.raises(ValueError, match="'class' is not a Python identifier"):
        executor.send_tools({"class": odd})


def test_an_error_in_a_step_raises_with_the_output_before_it() -> None:
    with IpyboxExecutor() as executor:
        with pytest.raises(CodeExecutionError) as info:
            executor("print('before')\n1/0")
        assert str(info.value).startswith("before\nExecuting code yielded an error:")
        assert "ZeroDivisionError" in str(info.value)


def test_a_program_that_never_cleans_up_still_exits(tmp_path: Path) -> None:
    code = "from ipybox.integrations.smolagents import IpyboxExecutor\nprint(IpyboxExecutor()('print(6 * 7)').logs)"
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "42"
