"""Attacks on what the person and the audit trail are told: hidden cells, kernel-chosen names, huge calls.

Hostile code runs in a real kernel, behind the real ``ipybox`` server (over stdio, with
``--approve-tool-calls``) or a real `CodeExecutor`; each test passes when the attack fails.
"""

from __future__ import annotations

# private-ok: the question builder and the audit CLI's table are internal; the attacks aim at them.
import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from mcp.client import Client

from ipybox import CodeExecutor
from ipybox.app.approval._audit import AuditRecord, AuditTrail
from ipybox.app.approval._client import ApprovalRequest
from tests.conftest import DEMO_SERVER, TOOL_SERVER_CLIENT
from tests.mcp_server.support import connected, own_state, run, stdio_params, text_of
from tests.mcp_server.test_approve_tool_calls import Person

pytestmark = pytest.mark.asyncio(loop_scope="module")

_DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("trail").resolve()
    with own_state(path):
        yield path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def asked(workspace: Path) -> AsyncIterator[tuple[Client, Person]]:
    """A client of ``ipybox --approve-tool-calls`` over stdio whose person answers as told."""
    person = Person()
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", "120")
    async with connected(params, elicitation_callback=person, mode="legacy") as client:
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": _DEMO}
        )
        assert not registered.is_error, text_of(registered)
        yield client, person


def _trail(workspace: Path) -> list[AuditRecord]:
    """The trail of the module's server (whose state folder `own_state` put beside the workspace)."""
    trail = AuditTrail(workspace.parent / f"{workspace.name}-state" / "audit" / "audit.sqlite3")
    try:
        return trail.query()
    finally:
        trail.close()


# Kernel code hooks the two places the server's refresh cell used to reach: a finder on
# sys.meta_path (importlib.invalidate_caches() calls every finder's invalidate_caches) and IPython's
# post_run_cell event, which fires after every cell that is not silent, the server's own too. Each
# makes a tool call and keeps what happened to it.
_HOOKS = """
import sys
from mcptools.demo.add import Params, run
hooked = {"finder": [], "event": []}
def _call(where):
    try:
        hooked[where].append(f"ran: {run(Params(a=40, b=2)).sum}")
    except Exception as exc:
        hooked[where].append(f"refused: {exc}")
class _Finder:
    def find_spec(self, *args, **kwargs):
        return None
    def invalidate_caches(self):
        _call("finder")
sys.meta_path.insert(0, _Finder())
def _after(result):
    if "_ipybox" + "_refresh(" in (result.info.raw_cell or ""):
        _call("event")
get_ipython().events.register("post_run_cell", _after)
"""


async def test_a_tool_call_made_by_kernel_hooks_during_the_servers_own_cell_is_refused_and_recorded(
    asked: tuple[Client, Person], workspace: Path
) -> None:
    """Attack: after ``register_mcp_server`` the server runs a refresh cell of its own, which approved
    every call made while it ran (and called the kernel's finders): hooks the kernel planted made tool
    calls that nobody was asked about, under ``--approve-tool-calls``, recorded as decided by the
    application. Now no finder of the kernel's is called, and a call made during such a cell is
    rejected unasked, with the trail saying so."""
    client, person = asked
    person.answer, person.asked = "accept", []
    planted = await run(client, _HOOKS)
    assert not planted.is_error, text_of(planted)
    again = await client.call_tool("register_mcp_server", {"server_name": "demo", "server_params": _DEMO})
    assert not again.is_error, text_of(again)
    seen = await run(client, "print(hooked)")
    hooked = eval(text_of(seen))  # the kernel's own dict, printed
    assert hooked["finder"] == [], hooked
    assert len(hooked["event"]) == 1, hooked
    [event] = hooked["event"]
    assert event.startswith("refused:") and "rejected" in event and "on its own" in event, event
    assert person.asked == []
    last = [record for record in _trail(workspace) if record.tool == "add"][-1]
    assert (last.decision, last.decided_by, last.outcome) == ("denied", "hidden cell", "rejected")


async def test_a_call_the_person_declines_is_reported_and_recorded_as_declined_by_the_person(
    asked: tuple[Client, Person], workspace: Path
) -> None:
    client, person = asked
    person.answer, person.asked = "decline", []
    result = await run(client, "from mcptools.demo.add import Params, run\nrun(Params(a=1, b=2))")
    assert "rejected by the person at the MCP client" in text_of(result), text_of(result)
    assert "by the application" not in text_of(result)
    last = [record for record in _trail(workspace) if record.tool == "add"][-1]
    assert (last.decision, last.decided_by) == ("denied", "person at MCP client")
    person.answer = "accept"
    accepted = await run(
        client, "from mcptools.demo.add import Params, run\nprint(run(Params(a=1, b=2)).sum)"
    )
    assert text_of(accepted) == "3", text_of(accepted)
    last = [record for record in _trail(workspace) if record.tool == "add"][-1]
    assert (last.decision, last.decided_by, last.outcome) == ("allowed", "person at MCP client", "ok")


