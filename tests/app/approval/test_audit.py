"""The audit trail and the policy against hostile kernel code, a crash of the application, and
the ``ipybox audit`` command."""

from __future__ import annotations

# private-ok: the audit trail is read back through its internal reader (as `ipybox audit` does),
# and the CLI's parser and the approval gate are tested directly on their own.
import asyncio
import concurrent.futures
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from ipybox import ApprovalRequest, CodeExecutionError, CodeExecutor, generate_mcp_sources
from ipybox.app.approval._audit import AuditTrail, default_audit_path
from ipybox.mcp_server._cli import parse_args
from ipybox.policy import Policy, Rule
from tests.conftest import TOOL_SERVER_CLIENT
from tests.sandbox_support import require_sandbox

ANNOTATED = Path(__file__).parents[2] / "servers" / "annotated_server.py"
ROOT = Path(__file__).resolve().parents[3]
CANARY = "canary-7f3a"


def rows(session: str | None = None) -> list[dict[str, object]]:
    trail = AuditTrail(default_audit_path())
    try:
        return [record.as_dict() for record in trail.query(session=session)]
    finally:
        trail.close()


@pytest_asyncio.fixture(
    params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["unsandboxed", "sandboxed"]
)
async def executor(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[CodeExecutor]:
    sandbox: bool = request.param
    if sandbox:
        require_sandbox()
    work = tmp_path / "work"
    work.mkdir()
    # The state folder (registry and trail) inside the working directory, the hardest case: the
    # default sandbox hides the home folder and the temporary folder's other entries anyway.
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(work / "state"))
    await generate_mcp_sources(
        "annot", {"command": sys.executable, "args": [str(ANNOTATED)]}, work / "mcptools"
    )
    policy = Policy((Rule("deny", tool="delete_*"), Rule("allow", tool="read_*")), default="ask")
    async with CodeExecutor(working_dir=work, sandbox=sandbox, audit=True, policy=policy) as ex:
        yield ex


HOSTILE = """
import glob, json, os, sqlite3
audit = {audit!r}
seen = {{}}
# The policy: nothing in the environment names it, and the tool server has no way to change it.
seen["env"] = sorted(name for name in os.environ if "POLICY" in name.upper() or "AUDIT" in name.upper())
seen["endpoints"] = [send(m, p, {{"decision": "allow", "tool": "*"}})[0] for m, p in
                     [("PUT", "/policy"), ("POST", "/policy"), ("GET", "/audit"), ("POST", "/rules")]]
# Accepting "for the session" only counts from the application's approval channel.
seen["forged_remember"] = send("POST", "/approve", {{"server_name": "annot", "tool_name": "delete_item",
                               "tool_args": {{}}, "remember": True}})[0]
seen["denied_direct"] = send("POST", "/run", {{"server_name": "annot", "tool_name": "delete_item",
                             "tool_args": {{"key": "x"}}}})[0]
# The trail: read it, then write a forged record into it and wipe it (sandboxed: unsandboxed, the
# kernel runs as the application's user and could; see the README).
if {sandboxed!r}:
  try:
      with open(audit, "rb") as file:
          seen["read"] = {canary!r} in file.read().decode(errors="replace")
  except OSError as exc:
      seen["read"] = type(exc).__name__
  seen["listed"] = glob.glob(os.path.dirname(audit) + "/*")
  try:
      db = sqlite3.connect(audit, timeout=2)
      db.execute("INSERT INTO calls (started, session, server, tool, arguments, decision, decided_by, outcome) "
                 "VALUES (0, 'forged', 'forged', 'forged', '{{}}', 'allowed', 'rule 1', 'ok')")
      db.execute("DELETE FROM calls WHERE session != 'forged'")
      db.commit()
      seen["write"] = "written"
  except Exception as exc:
      seen["write"] = type(exc).__name__
print(json.dumps(seen))
"""


