"""Recipe: the OpenAI Agents SDK running the ``ipybox`` MCP server, cells approved by the application.

The agent gets ipybox's tools (``execute_ipython_cell``, ``reset``, ...) over MCP stdio with
``MCPServerStdio``; its ``require_approval`` setting stops the run before every cell, and the
application approves or rejects each one (here: any cell that mentions ``rmtree`` is rejected).
Runs offline with the SDK's own ``ScriptedModel``; give the agent a real model to use it.

    python examples/openai_agents_recipe.py [WORKSPACE]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from agents import Agent, Runner, set_tracing_disabled
from agents.mcp import MCPServerStdio
from agents.models.interface import Model
from agents.testing import ScriptedModel, assistant_message, function_call

CELLS = [
    "import math\nradius = 2",
    "print(round(math.pi * radius**2, 2))",
    "import shutil; shutil.rmtree('/')",
    "print(undefined)",
    "undefined = radius * 10\nprint(undefined)",
    "import matplotlib.pyplot as plt\nplt.plot([0, 1], [0, radius])\nplt.show()",
]


def scripted_model() -> ScriptedModel:
    """A stand-in for a real model: one cell per step, then an answer."""
    steps: list[Any] = [
        [function_call("execute_ipython_cell", {"code": code}, call_id=f"cell-{n}")]
        for n, code in enumerate(CELLS)
    ]
    steps.append([assistant_message("The area is 12.57.")])
    return ScriptedModel(steps)


def approve_cell(arguments: str) -> bool:
    """The application's decision on one cell (its JSON arguments)."""
    return "rmtree" not in arguments


async def run(workspace: str, model: Model, approve: Callable[[str], bool] = approve_cell) -> Any:
    """Run the agent until it answers, deciding each cell with `approve`; return the last result."""
    ipybox = MCPServerStdio(
        params={"command": sys.executable, "args": ["-m", "ipybox.mcp_server", "--workspace", workspace]},
        require_approval={"execute_ipython_cell": "always"},
        client_session_timeout_seconds=120,
        cache_tools_list=True,
    )
    async with ipybox:
        agent = Agent(
            name="coder", instructions="Solve tasks by running Python.", model=model, mcp_servers=[ipybox]
        )
        result = await Runner.run(agent, "What is the area of a circle of radius 2?", max_turns=20)
        while result.interruptions:
            state = result.to_state()
            for item in result.interruptions:
                arguments = str(getattr(item.raw_item, "arguments", ""))
                if approve(arguments):
                    state.approve(item)
                else:
                    state.reject(item, rejection_message="The application rejected this cell.")
            result = await Runner.run(agent, state, max_turns=20)
        return result


if __name__ == "__main__":
    set_tracing_disabled(True)  # offline: no traces to send
    workspace = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ipybox-workspace-")
    print(asyncio.run(run(workspace, scripted_model())).final_output)
