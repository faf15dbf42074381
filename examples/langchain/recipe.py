"""Recipe: a LangChain agent running the ``ipybox`` MCP server through ``langchain-mcp-adapters``.

One MCP session for the whole run keeps one kernel, so variables persist between cells (the
adapters' ``MultiServerMCPClient.get_tools()`` would open a session, and a fresh kernel, per call).
LangChain's ``HumanInTheLoopMiddleware`` stops the agent before every cell; the application
approves or rejects each one (here: any cell that mentions ``rmtree`` is rejected). Runs offline
with a scripted chat model; give ``create_agent`` a real model to use it.

langchain-mcp-adapters needs the MCP SDK 1.x and ipybox the 2.x, so the recipe has its own
environment (``pyproject.toml`` beside it) and starts the server with ``$IPYBOX_COMMAND``
(default ``ipybox``, e.g. ``uvx ipybox`` or ``/path/to/ipybox/.venv/bin/ipybox``):

    IPYBOX_COMMAND=.venv/bin/ipybox uv run --project examples/langchain python examples/langchain/recipe.py [WORKSPACE]
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_mcp_adapters.client import MultiServerMCPClient
from langchain_mcp_adapters.tools import load_mcp_tools
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command

CELLS = [
    "import math\nradius = 2",
    "print(round(math.pi * radius**2, 2))",
    "import shutil; shutil.rmtree('/')",
    "print(undefined)",
    "undefined = radius * 10\nprint(undefined)",
    "import matplotlib.pyplot as plt\nplt.plot([0, 1], [0, radius])\nplt.show()",
]


class ScriptedChatModel(GenericFakeChatModel):
    """LangChain's fake chat model, made to accept tools (it answers from its script regardless)."""

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:
        return self


def scripted_model() -> BaseChatModel:
    """A stand-in for a real model: one cell per step, then an answer."""
    replies = [
        AIMessage(
            content="",
            tool_calls=[{"name": "execute_ipython_cell", "args": {"code": code}, "id": f"cell-{n}"}],
        )
        for n, code in enumerate(CELLS)
    ]
    return ScriptedChatModel(messages=iter([*replies, AIMessage(content="The area is 12.57.")]))


def approve_cell(code: str) -> bool:
    """The application's decision on one cell."""
    return "rmtree" not in code


async def run(
    workspace: str, model: BaseChatModel, approve: Callable[[str], bool] = approve_cell
) -> dict[str, Any]:
    """Run the agent until it answers, deciding each cell with `approve`; return the final state."""
    command = shlex.split(os.environ.get("IPYBOX_COMMAND", "ipybox"))
    client = MultiServerMCPClient(
        {
            "ipybox": {
                "transport": "stdio",
                "command": command[0],
                "args": [*command[1:], "--workspace", workspace],
            }
        }
    )
    async with client.session("ipybox") as session:
        tools = await load_mcp_tools(session)
        agent = create_agent(
            model,
            tools,
            middleware=[HumanInTheLoopMiddleware(interrupt_on={"execute_ipython_cell": True})],
            checkpointer=InMemorySaver(),
        )
        config: Any = {"configurable": {"thread_id": "recipe"}}
        task: Any = {"messages": [{"role": "user", "content": "What is the area of a circle of radius 2?"}]}
        state: dict[str, Any] = await agent.ainvoke(task, config)
        while state.get("__interrupt__"):
            requests = state["__interrupt__"][0].value["action_requests"]
            decisions = [
                {"type": "approve"}
                if approve(request["args"]["code"])
                else {"type": "reject", "message": "The application rejected this cell."}
                for request in requests
            ]
            state = await agent.ainvoke(Command(resume={"decisions": decisions}), config)
        return state


if __name__ == "__main__":
    workspace = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ipybox-workspace-")
    for message in asyncio.run(run(workspace, scripted_model()))["messages"]:
        print(f"{type(message).__name__}: {message.content}"[:300])
