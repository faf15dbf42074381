"""The ``search_tools`` tool of the real ``ipybox`` MCP server, through the MCP SDK's client."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from mcp.client import Client

from ipybox.kernel._search import MAX_LIMIT, MAX_QUERY_CHARS  # private: the limits the errors name
from tests.app.apigen.apigen_support import TOOLS_SERVER
from tests.app.apigen.test_tool_search import FORECAST, ISSUES, POST
from tests.mcp_server.support import connected, own_state, run, stdio_params, text_of

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("workspace").resolve()
    with own_state(path):
        yield path


@pytest.fixture(autouse=True)
def state_dir(workspace: Path) -> Path:
    """This module's server and tests share one registry (see `workspace`)."""
    return Path(os.environ["IPYBOX_STATE_DIR"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(workspace: Path) -> AsyncIterator[Client]:
    async with connected(stdio_params(workspace)) as client:
        yield client


async def _register(client: Client, workspace: Path, name: str, tools: list[dict[str, Any]]) -> None:
    path = workspace.parent / f"{workspace.name}-{name}.json"
    path.write_text(json.dumps(tools))
    params = {"command": sys.executable, "args": [str(TOOLS_SERVER), "--tools", str(path)]}
    result = await client.call_tool("register_mcp_server", {"server_name": name, "server_params": params})
    assert not result.is_error, text_of(result)


async def test_search_before_any_registration_says_to_register_first(client: Client) -> None:
    result = await client.call_tool("search_tools", {"query": "create an issue"})
    assert result.is_error
    assert "register one with register_mcp_server" in text_of(result)


async def test_search_tools_is_listed_read_only_with_its_arguments(client: Client) -> None:
    tool = next(tool for tool in (await client.list_tools()).tools if tool.name == "search_tools")
    assert list(tool.input_schema["properties"]) == ["query", "limit"]
    assert tool.input_schema["required"] == ["query"]
    assert tool.annotations is not None and tool.annotations.read_only_hint


async def test_registered_tools_are_found_with_their_import_line_and_signature(
    client: Client, workspace: Path
) -> None:
    await _register(client, workspace, "work", [ISSUES, FORECAST])
    await _register(client, workspace, "chat", [POST])
    result = await client.call_tool(
        "search_tools", {"query": "post a message to the team channel", "limit": 2}
    )
    assert not result.is_error, text_of(result)
    lines = text_of(result).splitlines()
    assert lines[:3] == [
        "1. chat.post_message: Post a message to a Slack channel.",
        "    from mcptools.chat import post_message",
        "    post_message.run(post_message.Params(channel: str, text: str | None = None)) -> str",
    ]
    assert result.structured_content is not None
    matches = result.structured_content["matches"]
    assert len(matches) <= 2 and matches[0]["import_line"] == "from mcptools.chat import post_message"
    # The import line works as shown in the session's kernel.
    called = await run(
        client, f"{matches[0]['import_line']}\nprint(post_message.run({{'channel': 'C1', 'text': 'hi'}}))"
    )
    assert json.loads(text_of(called)) == {"channel": "C1", "text": "hi"}
    # Registered again with other tools: the next search sees them.
    await _register(client, workspace, "work", [FORECAST])
    issue = await client.call_tool("search_tools", {"query": "create an issue in a repository"})
    assert "work.create_issue" not in text_of(issue)


async def test_bad_arguments_are_tool_errors_that_say_what_to_do(client: Client) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"query": ""}, "must be a non-empty string describing what the tool should do"),
        ({"query": "x" * (MAX_QUERY_CHARS + 1)}, f"describe the need in at most {MAX_QUERY_CHARS}"),
        ({"query": "weather", "limit": 0}, f"limit must be a whole number from 1 to {MAX_LIMIT}, not 0"),
        ({"query": "weather", "limit": MAX_LIMIT + 1}, f"from 1 to {MAX_LIMIT}, not {MAX_LIMIT + 1}"),
        ({"query": "weather", "limit": "5"}, "The argument 'limit' must be a valid integer"),
        ({"query": "weather", "top": 3}, "search_tools takes no argument 'top'"),
    ]
    for arguments, message in cases:
        result = await client.call_tool("search_tools", arguments)
        assert result.is_error, arguments
        assert message in text_of(result), text_of(result)
    nothing = await client.call_tool("search_tools", {"query": "zzzz qqqq"})
    assert not nothing.is_error and "No tool matches 'zzzz qqqq'" in text_of(nothing)
