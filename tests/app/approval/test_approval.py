"""Tool call approval: a real tool server, approval client and MCP server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ipybox.tool_exec.approval.client import ApprovalClient, ApprovalRequest
from ipybox.tool_exec.approval.server import ApprovalChannel
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
from ipybox.tool_exec.server import ToolServer


@pytest.fixture
async def approval_server() -> AsyncIterator[ToolServer]:
    async with ToolServer(
        port=0, approval_required=True, approval_timeout=5, log_level="WARNING", trust_all_clients=True
    ) as server:
        yield server


async def test_an_accepted_call_runs_and_the_request_describes_it(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    seen: list[ApprovalRequest] = []

    async def accept(request: ApprovalRequest) -> None:
        seen.append(request)
        await request.accept()

    async with ApprovalClient(accept, port=approval_server.port):
        runner = ToolRunner("demo", demo_params, port=approval_server.port)
        assert (
            await asyncio.to_thread(runner.run_sync, "greet", {"name": "Ann", "punctuation": "?"})
            == "Hello, Ann?"
        )
    [request] = seen
    assert (request.server_name, request.tool_name, request.tool_args) == (
        "demo",
        "greet",
        {"name": "Ann", "punctuation": "?"},
    )
    assert str(request) == "demo.greet(name='Ann', punctuation='?')"


async def test_a_rejected_call_raises_saying_rejected(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    async def reject(request: ApprovalRequest) -> None:
        await request.reject()

    async with ApprovalClient(reject, port=approval_server.port):
        runner = ToolRunner("demo", demo_params, port=approval_server.port)
        with pytest.raises(ToolRunnerError) as info:
            await runner.run("echo", {"text": "x"})
    assert info.value.kind == "rejected"
    assert "rejected" in str(info.value)
    assert "demo.echo" in str(info.value)


async def test_a_call_without_a_decision_expires(demo_params: dict[str, Any]) -> None:
    asked = asyncio.Event()

    async def ignore(request: ApprovalRequest) -> None:
        asked.set()

    async with ToolServer(
        port=0, approval_required=True, approval_timeout=0.3, log_level="WARNING", trust_all_clients=True
    ) as server:
        async with ApprovalClient(ignore, port=server.port):
            runner = ToolRunner("demo", demo_params, port=server.port)
            with pytest.raises(ToolRunnerError) as info:
                async with asyncio.timeout(30):  # the test's own deadline: expiry must end the call
                    await runner.run("echo", {"text": "x"})
    assert asked.is_set()
    assert info.value.kind == "expired"
    assert "expired" in str(info.value)
    assert "0.3 s" in str(info.value)


async def test_a_call_without_an_approval_client_fails(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    runner = ToolRunner("demo", demo_params, port=approval_server.port)
    with pytest.raises(ToolRunnerError) as info:
        await asyncio.to_thread(runner.run_sync, "echo", {"text": "x"})
    assert info.value.kind == "failed"
    assert "approval client is not connected" in str(info.value)


async def test_a_client_that_disconnects_fails_its_pending_requests(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    asked = asyncio.Event()

    async def hold(request: ApprovalRequest) -> None:
        asked.set()

    client = ApprovalClient(hold, port=approval_server.port)
    await client.connect()
    runner = ToolRunner("demo", demo_params, port=approval_server.port)
    call = asyncio.create_task(runner.run("echo", {"text": "x"}))
    await asked.wait()  # pytest-timeout bounds it: the MCP server starts before anyone is asked
    await client.disconnect()
    with pytest.raises(ToolRunnerError) as info:
        await call
    assert info.value.kind == "failed"
    assert "disconnected before it decided" in str(info.value)


async def test_many_calls_in_flight_each_get_their_own_decision(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    count = 8
    pending: list[ApprovalRequest] = []
    all_asked = asyncio.Event()

    async def collect(request: ApprovalRequest) -> None:
        pending.append(request)
        if len(pending) == count:
            all_asked.set()

    async with ApprovalClient(collect, port=approval_server.port):
        runner = ToolRunner("demo", demo_params, port=approval_server.port)
        calls = [asyncio.create_task(runner.run("echo", {"text": str(i)})) for i in range(count)]
        await asyncio.wait_for(all_asked.wait(), 10)
        # Decide in reverse order: odd texts are rejected, even ones accepted.
        for request in reversed(pending):
            if int(request.tool_args["text"]) % 2:
                await request.reject()
            else:
                await request.accept()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for i, outcome in enumerate(outcomes):
        if i % 2:
            assert isinstance(outcome, ToolRunnerError)
            assert outcome.kind == "rejected"
        else:
            assert outcome == str(i)


async def test_a_callback_that_raises_rejects_the_request(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    async def broken(request: ApprovalRequest) -> None:
        raise ValueError("callback bug")

    async with ApprovalClient(broken, port=approval_server.port):
        runner = ToolRunner("demo", demo_params, port=approval_server.port)
        with pytest.raises(ToolRunnerError) as info:
            await runner.run("echo", {"text": "x"})
    assert info.value.kind == "rejected"


async def test_a_channel_without_required_approval_grants_at_once() -> None:
    channel = ApprovalChannel(approval_required=False)
    assert not channel.open
    assert await channel.request("s", "t", {}) is True
    await channel.join(timeout=0.1)


async def test_join_waits_for_the_client_to_go(approval_server: ToolServer) -> None:
    async def accept(request: ApprovalRequest) -> None:
        await request.accept()

    # Private: the approval channel's join is what is tested; the tool server does not expose it.
    channel = approval_server._channel
    client = ApprovalClient(accept, port=approval_server.port)
    await client.connect()
    with pytest.raises(TimeoutError):
        await channel.join(timeout=0.1)
    assert channel.open
    await client.disconnect()
    await channel.join(timeout=60)
    assert not channel.open


async def test_a_decision_in_fragments_or_sent_again_keeps_the_rules(
    approval_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    """The tool server takes each decision as it arrives (its frames joined when it came in
    fragments): a request is decided once, and a repeat is answered ``taken: false``."""
    from websockets.asyncio.client import connect

    def decision(request_id: int, accepted: bool) -> str:
        return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": accepted})

    async def notice(websocket: Any) -> dict[str, Any]:
        message = json.loads(await websocket.recv())
        assert message["method"] == "decided", message
        return dict(message["params"])

    runner = ToolRunner("demo", demo_params, port=approval_server.port)
    async with connect(f"ws://localhost:{approval_server.port}/approval") as websocket:
        for fragmented in (True, False):
            call = asyncio.ensure_future(asyncio.to_thread(runner.run_sync, "echo", {"text": "x"}))
            request = json.loads(await websocket.recv())
            accept = decision(request["id"], True)
            await websocket.send([accept[:9], accept[9:]] if fragmented else accept)
            assert await notice(websocket) == {"id": request["id"], "taken": True}
            # Sent again, the other way, and reversed: too late, it changes nothing.
            reject = decision(request["id"], False)
            await websocket.send(reject if fragmented else [reject[:9], reject[9:]])
            assert await notice(websocket) == {"id": request["id"], "taken": False}
            assert await call == "x"
