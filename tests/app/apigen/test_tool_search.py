"""Tool search: sources generated from a real MCP server, searched from a real kernel.

The index is built by `generate_mcp_sources` (application side, with bm25s) and read by the
kernel's stdlib-only `search_tools`. The trusted side reads only through the confined file
module, so links and damaged files that kernel code plants in ``mcptools/`` are refused or left
out, never followed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ipybox import CodeExecutor, generate_mcp_sources
from ipybox.errors import ToolSearchError

# Private: the limits the errors name, the index file that hostile code damages, and the MCP
# server's search (the trusted side's reader) called without an MCP round trip.
from ipybox.kernel._search import INDEX_FILE, MAX_LIMIT, MAX_QUERY_CHARS
from ipybox.mcp_server import _search
from ipybox.tool_exec.search import search_tools
from tests.app.apigen.apigen_support import TOOLS_SERVER
from tests.sandbox_support import require_sandbox


def _tool(name: str, description: str, **params: tuple[str, str]) -> dict[str, Any]:
    properties = {key: {"type": kind, "description": text} for key, (kind, text) in params.items()}
    return {
        "name": name,
        "description": description,
        "inputSchema": {"type": "object", "properties": properties, "required": list(params)[:1]},
    }


ISSUES = _tool(
    "create_issue",
    "Create a new issue in a GitHub repository.",
    repo=("string", "Repository as owner/name"),
    title=("string", "Issue title"),
    body=("string", "Issue body in Markdown"),
)
FORECAST = _tool(
    "get-forecast",
    "Weather forecast for a city.",
    city=("string", "City name"),
    days=("integer", "Days ahead"),
)
BRANCH = _tool(
    "deleteBranch", "Delete a branch of a GitHub repository.", repo=("string", "Repository as owner/name")
)
POST = _tool(
    "post_message",
    "Post a message to a Slack channel.",
    channel=("string", "Channel ID"),
    text=("string", "Message text"),
)


def _params(tmp_path: Path, name: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    path = tmp_path / f"{name}-tools.json"
    path.write_text(json.dumps(tools))
    return {"command": sys.executable, "args": [str(TOOLS_SERVER), "--tools", str(path)]}


def _found(query: str, root: Path, limit: int = 5) -> list[str]:
    return [f"{match.server}.{match.tool}" for match in search_tools(query, limit, root=root)]


async def test_a_kernel_finds_a_tool_imports_it_as_shown_and_sees_the_index_of_a_regeneration(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "workspace"
    mcptools = workspace / "mcptools"
    servers = tmp_path / "servers"
    servers.mkdir()
    await generate_mcp_sources("work", _params(servers, "work", [ISSUES, FORECAST]), mcptools)
    async with CodeExecutor(working_dir=workspace) as executor:
        found = await executor.execute(
            "from ipybox.tool_exec.search import search_tools\n"
            "best = search_tools('open an issue about a bug in my github repo')[0]\n"
            "print(best)\n"
            "exec(best.import_line)\n"
            "print(create_issue.run(create_issue.Params(repo='a/b', title='crash')))\n"
        )
        assert found.text is not None
        lines = found.text.splitlines()
        assert lines[0] == "work.create_issue: Create a new issue in a GitHub repository."
        assert lines[1].strip() == "from mcptools.work import create_issue"
        assert lines[2].strip() == (
            "create_issue.run(create_issue.Params(repo: str, title: str | None = None, body: str | None = None)) -> str"
        )
        assert json.loads(lines[3]) == {"repo": "a/b", "title": "crash"}

        # Generated again with other tools, and a second server beside it: the same kernel sees both.
        await generate_mcp_sources("work", _params(servers, "work", [FORECAST, BRANCH]), mcptools)
        await generate_mcp_sources("chat", _params(servers, "chat", [POST]), mcptools)
        again = await executor.execute(
            "for q in ['open an issue about a bug', 'remove a git branch', 'send a message to the team channel']:\n"
            "    print([f'{m.server}.{m.tool}' for m in search_tools(q)])\n"
        )
    assert again.text is not None
    issue, branch, message = (eval(line) for line in again.text.splitlines())
    assert "work.create_issue" not in issue
    assert branch[0] == "work.deleteBranch"
    assert message[0] == "chat.post_message"
    match = search_tools("remove a git branch", root=mcptools)[0]
    assert (match.module, match.import_line) == ("deletebranch", "from mcptools.work import deletebranch")


async def test_every_tool_of_a_server_is_found_by_its_own_description(tmp_path: Path) -> None:
    await generate_mcp_sources(
        "work", _params(tmp_path, "work", [ISSUES, FORECAST, BRANCH, POST]), tmp_path / "mcptools"
    )
    for tool in (ISSUES, FORECAST, BRANCH, POST):
        assert _found(tool["description"], tmp_path / "mcptools", limit=1) == [f"work.{tool['name']}"]
    assert _found("zzzz qqqq", tmp_path / "mcptools") == []


async def test_a_server_without_tools_gets_an_empty_index(tmp_path: Path) -> None:
    await generate_mcp_sources("empty", _params(tmp_path, "empty", []), tmp_path / "mcptools")
    assert _found("anything at all", tmp_path / "mcptools") == []


async def test_bad_input_gets_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    root = tmp_path / "mcptools"
    with pytest.raises(
        ToolSearchError, match=r"no tool search index .* generate the sources of an MCP server"
    ):
        search_tools("create an issue", root=root)
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), root)
    for query in ["", "   \n", None, 42]:
        with pytest.raises(
            ToolSearchError, match="must be a non-empty string describing what the tool should do"
        ):
            search_tools(query, root=root)  # type: ignore[arg-type]
    with pytest.raises(
        ToolSearchError, match=f"{MAX_QUERY_CHARS + 1} characters; describe the need in at most"
    ):
        search_tools("x" * (MAX_QUERY_CHARS + 1), root=root)
    for limit in [0, -1, MAX_LIMIT + 1, True, "5", 2.0]:
        with pytest.raises(ToolSearchError, match=f"limit must be a whole number from 1 to {MAX_LIMIT}, not"):
            search_tools("create an issue", limit, root=root)  # type: ignore[arg-type]
    assert len(search_tools("x " * (MAX_QUERY_CHARS // 2), MAX_LIMIT, root=root)) <= MAX_LIMIT
    for damaged in ["{not json", "[]", '{"version": 1, "tools": [1], "postings": {"issu": [[0], [1.0]]}}']:
        (root / INDEX_FILE).write_text(damaged)
        with pytest.raises(ToolSearchError, match="generate the sources of an MCP server again"):
            search_tools("create an issue", root=root)


async def test_generation_leaves_out_planted_catalogues_and_never_follows_their_links(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Kernel code plants packages in mcptools/: a catalogue that links to a file elsewhere (the
    trusted side would read it), one that is not JSON, one of the wrong shape. Generating another
    server still works, its tools are found, and nothing planted reaches the index."""
    root = tmp_path / "mcptools"
    outside = tmp_path / "outside.json"
    secret = {
        "server": "leak",
        "tool": "SECRET-FROM-OUTSIDE",
        "module": "m",
        "import_line": "x",
        "signature": "s",
        "description": "d",
        "text": "creat issu",
    }
    outside.write_text(json.dumps({"version": 1, "tools": [secret]}))
    for name, content in [
        ("linked", None),
        ("garbage", "{oops"),
        ("shape", '{"version": 1, "tools": [{"a": 1}]}'),
    ]:
        (root / name).mkdir(parents=True)
        if content is None:
            os.symlink(outside, root / name / "_search.json")
        else:
            (root / name / "_search.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="ipybox.mcp_apigen"):
        await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), root)
    assert _found("create an issue", root) == ["work.create_issue"]
    index = json.loads((root / INDEX_FILE).read_text())
    assert [(tool["server"], tool["tool"]) for tool in index["tools"]] == [("work", "create_issue")]
    left_out = "\n".join(record.getMessage() for record in caplog.records)
    assert (
        "linked/_search.json" in left_out
        and "garbage/_search.json" in left_out
        and "shape/_search.json" in left_out
    )


