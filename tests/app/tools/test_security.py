"""The secured mode, attacked the way hostile code in a kernel would (README, "How it fits together").

S1: kernel code cannot make the tool server start a process or reach a URL it chose (only
registered servers run); S2: kernel code cannot approve, hijack or replay approval; S3:
secrets named as ``${VAR}`` never reach the kernel; S4: calls need the executor's token.

The attacker knows what the kernel knows: the tool server's address and its token (both are
in the kernel's environment), but not the approval secret. It uses plain HTTP and WebSocket
clients, not ipybox's own.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

# Private: the kernel-side client's cached runners are closed after a test (no public way); the
# registry names are public in ipybox.tool_exec.server too.
from ipybox.app.mcp_client._registry import ServerRegistry, default_registry
from ipybox.kernel import _tool_client as client_module
from ipybox.tool_exec.approval.client import ApprovalClient, ApprovalRequest
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError, run_tool
from ipybox.tool_exec.server import ToolServer
from tests.app.tools.support import descendants
from tests.conftest import DEMO_SERVER

TOKEN = "kernel-token-0123456789"
SECRET = "approval-secret-9876543210"


@pytest.fixture
def registry(demo_params: dict[str, Any]) -> ServerRegistry:
    registry = default_registry()
    registry.register("demo", demo_params)
    return registry


@pytest.fixture
async def secured(registry: ServerRegistry) -> AsyncIterator[ToolServer]:
    async with ToolServer(
        port=0,
        approval_required=True,
        approval_timeout=5,
        log_level="WARNING",
        registry=registry,
        token=TOKEN,
        approval_secret=SECRET,
    ) as server:
        yield server


async def accept_all(request: ApprovalRequest) -> None:
    await request.accept()


def kernel_http(server: ToolServer, token: str | None = TOKEN) -> httpx2.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx2.AsyncClient(base_url=f"http://localhost:{server.port}", headers=headers, timeout=10)


# --- S1: only registered servers ------------------------------------------------------------


@pytest.mark.parametrize("server_name", ["demo", "made-up"])
async def test_s1_a_run_with_a_made_up_command_is_refused_and_starts_nothing(
    secured: ToolServer, tmp_path: Path, server_name: str
) -> None:
    marker = tmp_path / "pwned"
    before = descendants()
    async with ApprovalClient(accept_all, port=secured.port, secret=SECRET), kernel_http(secured) as http:
        response = await http.post(
            "/run",
            json={
                "server_name": server_name,
                "tool_name": "anything",
                "tool_args": {},
                "server_params": {"command": "sh", "args": ["-c", f"touch {marker}"]},
            },
        )
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["kind"] == "failed"
    assert "runs only MCP servers registered by the application" in error["message"]
    assert not marker.exists()
    assert descendants() <= before
    assert secured._sessions == {}  # private: no public view of the servers the tool server started


async def test_s1_a_run_with_a_url_carrying_a_secret_placeholder_is_refused_and_connects_nowhere(
    secured: ToolServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPYBOX_T_APP_SECRET", "the-applications-secret")
    with socket.socket() as listener:  # the attacker's endpoint
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/mcp"
        async with kernel_http(secured) as http:
            response = await http.post(
                "/run",
                json={
                    "server_name": "demo",
                    "tool_name": "echo",
                    "tool_args": {},
                    "server_params": {"url": url, "headers": {"X-Leak": "${IPYBOX_T_APP_SECRET}"}},
                },
            )
        assert response.status_code == 403
        assert "the-applications-secret" not in response.text
        with pytest.raises(BlockingIOError):
            listener.accept()


async def test_s1_an_unregistered_server_name_is_refused(secured: ToolServer) -> None:
    async with kernel_http(secured) as http:
        response = await http.post(
            "/run", json={"server_name": "unknown", "tool_name": "echo", "tool_args": {}}
        )
    assert response.status_code == 404
    assert "'unknown' is not registered" in response.json()["error"]["message"]


async def test_s1_a_registered_server_runs_by_name_only(secured: ToolServer) -> None:
    async with ApprovalClient(accept_all, port=secured.port, secret=SECRET):
        runner = ToolRunner("demo", {}, port=secured.port, token=TOKEN)
        assert await asyncio.to_thread(runner.run_sync, "add", {"a": 3, "b": 4}) == {"sum": 7}


async def test_s1_a_server_registered_by_another_process_is_found(
    secured: ToolServer, tmp_path: Path
) -> None:
    code = (
        "import sys\n"
        "from ipybox.app.mcp_client._registry import default_registry\n"
        "default_registry().register('late', {'command': sys.executable, 'args': [sys.argv[1]]})\n"
    )
    demo = DEMO_SERVER
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, str(demo))
    assert await process.wait() == 0
    async with ApprovalClient(accept_all, port=secured.port, secret=SECRET):
        runner = ToolRunner("late", {}, port=secured.port, token=TOKEN)
        assert await runner.run("echo", {"text": "found"}) == "found"


# --- S2: approval cannot be hijacked ---------------------------------------------------------


@pytest.mark.parametrize("secret", [None, "guessed-secret"])
async def test_s2_a_rogue_approval_client_without_the_secret_cannot_connect(
    secured: ToolServer, secret: str | None
) -> None:
    with pytest.raises(ConnectionError, match="refused the approval connection"):
        await ApprovalClient(accept_all, port=secured.port, secret=secret).connect()
    headers = {"Authorization": f"Bearer {secret}"} if secret else None
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(f"ws://localhost:{secured.port}/approval", additional_headers=headers):
            pass
    assert info.value.response.status_code == 403
    assert not secured._channel.open  # private: whether an approval client is attached is not exposed


async def test_s2_a_second_client_cannot_displace_the_first(secured: ToolServer) -> None:
    decided_by: list[str] = []

    async def first(request: ApprovalRequest) -> None:
        decided_by.append("first")
        await request.accept()

    async def second(request: ApprovalRequest) -> None:
        decided_by.append("second")
        await request.accept()

    async with ApprovalClient(first, port=secured.port, secret=SECRET):
        # Even with the secret (say it leaked), a second connection is refused while the first is open.
        with pytest.raises(ConnectionError, match="refused"):
            await ApprovalClient(second, port=secured.port, secret=SECRET).connect()
        runner = ToolRunner("demo", {}, port=secured.port, token=TOKEN)
        assert await runner.run("echo", {"text": "x"}) == "x"
    assert decided_by == ["first"]


async def test_s2_replayed_or_premature_decisions_do_nothing(secured: ToolServer) -> None:
    runner = ToolRunner("demo", {}, port=secured.port, token=TOKEN)
    headers = {"Authorization": f"Bearer {SECRET}"}
    async with ws_connect(f"ws://localhost:{secured.port}/approval", additional_headers=headers) as ws:
        first_call = asyncio.create_task(runner.run("echo", {"text": "one"}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert first["method"] == "approve"
        assert first["params"] == {"server_name": "demo", "tool_name": "echo", "tool_args": {"text": "one"}}
        accept = {"jsonrpc": "2.0", "id": first["id"], "result": True}
        await ws.send(json.dumps(accept))
        assert await first_call == "one"

        async def notice() -> dict[str, object]:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert message["method"] == "decided"
            return dict(message["params"])

        assert await notice() == {"id": first["id"], "taken": True}
        # A replay of that decision, and a rejection sent ahead for the next id, are both ignored,
        # and the server says so.
        await ws.send(json.dumps(accept))
        assert await notice() == {"id": first["id"], "taken": False}
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": first["id"] + 1, "result": False}))
        assert await notice() == {"id": first["id"] + 1, "taken": False}
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": first["id"] + 1, "result": "yes"}))
        second_call = asyncio.create_task(runner.run("echo", {"text": "two"}))
        second = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert second["id"] == first["id"] + 1
        assert not second_call.done()
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": second["id"], "result": True}))
        assert await second_call == "two"


# --- S4: the token ---------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
async def test_s4_requests_without_the_right_token_are_refused(
    secured: ToolServer, token: str | None
) -> None:
    before = descendants()
    async with kernel_http(secured, token=token) as http:
        run = await http.post("/run", json={"server_name": "demo", "tool_name": "echo", "tool_args": {}})
        reset = await http.put("/reset")
        status = await http.get("/status")
    assert run.status_code == 401
    assert reset.status_code == 401
    assert run.json()["error"]["kind"] == "failed"
    assert "token" in run.json()["error"]["message"]
    assert status.status_code == 200
    assert descendants() <= before


@pytest.mark.parametrize(
    "authorization",
    [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER   {TOKEN}"],
)
async def test_s4_the_token_is_accepted_with_any_case_of_the_scheme_and_spaces_after_it(
    secured: ToolServer, authorization: str
) -> None:
    # One rule for every endpoint (ipybox._infra.BearerToken): the hot /run path and the others.
    async with httpx2.AsyncClient(
        base_url=f"http://localhost:{secured.port}", headers={"Authorization": authorization}, timeout=10
    ) as http:
        run = await http.post("/run", json={"server_name": "unknown", "tool_name": "echo", "tool_args": {}})
        reset = await http.put("/reset")
    assert run.status_code == 404  # past the token check: the server is not registered
    assert reset.status_code == 200


@pytest.mark.parametrize(
    "authorization",
    [TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN[:-1]}", f"Bearer{TOKEN}", "Bearer"],
)
async def test_s4_a_near_miss_of_the_token_is_refused(secured: ToolServer, authorization: str) -> None:
    async with httpx2.AsyncClient(
        base_url=f"http://localhost:{secured.port}", headers={"Authorization": authorization}, timeout=10
    ) as http:
        run = await http.post("/run", json={"server_name": "demo", "tool_name": "echo", "tool_args": {}})
        reset = await http.put("/reset")
    assert run.status_code == 401 and reset.status_code == 401


async def test_s2_the_approval_secret_follows_the_same_rule_as_the_token(secured: ToolServer) -> None:
    url = f"ws://localhost:{secured.port}/approval"
    async with ws_connect(url, additional_headers={"Authorization": f"bearer  {SECRET}"}):
        pass
    for authorization in (SECRET, f"Bearer {SECRET.upper()}", f"Basic {SECRET}"):
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(url, additional_headers={"Authorization": authorization}):
                pass
        assert info.value.response.status_code == 403


async def test_s4_a_runner_with_a_wrong_token_gets_a_failed_error(secured: ToolServer) -> None:
    runner = ToolRunner("demo", {}, port=secured.port, token="nope")
    with pytest.raises(ToolRunnerError) as info:
        await asyncio.to_thread(runner.run_sync, "echo", {"text": "x"})
    assert info.value.kind == "failed"
    with pytest.raises(ToolRunnerError):
        await runner.reset()


# --- S3 and what generated code calls --------------------------------------------------------


async def test_s3_placeholders_reach_the_mcp_server_but_never_the_registry_file(
    registry: ServerRegistry, demo_params: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPYBOX_T_API_KEY", "sk-live-secret-value")
    registry.register("keyed", {**demo_params, "env": {"API_KEY": "${IPYBOX_T_API_KEY}"}})
    assert "sk-live-secret-value" not in registry.path.read_text()
    async with ToolServer(
        port=0, log_level="WARNING", registry=registry, token=TOKEN, approval_required=False
    ) as server:
        runner = ToolRunner("keyed", {}, port=server.port, token=TOKEN)
        assert await runner.run("getenv", {"name": "API_KEY"}) == "sk-live-secret-value"


async def test_run_tool_finds_the_tool_server_through_the_kernel_environment(
    registry: ServerRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with ToolServer(
        port=0, log_level="WARNING", registry=registry, token=TOKEN, approval_required=False
    ) as server:
        monkeypatch.setenv("TOOL_SERVER_HOST", "localhost")
        monkeypatch.setenv("TOOL_SERVER_PORT", str(server.port))
        monkeypatch.setenv("TOOL_SERVER_TOKEN", TOKEN)
        try:
            assert await asyncio.to_thread(run_tool, "demo", "add", {"a": 1, "b": 1}) == {"sum": 2}
            assert await asyncio.to_thread(run_tool, "demo", "echo", {"text": "again"}) == "again"
            monkeypatch.setenv("TOOL_SERVER_TOKEN", "stolen?")
            with pytest.raises(ToolRunnerError):
                await asyncio.to_thread(run_tool, "demo", "echo", {"text": "x"})
        finally:
            # Private: the kernel-side client caches a runner per server; nothing public closes them.
            for runner in client_module._runners.values():
                runner.close()
            client_module._runners.clear()


def test_the_kernel_side_client_imports_only_the_standard_library() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import ipybox.tool_exec.client\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "third_party = new - set(sys.stdlib_module_names) - {'ipybox'}\n"
        "print(sorted(third_party))\n"
    )
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert output.strip() == "[]"


async def test_a_default_tool_server_refuses_clients_without_its_token_and_requests_naming_their_own_server(
    registry: ServerRegistry, tmp_path: Path
) -> None:
    # A local process that is not the application: it has no token, and a server of its own to run.
    marker = tmp_path / "pwned"
    hostile = {"command": sys.executable, "args": ["-c", f"open({str(marker)!r}, 'w')"]}
    async with ToolServer(log_level="WARNING") as server:
        assert server.port != 8900 and server.token and server.approval_secret
        with pytest.raises(ToolRunnerError, match="token"):
            await ToolRunner("demo", {}, port=server.port).run("echo", {"text": "x"})
        with pytest.raises(ToolRunnerError, match="cannot supply server_params"):
            await ToolRunner("evil", hostile, port=server.port, token=server.token).run("x", {})
        # Registered and with the token: still nothing runs without the application's approval.
        with pytest.raises(ToolRunnerError, match="approval client is not connected"):
            await ToolRunner("demo", {}, port=server.port, token=server.token).run("echo", {"text": "x"})
    assert not marker.exists()


async def test_a_default_tool_server_runs_a_registered_server_once_the_application_approves(
    registry: ServerRegistry,
) -> None:
    async def accept(request: ApprovalRequest) -> None:
        await request.accept()

    async with ToolServer(log_level="WARNING") as server:
        assert server.approval_secret is not None
        async with ApprovalClient(accept, port=server.port, secret=server.approval_secret):
            runner = ToolRunner("demo", {}, port=server.port, token=server.token)
            assert await runner.run("echo", {"text": "hi"}) == "hi"
