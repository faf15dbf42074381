"""ToolServer and ToolRunner in trusted local use, against real MCP servers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import logging
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx2
import pytest
from pydantic import BaseModel

# Private: the same function is public as ipybox.tool_exec.server.default_registry.
from ipybox.app.mcp_client._registry import default_registry
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
from ipybox.tool_exec.server import ToolServer
from tests.app.tools.support import descendants, pid_alive, wait_until
from tests.conftest import DEMO_SERVER


async def test_status_answers_ok_on_the_bound_port(tool_server: ToolServer) -> None:
    assert tool_server.port != 0
    async with httpx2.AsyncClient() as client:
        response = await client.get(f"http://localhost:{tool_server.port}/status")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


async def test_starting_twice_raises_and_stop_is_idempotent() -> None:
    server = ToolServer(port=0, log_level="WARNING", approval_required=False, trust_all_clients=True)
    await server.start()
    with pytest.raises(RuntimeError, match="already running"):
        await server.start()
    await server.stop()
    await server.stop()
    assert not server.running


async def test_a_port_in_use_fails_the_start(tool_server: ToolServer) -> None:
    with pytest.raises(OSError):
        await ToolServer(
            port=tool_server.port, log_level="WARNING", approval_required=False, trust_all_clients=True
        ).start()


async def test_run_and_run_sync_return_text_and_structured_results(
    tool_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    runner = ToolRunner("demo", demo_params, port=tool_server.port)
    assert await runner.run("echo", {"text": "async"}) == "async"
    assert await asyncio.to_thread(runner.run_sync, "add", {"a": 1, "b": 2}) == {"sum": 3}
    nested = await asyncio.to_thread(runner.run_sync, "directory", {"names": ["Ann"]})
    assert isinstance(nested, dict)
    assert nested["people"][0]["addresses"][0]["city"] == "Berlin"


async def test_a_server_that_fails_to_start_fails_the_call_with_its_exit_code_and_stderr(
    tool_server: ToolServer,
) -> None:
    without_mcp = {"command": sys.executable, "args": ["-S", str(DEMO_SERVER)]}
    runner = ToolRunner("nomcp", without_mcp, port=tool_server.port)
    with pytest.raises(ToolRunnerError) as info:
        await runner.run("echo", {"text": "x"})
    assert "exited with code 1" in str(info.value)
    assert "ModuleNotFoundError: No module named" in str(info.value)


async def test_arguments_of_common_python_types_are_sent_as_json(
    tool_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    class Dimensions(BaseModel):
        width: float
        height: float

    runner = ToolRunner("demo", demo_params, port=tool_server.port)
    when = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    cases = {
        "datetime": (when, "2025-01-02T03:04:05+00:00"),
        "date": (when.date(), "2025-01-02"),
        "time": (datetime.time(3, 4), "03:04:00"),
        "uuid": (ident, str(ident)),
        "decimal": (decimal.Decimal("1.10"), "1.10"),
        "path": (Path("/tmp/x"), "/tmp/x"),
    }
    for value, expected in cases.values():
        assert await runner.run("echo", {"text": value}) == expected
    order = await runner.run(
        "order", {"item": "box", "color": "blue", "dimensions": Dimensions(width=1, height=2)}
    )
    assert isinstance(order, dict)
    assert order["dimensions"] == {"width": 1.0, "height": 2.0, "unit": "cm"}
    with pytest.raises(ToolRunnerError, match="cannot be sent as JSON"):
        await runner.run("echo", {"text": object()})


async def test_a_tool_error_is_a_failed_tool_runner_error_with_the_servers_message(
    tool_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    runner = ToolRunner("demo", demo_params, port=tool_server.port)
    with pytest.raises(ToolRunnerError) as info:
        await asyncio.to_thread(runner.run_sync, "fail", {"message": "quota exceeded"})
    assert info.value.kind == "failed"
    assert (info.value.server_name, info.value.tool_name) == ("demo", "fail")
    assert "failed" in str(info.value)
    assert "quota exceeded" in str(info.value)


async def test_a_crashed_server_fails_the_call_and_is_started_again_on_the_next(
    tool_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    runner = ToolRunner("demo", demo_params, port=tool_server.port)
    first = await runner.run("pid", {})
    assert isinstance(first, dict)
    with pytest.raises(ToolRunnerError) as info:
        await runner.run("crash", {})
    assert info.value.kind == "failed"
    assert "went away" in str(info.value)
    second = await runner.run("pid", {})
    assert isinstance(second, dict)
    assert second["result"] != first["result"]
    assert not pid_alive(first["result"])


async def test_reset_closes_sessions_and_they_restart_lazily(
    tool_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    runner = ToolRunner("demo", demo_params, port=tool_server.port)
    first = await runner.run("pid", {})
    assert isinstance(first, dict)
    await runner.reset()
    assert await wait_until(lambda: not pid_alive(first["result"]))
    second = await asyncio.to_thread(runner.run_sync, "pid", {})
    assert isinstance(second, dict)
    assert second["result"] != first["result"]
    await asyncio.to_thread(runner.reset_sync)
    assert await wait_until(lambda: not pid_alive(second["result"]))


async def test_calls_to_different_servers_run_concurrently(
    tool_server: ToolServer, demo_params: dict[str, Any], tmp_path: Path
) -> None:
    one, two = (ToolRunner(name, demo_params, port=tool_server.port) for name in ("one", "two"))
    started = tmp_path / "started"
    pending = asyncio.create_task(one.run("slow", {"seconds": 60, "started": str(started)}))
    assert await wait_until(started.exists, timeout=60)  # the call to "one" has reached its server
    # "two" answers while the call to "one" is still in flight.
    assert await two.run("echo", {"text": "meanwhile"}) == "meanwhile"
    assert not pending.done()
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pending


async def test_stop_leaves_no_child_processes(
    demo_params: dict[str, Any], time_params: dict[str, Any]
) -> None:
    before = descendants()
    server = ToolServer(port=0, log_level="WARNING", approval_required=False, trust_all_clients=True)
    await server.start()
    await ToolRunner("demo", demo_params, port=server.port).run("echo", {"text": "x"})
    await ToolRunner("time", time_params, port=server.port).run("get_current_time", {"timezone": "UTC"})
    assert len(descendants() - before) >= 2
    await server.stop()
    assert descendants() <= before


@pytest.mark.parametrize("transport", ["streamable_http", "sse"])
async def test_http_mcp_servers_run_through_the_tool_server(
    tool_server: ToolServer, transport: str, streamable_http_url: str, sse_url: str
) -> None:
    url = streamable_http_url if transport == "streamable_http" else sse_url
    runner = ToolRunner(f"demo-{transport}", {"url": url}, port=tool_server.port)
    assert await asyncio.to_thread(runner.run_sync, "add", {"a": 2, "b": 2}) == {"sum": 4}


async def test_published_servers_run_through_the_tool_server(
    tool_server: ToolServer, time_params: dict[str, Any], filesystem_params: dict[str, Any], tmp_path: Path
) -> None:
    time_runner = ToolRunner("time", time_params, port=tool_server.port)
    converted = await time_runner.run(
        "convert_time", {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}
    )
    assert isinstance(converted, dict)
    assert converted["target"]["timezone"] == "Asia/Tokyo"
    (tmp_path / "a.txt").write_text("alpha")
    fs_runner = ToolRunner("filesystem", filesystem_params, port=tool_server.port)
    listing = await fs_runner.run("list_directory", {"path": str(tmp_path)})
    assert "a.txt" in str(listing)


async def test_bad_server_params_are_a_failed_call_naming_the_problem(tool_server: ToolServer) -> None:
    runner = ToolRunner("bad", {"command": "x", "args": ["${IPYBOX_T_UNSET_VAR}"]}, port=tool_server.port)
    with pytest.raises(ToolRunnerError) as info:
        await runner.run("echo", {})
    assert info.value.kind == "failed"
    assert "IPYBOX_T_UNSET_VAR" in str(info.value)


async def test_malformed_requests_get_a_typed_400(tool_server: ToolServer) -> None:
    async with httpx2.AsyncClient(base_url=f"http://localhost:{tool_server.port}") as client:
        for body in (
            b"not json",
            b'{"server_name": "x"}',
            b'{"server_name": "x", "tool_name": "y", "extra": 1}',
        ):
            response = await client.post("/run", content=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["kind"] == "failed"
            assert error["message"].startswith("The tool call request is malformed")


async def test_an_unreachable_tool_server_is_a_failed_tool_runner_error(tool_server: ToolServer) -> None:
    port = tool_server.port
    await tool_server.stop()
    runner = ToolRunner("demo", {"command": "x"}, port=port)
    with pytest.raises(ToolRunnerError) as info:
        await asyncio.to_thread(runner.run_sync, "echo", {"text": "x"})
    assert info.value.kind == "failed"
    assert "could not be reached" in str(info.value)
    with pytest.raises(ToolRunnerError, match="could not be reached"):
        await runner.run("echo", {"text": "x"})


async def test_run_sync_reconnects_when_its_kept_connection_went_stale(demo_params: dict[str, Any]) -> None:
    server = ToolServer(port=0, log_level="WARNING", approval_required=False, trust_all_clients=True)
    await server.start()
    port = server.port
    runner = ToolRunner("demo", demo_params, port=port)
    try:
        assert await asyncio.to_thread(runner.run_sync, "echo", {"text": "before"}) == "before"
        await server.stop()  # closes the kept connection from the server's side
        server = ToolServer(port=port, log_level="WARNING", approval_required=False, trust_all_clients=True)
        await server.start()
        assert await asyncio.to_thread(runner.run_sync, "echo", {"text": "after"}) == "after"
    finally:
        runner.close()
        await server.stop()


async def test_run_sync_reads_chunked_answers_and_can_go_through_a_proxy() -> None:
    request_lines: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:]
        )
        await reader.readexactly(length)
        request_lines.append(head.split(b"\r\n", 1)[0])
        body = b'{"result": {"chunked": true}}'
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + b"%x\r\n%s\r\n" % (10, body[:10])
            + b"%x\r\n%s\r\n" % (len(body) - 10, body[10:])
            + b"0\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        direct = ToolRunner("x", {}, host="127.0.0.1", port=port, token="")
        assert await asyncio.to_thread(direct.run_sync, "t", {}) == {"chunked": True}
        assert await asyncio.to_thread(direct.run_sync, "t", {}) == {"chunked": True}
        proxied = ToolRunner(
            "x", {}, host="tool-server.internal", port=1234, proxy=f"http://127.0.0.1:{port}"
        )
        assert await asyncio.to_thread(proxied.run_sync, "t", {}) == {"chunked": True}
    assert request_lines == [
        b"POST /run HTTP/1.1",
        b"POST /run HTTP/1.1",
        b"POST http://tool-server.internal:1234/run HTTP/1.1",
    ]
    with pytest.raises(ValueError, match="http:// proxies"):
        ToolRunner("x", {}, proxy="socks5://127.0.0.1:1080")


async def test_a_plain_tool_server_runs_generated_code_from_the_default_registry(
    tool_server: ToolServer, demo_params: dict[str, Any]
) -> None:
    default_registry().register("demo", demo_params)  # what generate_mcp_sources records
    generated_call = ToolRunner("demo", {}, port=tool_server.port)  # generated code sends no server_params
    assert await generated_call.run("echo", {"text": "from the registry"}) == "from the registry"


async def test_a_plain_tool_server_names_the_registry_for_an_unknown_server(tool_server: ToolServer) -> None:
    with pytest.raises(ToolRunnerError, match="neither running nor registered") as info:
        await ToolRunner("nowhere", {}, port=tool_server.port).run("echo", {"text": "x"})
    assert "generate_mcp_sources" in str(info.value)


async def test_tool_servers_log_through_the_applications_handlers_and_configure_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    watched = [logging.getLogger(name) for name in ("ipybox", "ipybox.tool_exec", "uvicorn.error")]
    before = [(log.handlers[:], log.propagate, log.level) for log in watched]
    async with (
        ToolServer(port=0, log_to_stderr=True, approval_required=False, trust_all_clients=True) as one,
        ToolServer(port=0, log_to_stderr=False, approval_required=False, trust_all_clients=True) as two,
    ):
        pass
    listening = [r.getMessage() for r in caplog.records if r.name == "ipybox.tool_exec.server"]
    assert f"Tool server listening on localhost:{one.port}" in listening
    assert f"Tool server listening on localhost:{two.port}" in listening
    assert [(log.handlers[:], log.propagate, log.level) for log in watched] == before


def test_log_to_stderr_shows_records_where_the_application_configured_no_logging() -> None:
    code = (
        "import asyncio\nfrom ipybox.tool_exec.server import ToolServer\n"
        "async def main():\n"
        "    async with ToolServer(port=0, log_to_stderr=True, approval_required=False, trust_all_clients=True):\n"
        "        pass\n"
        "asyncio.run(main())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "Tool server listening on" in result.stderr
