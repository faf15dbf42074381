"""Example: a smolagents `CodeAgent` whose steps run in ipybox, its tools kept in the application.

Runs offline: a `Model` with canned replies stands in for a real one (use e.g. smolagents'
``InferenceClientModel`` instead). The agent's tool `convert` is an ordinary Python function of this
process: code in the kernel calls it through ipybox's tool server, and the application approves each
call (here: every call, printed) before it runs here.

    python examples/smolagents_executor.py
"""

from __future__ import annotations

from typing import Any

from smolagents import CodeAgent, tool
from smolagents.models import ChatMessage, MessageRole, Model

from ipybox import ApprovalRequest
from ipybox.integrations.smolagents import IpyboxExecutor

STEPS = [
    "rate = convert(amount=1.0, currency='EUR')\nprint('rate', rate)",
    "final_answer(round(250 * rate, 2))",
]


@tool
def convert(amount: float, currency: str) -> float:
    """Convert an amount of US dollars to another currency.

    Args:
        amount: Dollars.
        currency: The currency code, e.g. 'EUR'.
    """
    return amount * {"EUR": 0.9, "GBP": 0.8}[currency]


class Scripted(Model):
    """A stand-in for a real model: the next canned code block at each step."""

    def __init__(self) -> None:
        super().__init__(model_id="scripted")
        self.step = 0

    def generate(self, messages: list[Any], **kwargs: Any) -> ChatMessage:
        code, self.step = STEPS[self.step], self.step + 1
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: next.\n<code>\n{code}\n</code>")


def approve(request: ApprovalRequest) -> bool:
    """The application's decision on each tool call a step makes (a plain function may block)."""
    print(f"tool call: {request.tool_name}({request.tool_args}) approved")
    return True


if __name__ == "__main__":
    executor = IpyboxExecutor(approve=approve)  # sandbox=True to run the kernel in srt
    with CodeAgent(tools=[convert], model=Scripted(), executor=executor) as agent:
        print("answer:", agent.run("How many euros are 250 dollars?"))