@pytest.mark.slow
async def test_hostile_kernel_code_can_neither_change_the_policy_nor_forge_or_wipe_the_trail(
    executor: CodeExecutor,
) -> None:
    await executor.execute(
        f"from mcptools.annot import read_item\nprint(read_item.run(read_item.Params(key={CANARY!r})))"
    )
    before = rows()
    audit = str(default_audit_path())
    result = await executor.execute(
        TOOL_SERVER_CLIENT + HOSTILE.format(audit=audit, canary=CANARY, sandboxed=executor.settings.sandbox)
    )
    seen = json.loads(result.text or "{}")
    assert seen["env"] == []
    assert seen["endpoints"] == [404, 404, 404, 404]
    assert seen["forged_remember"] == 400
    assert seen["denied_direct"] == 403
    after = rows()
    # Nothing forged and nothing wiped: the records before are all there, and none is the kernel's.
    assert after[: len(before)] == before
    assert all(row["session"] != "forged" for row in after)
    if executor.settings.sandbox:
        # Sandboxed, the kernel cannot even see the trail.
        assert seen["read"] is not True
        assert seen["listed"] == []
    with pytest.raises(CodeExecutionError, match="refused by policy rule"):
        await executor.execute(
            "from mcptools.annot import delete_item\ndelete_item.run(delete_item.Params(key='y'))"
        )
    assert rows(executor.session_id)[-1]["decision"] == "denied"


