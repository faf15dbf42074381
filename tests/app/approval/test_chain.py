"""The one decision chain (`ipybox.app.approval._chain`): every kind of call goes through it, and
nothing else can allow one.

Each kind of call runs in a real kernel, once with a chain that refuses everything and once with
one that allows everything; the audit trail shows the chain's record of each. The source is read
(its AST) to show that only the chain makes the `Permit` that the code running a call requires.
"""

from __future__ import annotations

# private-ok: the chain, its permit and the audit trail's reader are internal; they are what is tested.
import ast
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
import pytest_asyncio

from ipybox import ApprovalRequest, CodeExecutionError, CodeExecutor, generate_mcp_sources
from ipybox.app.approval._audit import AuditTrail
from ipybox.app.approval._chain import Permit
from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway
from ipybox.policy import Policy
from ipybox.tool_exec.approval.client import ApprovalClient
from ipybox.tool_exec.server import ToolServer
from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, own_state, run, stdio_params, text_of
from tests.mcp_server.test_approve_tool_calls import Person
from tests.sandbox_support import require_sandbox

SRC = Path(__file__).resolve().parents[3] / "src" / "ipybox"
CHAIN = SRC / "app" / "approval" / "_chain.py"
DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
GREET = "from mcptools.demo.greet import Params, run\nprint(run(Params(name='agent')))"
# What each verdict leaves in the trail: (decision, decided by, outcome).
RECORDED = {"deny": ("denied", "default", "rejected"), "allow": ("allowed", "default", "ok")}


def records(trail_path: Path, session: str) -> list[tuple[object, ...]]:
    trail = AuditTrail(trail_path)
    try:
        return [
            (record.server, record.tool, record.decision, record.decided_by, record.outcome)
            for record in trail.query(session=session)
        ]
    finally:
        trail.close()


@pytest_asyncio.fixture
async def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Path]:
    """A working directory with the demo server's API, and a state folder (registry) of its own."""
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(tmp_path / "state"))
    folder = tmp_path / "work"
    folder.mkdir()
    await generate_mcp_sources("demo", DEMO, folder / "mcptools")
    yield folder


@pytest.mark.parametrize("channel", ["http", "stdin"])
@pytest.mark.parametrize("verdict", ["deny", "allow"])
async def test_a_tool_call_from_the_kernel_runs_only_when_the_chain_allows_it(
    work: Path, tmp_path: Path, channel: Literal["http", "stdin"], verdict: str
) -> None:
    """Tool calls over HTTP (POST /run) and over the kernel's stdin channel, with the session's gate."""
    trail = tmp_path / "audit.sqlite3"
    policy = Policy(default="deny" if verdict == "deny" else "allow")
    async with CodeExecutor(working_dir=work, audit=trail, policy=policy, tool_channel=channel) as ex:
        if verdict == "deny":
            with pytest.raises(CodeExecutionError, match="refused by the policy"):
                await ex.execute(GREET)
        else:
            assert "Hello, agent!" in ((await ex.execute(GREET)).text or "")
        session = ex.session_id
    assert records(trail, session) == [("demo", "greet", *RECORDED[verdict])]


@pytest.mark.parametrize("verdict", ["reject", "accept"])
async def test_a_tool_call_the_rules_leave_open_runs_only_once_the_application_accepts_it(
    work: Path, tmp_path: Path, verdict: str
) -> None:
    """The chain's question to the application: the answer is recorded as the application's."""
    trail = tmp_path / "audit.sqlite3"
    asked: list[str] = []
    async with CodeExecutor(working_dir=work, audit=trail) as ex:
        try:
            async for item in ex.stream(GREET):
                if isinstance(item, ApprovalRequest):
                    asked.append(item.tool_name)
                    await (item.accept() if verdict == "accept" else item.reject())
        except CodeExecutionError as exc:
            assert verdict == "reject" and "rejected by the application" in str(exc)
        session = ex.session_id
    assert asked == ["greet"]
    expected = (
        ("allowed", "application", "ok") if verdict == "accept" else ("denied", "application", "rejected")
    )
    assert records(trail, session) == [("demo", "greet", *expected)]