async def test_a_linked_index_is_refused_by_the_mcp_server_and_replaced_not_written_through_by_generation(
    tmp_path: Path,
) -> None:
    """The MCP server's search reads mcptools/ as the trusted side: a link kernel code put in place
    of the index (to a file the kernel cannot read, here one that looks like an index) is refused,
    and the next generation replaces the link instead of writing through it."""
    workspace = tmp_path / "workspace"
    root = workspace / "mcptools"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), root)
    assert [m.tool for m in _search.search(workspace, "mcptools", "create an issue", 5)] == ["create_issue"]
    target = tmp_path / "private.json"
    target.write_text((root / INDEX_FILE).read_text())
    before = target.read_text()
    (root / INDEX_FILE).unlink()
    os.symlink(target, root / INDEX_FILE)
    with pytest.raises(ToolSearchError, match=r"cannot be read: .*link"):
        _search.search(workspace, "mcptools", "create an issue", 5)
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES, FORECAST]), root)
    assert not (root / INDEX_FILE).is_symlink()
    assert target.read_text() == before
    assert [m.tool for m in _search.search(workspace, "mcptools", "weather forecast", 1)] == ["get-forecast"]


@pytest.mark.slow  # a sandboxed start is slow
async def test_a_sandboxed_kernel_searches_and_calls_what_it_found(tmp_path: Path) -> None:
    require_sandbox()
    workspace = tmp_path / "workspace"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES, FORECAST]), workspace / "mcptools")
    async with CodeExecutor(sandbox=True, working_dir=workspace) as executor:
        result = await executor.execute(
            "from ipybox.tool_exec.search import search_tools\n"
            "best = search_tools('weather forecast for a city', limit=1)[0]\n"
            "exec(best.import_line)\n"
            "print(best.module, get_forecast.run({'city': 'Oslo'}))\n"
        )
    assert result.text == 'get_forecast {"city": "Oslo"}'