async def test_the_person_sees_the_head_and_tail_of_a_huge_call_and_an_oversized_one_is_refused(
    asked: tuple[Client, Person], workspace: Path
) -> None:
    """A call of megabytes is put to the person as its head and tail, with the size and SHA-256 of
    what is left out (which kernel code can check against what it sent); one over the limit is
    rejected without asking, and the trail says why."""
    from ipybox.mcp_server import _question

    client, person = asked
    person.answer, person.asked = "decline", []
    middle = "x" * (3 * 1024 * 1024)
    code = (
        f"from mcptools.demo.echo import Params, run\nrun(Params(text='START' + 'x' * {len(middle)} + 'END'))"
    )
    result = await run(client, code)
    assert "rejected by the person" in text_of(result), text_of(result)
    [message] = person.asked
    assert len(message) < 5000
    assert "START" in message and message.endswith("END')")
    full = f"demo.echo(text='START{middle}END')"
    missing = full[_question.HEAD_CHARS : len(full) - _question.TAIL_CHARS]
    assert f"{len(missing)} characters left out of {len(full)}" in message, message[:600]
    assert hashlib.sha256(missing.encode()).hexdigest() in message
    person.asked = []
    over = _question.MAX_CALL_CHARS + 1024
    refused = await run(client, f"from mcptools.demo.echo import Params, run\nrun(Params(text='y' * {over}))")
    assert "too large to show to the person" in text_of(refused), text_of(refused)
    assert person.asked == []
    last = [record for record in _trail(workspace) if record.tool == "echo"][-1]
    assert (last.decision, last.decided_by) == ("denied", "too large to ask")


async def test_the_question_about_a_huge_call_is_built_while_the_event_loop_serves_other_sessions() -> None:
    """Attack: one session's call of megabytes had its question built on the event loop (a regular
    expression over the whole text, seconds long) while no other session was served. The question is
    built in a worker thread, piece by piece: another session's task gets turns before it is ready."""

    from ipybox.mcp_server import _question

    async def never(*args: object, **kwargs: object) -> bool:  # no decision is sent in this test
        raise AssertionError("not decided here")

    request = ApprovalRequest("demo", "echo", {"text": "ab\x00 " * (1024 * 1024)}, never)
    question = asyncio.ensure_future(_question.question(request))
    turns = 0
    while not question.done():
        # The other session: each turn it gets is one the event loop gave it while the question was built.
        await asyncio.sleep(0)
        turns += 1
    text = question.result()
    assert text is not None and "characters left out" in text
    assert turns > 1


async def _audit(db: Path, *args: str) -> str:
    """What ``ipybox audit`` prints for the trail `db`."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "ipybox.mcp_server", "audit", "--db", str(db), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


_SPOOF = "\x1b[2J\x1b[H\rid  time  session  server  tool\n1  2026-01-01  x  files  read  allowed"


async def test_kernel_chosen_names_are_refused_before_they_reach_the_trail(tmp_path: Path) -> None:
    """Attack: a call with a server or tool name of terminal escapes (a screen clear and a fake
    table) or of megabytes was recorded though it failed before any decision, and the trail grew
    without bound. Such names are refused at the tool server before anything is recorded."""
    db = tmp_path / "audit.sqlite3"
    async with CodeExecutor(audit=db, working_dir=tmp_path) as executor:
        code = (
            TOOL_SERVER_CLIENT
            + f"spoof = {_SPOOF!r}\n"
            + "for server, tool in [(spoof, 't'), ('demo', spoof), ('s' * 2_000_000, 't'), ('demo', 't' * 300)]:\n"
            + "    status, text = send('POST', '/run', {'server_name': server, 'tool_name': tool, 'tool_args': {}})\n"
            + "    print(status, 'refused before anything was asked, run or recorded' in text)\n"
        )
        result = await executor.execute(code)
        assert result.text == "\n".join(["400 True"] * 4), result.text
        # A name of printable text within the cap is recorded (and fails as unknown).
        await executor.execute(
            TOOL_SERVER_CLIENT + "send('POST', '/run', {'server_name': 'nosuch', 'tool_name': 't'})"
        )
    trail = AuditTrail(db)
    records = trail.query()
    trail.close()
    assert [(record.server, record.tool) for record in records] == [("nosuch", "t")]


async def test_ipybox_audit_prints_every_text_column_escaped_on_one_line(tmp_path: Path) -> None:
    """Records written before names were checked (or by anything else that writes the database) hold
    escapes in any column; ``ipybox audit`` shows each on one line, escaped, and --json in ASCII."""
    db = tmp_path / "audit.sqlite3"
    trail = AuditTrail(db)
    for column in ("session", "server", "tool", "decided_by"):
        fields = {"session": "s", "server": "demo", "tool": "t", "decided_by": "application"}
        fields[column] = "\u202e\x9b31m" + _SPOOF
        trail.begin(
            session=fields["session"],
            server=fields["server"],
            tool=fields["tool"],
            decided_by=fields["decided_by"],
            arguments={"a": _SPOOF},
            decision="allowed",
        )
    trail.close()
    table = await _audit(db)
    lines = table.splitlines()
    assert len(lines) == 5, table
    assert all(line.isprintable() for line in lines), table
    assert "\\x1b[2J" in table and "\\u202e" in table
    as_json = await _audit(db, "--json")
    assert as_json.isascii() and len(as_json.splitlines()) == 4
    assert json.loads(as_json.splitlines()[0])["session"].endswith(_SPOOF)


async def test_a_huge_error_message_is_kept_cut_in_the_trail(tmp_path: Path) -> None:
    """An MCP server's error message (of any size) goes into the record's error column: cut there."""
    trail = AuditTrail(tmp_path / "audit.sqlite3")
    record = trail.begin(
        session="s", server="demo", tool="t", arguments={}, decision="allowed", decided_by="application"
    )
    trail.end(record, outcome="failed", duration_ms=1.0, result_size=None, error="e" * 5_000_000)
    [kept] = trail.query()
    trail.close()
    assert kept.error is not None and len(kept.error) < 5000 and kept.error.endswith("(5000000 characters)")