@pytest.mark.parametrize("verdict", ["deny", "allow"])
async def test_a_shell_command_the_kernel_runs_itself_runs_only_when_the_chain_allows_it(
    tmp_path: Path, verdict: str
) -> None:
    """``!cmd`` with shell approval: the kernel asks (POST /approve) and runs the command once allowed."""
    work = tmp_path / "work"
    work.mkdir()
    trail = tmp_path / "audit.sqlite3"
    policy = Policy(default="deny" if verdict == "deny" else "allow")
    async with CodeExecutor(working_dir=work, audit=trail, policy=policy, approve_shell_cmds=True) as ex:
        if verdict == "deny":
            with pytest.raises(CodeExecutionError, match="refused by the policy"):
                await ex.execute("!touch made")
        else:
            await ex.execute("!touch made")
        session = ex.session_id
    assert (work / "made").exists() == (verdict == "allow")
    decision, by, outcome = RECORDED[verdict]
    assert records(trail, session) == [
        ("ipybox", "shell", decision, by, "approved" if verdict == "allow" else outcome)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("verdict", ["deny", "allow"])
async def test_a_shell_command_of_a_walled_kernel_runs_only_when_the_chain_allows_it(
    tmp_path: Path, verdict: str
) -> None:
    """``%%bash`` in a sandboxed kernel that cannot start programs: the tool server runs it (POST /shell)."""
    require_sandbox()
    if sys.platform != "linux":
        pytest.skip("the exec wall is Linux only")
    work = tmp_path / "work"
    work.mkdir()
    trail = tmp_path / "audit.sqlite3"
    policy = Policy(default="deny" if verdict == "deny" else "allow")
    async with CodeExecutor(
        working_dir=work, sandbox=True, approve_shell_cmds=True, audit=trail, policy=policy
    ) as ex:
        if verdict == "deny":
            with pytest.raises(CodeExecutionError, match="refused by the policy"):
                await ex.execute("%%bash\ntouch made")
        else:
            await ex.execute("%%bash\ntouch made")
        session = ex.session_id
    assert (work / "made").exists() == (verdict == "allow")
    assert records(trail, session) == [("ipybox", "shell_magic", *RECORDED[verdict])]


@pytest.mark.parametrize("verdict", ["reject", "accept"])
async def test_a_tool_call_of_a_tool_server_without_a_gate_runs_only_when_the_application_accepts_it(
    tmp_path: Path, verdict: str
) -> None:
    """A standalone `ToolServer` (no policy, no trail) and a kernel of a standalone gateway."""
    asked: list[str] = []

    async def decide(request: ApprovalRequest) -> None:
        asked.append(request.tool_name)
        await (request.accept() if verdict == "accept" else request.reject())

    code = (
        "from ipybox.tool_exec.client import ToolRunner, ToolRunnerError\n"
        "runner = ToolRunner('demo', DEMO, port=PORT)\n"
        "try:\n"
        "    print('result', runner.run_sync('greet', {'name': 'agent'}))\n"
        "except ToolRunnerError as exc:\n"
        "    print('refused', exc)\n"
    )
    async with (
        ToolServer(port=0, trust_all_clients=True) as server,
        ApprovalClient(callback=decide, port=server.port),
        KernelGateway(port=0) as gateway,
        KernelClient(port=gateway.port) as kernel,
    ):
        result = await kernel.execute(f"DEMO = {DEMO!r}\nPORT = {server.port}\n{code}")
    text = result.text or ""
    assert asked == ["greet"]
    if verdict == "accept":
        assert "result Hello, agent!" in text
    else:
        assert "refused" in text and "rejected by the application" in text


@pytest.mark.parametrize("answer", ["decline", "accept"])
async def test_a_question_to_the_person_at_the_mcp_client_is_the_chain_asking(
    tmp_path: Path, answer: str
) -> None:
    """``ipybox --approve-tool-calls``: the person answers an elicitation; the chain records their answer."""
    workspace = (tmp_path / "workspace").resolve()
    workspace.mkdir()
    person = Person()
    person.answer = answer
    with own_state(workspace):
        params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", "120")
        async with connected(params, elicitation_callback=person, mode="legacy") as client:
            registered = await client.call_tool(
                "register_mcp_server", {"server_name": "demo", "server_params": DEMO}
            )
            assert not registered.is_error, text_of(registered)
            result = await run(client, GREET)
    assert len(person.asked) == 1 and "demo.greet" in person.asked[0]
    if answer == "accept":
        assert "Hello, agent!" in text_of(result)
    else:
        assert "rejected by the person at the MCP client" in text_of(result)
    trail = AuditTrail(workspace.parent / f"{workspace.name}-state" / "audit" / "audit.sqlite3")
    try:
        rows = [
            (r.server, r.tool, r.decision, r.decided_by, r.outcome)
            for r in trail.query()
            if r.server == "demo"
        ]
    finally:
        trail.close()
    expected = ("allowed", "ok") if answer == "accept" else ("denied", "rejected")
    assert rows == [("demo", "greet", expected[0], "person at MCP client", expected[1])]


def _calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Every call in `tree` with the name it calls (a function's or an attribute's)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            found.append((node, name))
    return found


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(SRC.rglob("*.py"))]


def test_only_the_chain_makes_a_permit_or_asks_the_application_or_applies_the_rules() -> None:
    """Permits, questions to the application (the approval channel's ``ask``), the rules' verdicts,
    the session's acceptances and the audit records of decisions are made in one module only."""
    made_elsewhere = [
        f"{path.relative_to(SRC)}:{node.lineno} {name}"
        for path, tree in _modules()
        if path != CHAIN
        for node, name in _calls(tree)
        if name in {"Permit", "verdict", "remember"}
        or (name == "ask" and "channel" in ast.unparse(node.func))
        or (name == "begin" and "audit" in ast.unparse(node.func))
    ]
    assert made_elsewhere == []


def test_the_code_that_runs_a_call_requires_a_permit() -> None:
    """Each function that runs a tool (``call_tool_content``) or a shell command for a kernel
    (``run_while_connected``) takes a `Permit` parameter; the MCP session itself is exempt."""
    runners = {"call_tool_content", "call_tool", "run_while_connected"}
    exempt = {SRC / "app" / "mcp_client" / "_session.py"}
    without_permit = []
    checked = 0
    for path, tree in _modules():
        if path in exempt:
            continue
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            runs = [name for _, name in _calls(function) if name in runners]
            if not runs:
                continue
            checked += 1
            arguments = function.args.args + function.args.kwonlyargs
            annotations = [ast.unparse(arg.annotation) for arg in arguments if arg.annotation is not None]
            if "Permit" not in annotations:
                without_permit.append(f"{path.relative_to(SRC)}:{function.lineno} {function.name}")
    assert checked >= 2  # the tool call's runner and the walled shell command's
    assert without_permit == []


def test_a_permit_cannot_be_made_outside_the_chain() -> None:
    with pytest.raises(TypeError, match="Only the decision chain"):
        Permit(object(), "demo", "greet", "forged")