CRASHING_APP = """
import asyncio, os, sys
from pathlib import Path
from ipybox import CodeExecutor, generate_mcp_sources
from ipybox.policy import Policy

async def main():
    work = Path(sys.argv[1])
    params = {"command": sys.executable, "args": [sys.argv[2], "--gate", sys.argv[3]]}
    await generate_mcp_sources("annot", params, work / "mcptools")
    async with CodeExecutor(working_dir=work, audit=True, policy=Policy(default="allow")) as ex:
        print(ex.session_id, flush=True)
        await ex.execute("from mcptools.annot import slow_write\\nslow_write.run(slow_write.Params(key='k'))")

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_call_under_way_when_the_application_is_killed_is_in_the_trail(tmp_path: Path) -> None:
    work, gate = tmp_path / "work", tmp_path / "gate"
    work.mkdir()
    os.mkfifo(gate)
    app = subprocess.Popen(
        [sys.executable, "-c", CRASHING_APP, str(work), str(ANNOTATED), str(gate)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert app.stdout is not None
    family: list[psutil.Process] = []
    try:
        session = app.stdout.readline().strip()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The other end of the pipe opens once the tool is running: no polling, no sleeping.
            server_pid = int(pool.submit(gate.read_text).result(timeout=90))
        family = psutil.Process(app.pid).children(recursive=True)
        app.send_signal(signal.SIGKILL)
        app.wait(timeout=30)
        records = rows(session)
        assert [(r["server"], r["tool"], r["decision"], r["decided_by"], r["outcome"]) for r in records] == [
            ("annot", "slow_write", "allowed", "default", "running")
        ]
        assert json.loads(str(records[0]["arguments"])) == {"key": "k"}
        assert server_pid in {process.pid for process in family}
    finally:
        app.kill()
        app.wait()
        app.stdout.close()
        for process in family:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=30)


def _fill(path: Path) -> None:
    trail = AuditTrail(path)
    first = trail.begin(
        session="s1",
        server="files",
        tool="read",
        arguments={"p": "a"},
        decision="allowed",
        decided_by="rule 1",
    )
    trail.end(first, outcome="ok", duration_ms=1.5, result_size=10)
    trail.begin(
        session="s2",
        server="files",
        tool="delete",
        arguments={"p": "\x1b[31mred"},
        decision="denied",
        decided_by="rule 2",
        outcome="rejected",
    )
    trail.close()


def _audit(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ipybox.mcp_server", "audit", "--db", str(db), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_ipybox_audit_lists_and_filters_the_trail_as_a_table_and_as_json(tmp_path: Path) -> None:
    db = tmp_path / "audit.sqlite3"
    _fill(db)
    table = _audit(db=db)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:6] == ["id", "time", "session", "server", "tool", "decision"]
    assert len(lines) == 3
    assert "\x1b" not in table.stdout  # shown escaped, never sent to the terminal
    denied = _audit("--decision", "denied", "--json", db=db)
    assert [json.loads(line)["tool"] for line in denied.stdout.splitlines()] == ["delete"]
    assert [
        json.loads(line)["session"] for line in _audit("--session", "s1", "--json", db=db).stdout.splitlines()
    ] == ["s1"]
    assert (
        _audit("--tool", "read", "--server", "files", "--since", "1h", "--json", db=db).stdout.count("\n")
        == 1
    )
    assert _audit("--since", "yesterday-ish", db=db).returncode == 2
    assert _audit(db=tmp_path / "missing.sqlite3").returncode == 1


def test_the_audit_command_leaves_the_servers_own_options_as_they_were(tmp_path: Path) -> None:
    args = parse_args(["--workspace", str(tmp_path)])
    assert (args.workspace, args.audit, args.policy) == (tmp_path, True, None)
    assert parse_args(["--workspace", str(tmp_path), "--no-audit"]).audit is False


def test_a_policy_file_inside_the_workspace_or_with_a_typo_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inside = tmp_path / "policy.toml"
    inside.write_text('default = "allow"\n')
    with pytest.raises(SystemExit):
        parse_args(["--workspace", str(tmp_path), "--policy", str(inside)])
    assert "lies in the workspace" in capsys.readouterr().err
    outside = tmp_path.parent / f"{tmp_path.name}-policy.toml"
    outside.write_text(textwrap.dedent('default = "ask"\n[[rule]]\ndecision = "allow"\ntoll = "x"\n'))
    with pytest.raises(SystemExit):
        parse_args(["--workspace", str(tmp_path), "--policy", str(outside)])
    assert "line 4" in capsys.readouterr().err


def test_the_trail_database_is_private_to_its_user(tmp_path: Path) -> None:
    path = tmp_path / "state" / "audit" / "audit.sqlite3"
    trail = AuditTrail(path)
    trail.open()
    trail.close()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.slow
async def test_walled_shell_commands_follow_the_policy_and_are_recorded_with_their_outcome(
    tmp_path: Path,
) -> None:
    """Sandboxed with shell approval, commands run on the tool server (POST /shell): the same rules apply."""
    require_sandbox()
    if sys.platform != "linux":
        pytest.skip("the exec wall is Linux only")
    work = tmp_path / "work"
    work.mkdir()
    policy = Policy((Rule("allow", program=["echo", "ls"]),), default="ask")
    async with CodeExecutor(
        working_dir=work, sandbox=True, approve_shell_cmds=True, audit=True, policy=policy
    ) as ex:
        result = await ex.execute("!echo walled && ls")
        assert "walled" in (result.text or "")
        asked = []
        with pytest.raises(CodeExecutionError, match="rejected"):
            async for item in ex.stream("!echo x; touch made_by_chain"):
                if isinstance(item, ApprovalRequest):
                    asked.append(item.tool_args)
                    await item.reject()
        assert asked == [{"cmd": "echo x; touch made_by_chain"}]
        records = rows(ex.session_id)
    assert [(r["tool"], r["decision"], r["decided_by"], r["outcome"]) for r in records] == [
        ("shell", "allowed", "rule 1", "ok"),
        ("shell", "denied", "application", "rejected"),
    ]
    assert records[0]["result_size"]
    assert not (work / "made_by_chain").exists()


async def test_an_approval_that_expires_is_recorded_as_decided_by_the_timeout(tmp_path: Path) -> None:
    from ipybox.app.approval._gate import Gate
    from ipybox.tool_exec.approval.client import ApprovalClient
    from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
    from ipybox.tool_exec.server import ToolServer

    trail = AuditTrail(tmp_path / "audit.sqlite3")
    asked: list[ApprovalRequest] = []
    seen = asyncio.Event()

    async def never_decide(request: ApprovalRequest) -> None:
        asked.append(request)
        seen.set()

    params = {"command": sys.executable, "args": [str(ANNOTATED)]}
    async with ToolServer(
        port=0,
        approval_required=True,
        approval_timeout=0.5,
        trust_all_clients=True,
        gate=Gate(None, trail, "expiring"),
    ) as server:
        async with ApprovalClient(callback=never_decide, port=server.port):
            runner = ToolRunner(server_name="annot", server_params=params, port=server.port)
            with pytest.raises(ToolRunnerError, match="expired"):
                await runner.run("put_item", {"key": "k", "value": "v"})
            await runner.aclose()
            # The client's handler runs in a task of its own: on a stalled loop the expiry may
            # come first; the client stays open until the handler has seen the request.
            await seen.wait()
    [record] = trail.query(session="expiring")
    trail.close()
    assert len(asked) == 1
    assert (record.decision, record.decided_by, record.outcome) == ("denied", "timeout", "expired")
