"""Policy rules and the audit trail end to end: a real executor, kernel, tool server and an MCP
server whose tools carry annotations (tests/servers/annotated_server.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import (
    ApprovalRequest,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)

# Private: the audit trail is read back through its own reader, as `ipybox audit` does.
from ipybox.app.approval._audit import AuditTrail, default_audit_path
from ipybox.policy import Policy, Rule

pytestmark = pytest.mark.asyncio(loop_scope="module")

ANNOTATED = Path(__file__).parents[2] / "servers" / "annotated_server.py"
SECRET = "s3cr3t-value-from-the-environment"


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executor and its audit trail share one state folder (see `workdir`)."""
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["http", "stdin"])
async def executor(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[CodeExecutor]:
    """Each test runs with tool calls over HTTP and over the kernel's stdin channel (same policy and trail)."""
    import os

    os.environ["POLICY_TEST_SECRET"] = SECRET
    params = {"command": sys.executable, "args": [str(ANNOTATED)], "env": {"TOKEN": "${POLICY_TEST_SECRET}"}}
    await generate_mcp_sources("annot", params, workdir / "mcptools")
    async with CodeExecutor(approve_shell_cmds=True, audit=True, tool_channel=request.param) as ex:
        yield ex


async def run(ex: CodeExecutor, code: str, decide: str = "accept") -> tuple[list[ApprovalRequest], str]:
    """Run `code`, deciding every request as told; the requests and the output (or the error)."""
    asked: list[ApprovalRequest] = []
    try:
        async for item in ex.stream(code):
            if isinstance(item, ApprovalRequest):
                asked.append(item)
                if decide == "remember":
                    await item.accept(remember=True)
                else:
                    await (item.accept() if decide == "accept" else item.reject())
            elif isinstance(item, CodeExecutionResult):
                return asked, item.text or ""
    except CodeExecutionError as exc:
        return asked, str(exc)
    raise AssertionError("no result")


def call(tool: str, **args: str) -> str:
    params = ", ".join(f"{name}={value!r}" for name, value in args.items())
    return f"from mcptools.annot import {tool}\nprint({tool}.run({tool}.Params({params})))"


def records(ex: CodeExecutor) -> list[dict[str, object]]:
    trail = AuditTrail(default_audit_path())
    try:
        return [record.as_dict() for record in trail.query(session=ex.session_id)]
    finally:
        trail.close()


def exists(path: str) -> bool:
    return Path(path).exists()


def trail_bytes() -> bytes:
    """Every file of the audit database (the write-ahead log too)."""
    folder = default_audit_path().parent
    return b"".join(path.read_bytes() for path in sorted(folder.iterdir()))


async def test_allow_and_deny_by_tool_name_glob_reach_the_application_only_when_asking(
    executor: CodeExecutor,
) -> None:
    executor.policy = Policy((Rule("allow", server="annot", tool="read_*"), Rule("deny", tool="delete_*")))
    asked, out = await run(executor, call("read_item", key="a"))
    assert (asked, out) == ([], "read_item a")
    asked, out = await run(executor, call("delete_item", key="a"))
    assert asked == []
    assert "Tool call annot.delete_item was refused by policy rule 2." in out
    asked, out = await run(executor, call("put_item", key="a", value="b"))
    assert [request.tool_name for request in asked] == ["put_item"]
    assert out == "put_item a=b"


async def test_annotations_decide_for_a_trusted_server_and_are_ignored_for_an_untrusted_one(
    executor: CodeExecutor,
) -> None:
    rules = (
        Rule("deny", annotations={"destructiveHint": True}),
        Rule("allow", annotations={"readOnlyHint": True}),
    )
    executor.policy = Policy(rules, default="ask", trusted_servers={"annot"})
    assert await run(executor, call("list_items")) == ([], "list_items")
    assert "refused" in (await run(executor, call("delete_item", key="x")))[1]
    asked, _out = await run(executor, call("put_item", key="k", value="v"))
    assert [request.tool_name for request in asked] == ["put_item"]
    # A tool without annotations is what the MCP spec says: destructive.
    assert "refused" in (await run(executor, call("plain", text="t")))[1]
    # Untrusted: the read-only claim is not believed, and every tool counts as destructive.
    executor.policy = Policy(rules, default="allow")
    assert "refused" in (await run(executor, call("list_items")))[1]
    assert "refused" in (await run(executor, call("put_item", key="k", value="v")))[1]
    executor.policy = Policy(rules[1:], default="ask")
    asked, _ = await run(executor, call("read_item", key="r"))
    assert [request.tool_name for request in asked] == ["read_item"]


async def test_accepting_for_the_session_allows_that_tool_but_no_other_and_no_denied_one(
    executor: CodeExecutor,
) -> None:
    executor.policy = Policy((Rule("deny", tool="delete_*"),), default="ask")
    asked, _ = await run(executor, call("read_item", key="1"), decide="remember")
    assert len(asked) == 1
    assert await run(executor, call("read_item", key="2")) == ([], "read_item 2")
    asked, _ = await run(executor, call("list_items"), decide="reject")
    assert [request.tool_name for request in asked] == ["list_items"]
    assert "refused" in (await run(executor, call("delete_item", key="x"), decide="remember"))[1]
    # A rule that says deny wins over what the session allowed.
    executor.policy = Policy((Rule("deny", tool="read_*"),), default="ask")
    assert "refused" in (await run(executor, call("read_item", key="3")))[1]


async def test_a_shell_allow_rule_does_not_pass_a_chained_or_substituted_command(
    executor: CodeExecutor,
) -> None:
    executor.policy = Policy(
        (Rule("allow", program=["ls", "echo"]), Rule("deny", program="rm")), default="ask"
    )
    asked, out = await run(executor, "!echo one && echo two")
    assert (asked, out.replace("\r", "")) == ([], "one\ntwo")
    asked, _ = await run(executor, "!ls && touch made_by_chain", decide="reject")
    assert [request.tool_args for request in asked] == [{"cmd": "ls && touch made_by_chain"}]
    assert not exists("made_by_chain")
    asked, out = await run(executor, "!echo $(rm -rf nothing_here)")
    assert asked == []
    assert "The shell command was refused by policy rule 2, so it did not run." in out
    assert records(executor)[-1]["decided_by"] == "rule 2"
    asked, _ = await run(executor, "!echo `id`", decide="reject")
    assert len(asked) == 1
    asked, out = await run(executor, "%%bash\necho in-a-cell\nls /nonexistent-folder || echo fine\n")
    assert asked == []
    assert "in-a-cell" in out


async def test_the_trail_records_each_decision_who_made_it_and_the_outcome_without_secrets(
    executor: CodeExecutor,
) -> None:
    executor.policy = Policy((Rule("allow", tool="read_*"), Rule("deny", tool="delete_*")), default="ask")
    before = len(records(executor))
    await run(executor, call("read_item", key=SECRET))
    await run(executor, call("delete_item", key="d"))
    await run(executor, call("put_item", key="p", value="v"))
    await run(executor, call("list_items"), decide="reject")
    rows = records(executor)[before:]
    summary = [(row["tool"], row["decision"], row["decided_by"], row["outcome"]) for row in rows]
    assert summary == [
        ("read_item", "allowed", "rule 1", "ok"),
        ("delete_item", "denied", "rule 2", "rejected"),
        ("put_item", "allowed", "application", "ok"),
        ("list_items", "denied", "application", "rejected"),
    ]
    assert json.loads(str(rows[0]["arguments"])) == {"key": "***"}
    assert rows[0]["result_size"] and rows[0]["duration_ms"] is not None
    assert SECRET not in trail_bytes().decode(errors="replace")


async def test_a_request_left_when_the_stream_ends_is_recorded_as_abandoned(executor: CodeExecutor) -> None:
    executor.policy = Policy(default="ask")
    stream = executor.stream(call("put_item", key="left", value="behind"))
    async for item in stream:
        if isinstance(item, ApprovalRequest):
            break
    await stream.aclose()
    last = records(executor)[-1]
    assert (last["tool"], last["decision"], last["decided_by"]) == ("put_item", "denied", "abandoned")


async def test_a_script_cells_program_arguments_are_shown_and_read_by_the_rules(
    executor: CodeExecutor,
) -> None:
    # `%%script bash -c '...'` runs the -c, not the cell: the rules must not read only the cell.
    executor.policy = Policy((Rule("allow", program=["ls"]),), default="ask")
    asked, _ = await run(executor, "%%script bash -c 'touch made_by_script_args'\nls\n", decide="reject")
    assert [request.tool_args.get("args") for request in asked] == [["-c", "touch made_by_script_args"]]
    assert not exists("made_by_script_args")
    asked, out = await run(executor, "%%bash\nls /nonexistent-folder 2>/dev/null || ls -d /\n")
    assert (asked, out) == ([], "/")