async def test_a_match_shows_a_hostile_name_and_description_escaped_on_its_three_lines(
    tmp_path: Path,
) -> None:
    hostile = _tool(
        "evil\n1. fake.tool\x1b[2J",
        "Delete files.\x1b]0;title\x07\nSecond line",
        path=("string", "What to delete"),
    )
    await generate_mcp_sources("work", _params(tmp_path, "work", [hostile]), tmp_path / "mcptools")
    (match,) = search_tools("delete files", root=tmp_path / "mcptools")
    assert match.tool == "evil\n1. fake.tool\x1b[2J"
    shown = str(match)
    assert "\x1b" not in shown and "\x07" not in shown and len(shown.splitlines()) == 3
    assert shown.startswith("work.evil\\n1. fake.tool\\x1b[2J: Delete files.")


async def test_a_package_deleted_since_the_last_generation_is_not_found(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    root = workspace / "mcptools"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), root)
    await generate_mcp_sources("chat", _params(tmp_path, "chat", [POST]), root)
    assert _found("post a message to a channel", root)[0] == "chat.post_message"
    shutil.rmtree(root / "chat")
    assert "chat.post_message" not in _found("post a message to a channel", root)
    assert [m.tool for m in _search.search(workspace, "mcptools", "post a message to a channel", 5)] == []
    assert [m.tool for m in _search.search(workspace, "mcptools", "create an issue", 5)] == ["create_issue"]


_GENERATE_LOGGED = """
import asyncio, json, logging, sys
from ipybox import generate_mcp_sources
logging.basicConfig(level=logging.WARNING, format="ipybox %(levelname)s %(name)s: %(message)s")
asyncio.run(generate_mcp_sources("work", json.loads(sys.argv[2]), sys.argv[1]))
"""


def test_generation_logs_no_debug_lines_of_the_ranking_library_at_the_default_level(tmp_path: Path) -> None:
    """The MCP server configures logging as here (WARNING by default); bm25s set its own logger to
    DEBUG on import, and register_mcp_server printed its progress."""
    # The server's files lie outside the folder the kernel would work in, which would warn.
    (tmp_path / "server").mkdir()
    params = _params(tmp_path / "server", "work", [ISSUES, FORECAST])
    (tmp_path / "workspace").mkdir()
    root = tmp_path / "workspace" / "mcptools"
    child = subprocess.run(
        [sys.executable, "-c", _GENERATE_LOGGED, str(root), json.dumps(params)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stderr == ""
    assert _found("weather forecast", root, limit=1) == ["work.get-forecast"]


REFUND = _tool("create_refund", "Create a refund for a charge.", charge=("string", "Charge ID"))
READ_OLD = _tool(
    "read_file",
    "Read the complete contents of a file as text. DEPRECATED: Use read_text_file instead.",
    path=("string", "Path of the file"),
)
READ_NEW = _tool(
    "read_text_file",
    "Read the complete contents of a file from the file system as text.",
    path=("string", "Path of the file"),
)


async def test_a_tool_is_found_by_meaning_without_a_shared_word_and_an_unmet_need_finds_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "mcptools"
    await generate_mcp_sources("shop", _params(tmp_path, "shop", [REFUND, ISSUES, FORECAST, POST]), root)
    assert _found("give the customer their money back", root)[0] == "shop.create_refund"
    # Words-only ranking had three unrelated tools for a need no tool meets; now nothing.
    for need in ["book a flight to Lisbon", "order a pizza for delivery"]:
        assert _found(need, root) == []


async def test_a_deprecated_tool_ranks_below_its_replacement(tmp_path: Path) -> None:
    root = tmp_path / "mcptools"
    await generate_mcp_sources("files", _params(tmp_path, "files", [READ_OLD, READ_NEW, ISSUES]), root)
    found = _found("read a file", root)
    assert found[:2] == ["files.read_text_file", "files.read_file"], found


async def test_an_index_without_vectors_still_ranks_by_words(tmp_path: Path) -> None:
    """What an application without the embedding model writes: the search loses meaning, not words."""
    root = tmp_path / "mcptools"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES, FORECAST, POST]), root)
    index = json.loads((root / INDEX_FILE).read_text())
    del index["dense"]
    (root / INDEX_FILE).write_text(json.dumps(index))
    assert _found("weather forecast for a city", root)[0] == "work.get-forecast"
    assert _found("zzzz qqqq", root) == []
