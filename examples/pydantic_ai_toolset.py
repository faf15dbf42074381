"""Example: a pydantic-ai agent that runs Python in ipybox, its tool calls approved by the application.

Runs offline: a scripted `FunctionModel` stands in for a real model (pass a model name such as
``"anthropic:claude-sonnet-4-5"`` to `Agent` instead). The agent registers nothing; the code it writes
calls the library-catalogue MCP server of this folder through its generated API, and the
application's `approve` callback refuses to borrow books.

    python examples/pydantic_ai_toolset.py [WORKSPACE]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from ipybox import ApprovalRequest, generate_mcp_sources
from ipybox.integrations.pydantic_ai import IpyboxToolset

SERVER = {"command": sys.executable, "args": [str(Path(__file__).with_name("library_server.py").resolve())]}

CELLS = [
    "from mcptools.library import search_books\nfound = search_books.run(search_books.Params(query='python'))",
    "print([book.title for book in found.books])",
    "from mcptools.library import borrow_book\nborrow_book.run(borrow_book.Params(book_id=found.books[0].id, borrower='ada'))",
]


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """A stand-in for a real model: one cell per step, then an answer."""
    step = sum(isinstance(message, ModelResponse) for message in messages)
    if step < len(CELLS):
        return ModelResponse(
            parts=[ToolCallPart("run_cell", {"code": CELLS[step]}, tool_call_id=f"cell-{step}")]
        )
    return ModelResponse(parts=[TextPart("I found the books; borrowing was refused.")])


async def approve(request: ApprovalRequest) -> bool:
    """The application's decision on each tool call a cell makes, while the cell waits."""
    print(f"tool call: {request.server_name}.{request.tool_name}({request.tool_args})")
    return request.tool_name != "borrow_book"


async def main(workspace: Path) -> None:
    await generate_mcp_sources("library", SERVER, workspace / "mcptools")
    toolset = IpyboxToolset(approve=approve, working_dir=workspace)  # sandbox=True to run it in srt
    result = await Agent(FunctionModel(script), toolsets=[toolset]).run(
        "Find books about Python and borrow one."
    )
    for message in result.all_messages():
        for part in message.parts:
            if part.part_kind == "tool-return":
                print("cell ->", str(part.content).strip().splitlines()[-1])  # its last line
    print(result.output)


if __name__ == "__main__":
    asyncio.run(
        main(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ipybox-workspace-")))
    )
