"""The recipes in ``examples/`` for frameworks that speak MCP, run as a user would run them: the
OpenAI Agents SDK with its `ScriptedModel`, and LangChain (in its own environment, as
langchain-mcp-adapters needs the MCP SDK 1.x) with a scripted chat model; each starts the ``ipybox``
MCP server, and the application approves or rejects each cell."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_openai_agents_recipe_runs_cells_keeps_state_rejects_one_recovers_and_plots(
    tmp_path: Path,
) -> None:
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    recipe = load(EXAMPLES / "openai_agents_recipe.py")
    result = await recipe.run(str(tmp_path), recipe.scripted_model())
    assert result.final_output == "The area is 12.57."
    outputs = [
        item["output"]
        for item in result.to_input_list()
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    ]
    assert len(outputs) == len(recipe.CELLS)
    state, used, rejected, failing, recovery, plot = outputs
    assert state == [{"type": "input_text", "text": "(no output)"}]
    assert used == [{"type": "input_text", "text": "12.57"}]
    assert rejected == "The application rejected this cell."
    assert "NameError: name 'undefined' is not defined" in failing[0]["text"]
    assert recovery == [{"type": "input_text", "text": "20"}]
    assert plot[0]["type"] == "input_image" and plot[0]["image_url"].startswith("data:image/png;base64,")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_langchain_recipe_runs_cells_keeps_state_rejects_one_recovers_and_plots(tmp_path: Path) -> None:
    uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    command = shlex.join([sys.executable, "-m", "ipybox.mcp_server"])
    run = subprocess.run(
        [
            uv,
            "run",
            "--frozen",
            "--project",
            str(EXAMPLES / "langchain"),
            "python",
            "recipe.py",
            str(tmp_path),
        ],
        cwd=EXAMPLES / "langchain",
        env={**os.environ, "IPYBOX_COMMAND": command, "VIRTUAL_ENV": ""},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stderr
    tools = [line for line in run.stdout.splitlines() if line.startswith("ToolMessage: ")]
    assert len(tools) == 6, run.stdout
    state, used, rejected, failing, recovery, plot = tools
    assert "'(no output)'" in state and "'12.57'" in used
    assert "rejected the tool call" in rejected and "The application rejected this cell." in rejected
    assert "NameError: name 'undefined' is not defined" in failing
    assert "'20'" in recovery
    assert "'type': 'image'" in plot and "iVBORw0KGgo" in plot
    assert run.stdout.splitlines()[-1] == "AIMessage: The area is 12.57."
