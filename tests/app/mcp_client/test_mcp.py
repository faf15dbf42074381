"""MCP sessions and server parameters, against real MCP servers."""

from __future__ import annotations

import asyncio
import copy
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

# Private: MCP sessions and server parameters are internal; they are tested here on real servers.
from ipybox.app.mcp_client._params import HttpParams, StdioParams, resolve_params
from ipybox.app.mcp_client._session import MCPSession, list_tools
from ipybox.errors import MCPServerError, ServerParamsError
from tests.app.tools.support import descendants, pid_alive, wait_until
from tests.conftest import DEMO_SERVER

# --- server parameters -------------------------------------------------------------------


def test_stdio_params_are_resolved_with_args_env_and_cwd(tmp_path: Path) -> None:
    params = resolve_params(
        {"command": "python", "args": ["-m", "x"], "env": {"A": "1"}, "cwd": str(tmp_path)}
    )
    assert params == StdioParams(command="python", args=("-m", "x"), env={"A": "1"}, cwd=str(tmp_path))


@pytest.mark.parametrize(
    ("url", "transport"),
    [
        ("http://localhost:1/sse", "sse"),
        ("http://localhost:1/sse/", "sse"),
        ("http://localhost:1/mcp", "streamable_http"),
        ("https://example.com/api/v1", "streamable_http"),
    ],
)
def test_http_transport_is_detected_from_the_url_path(url: str, transport: str) -> None:
    params = resolve_params({"url": url})
    assert isinstance(params, HttpParams)
    assert params.transport == transport


def test_an_explicit_type_overrides_the_url(tmp_path: Path) -> None:
    params = resolve_params({"url": "http://localhost:1/mcp", "type": "sse", "headers": {"X": "y"}})
    assert params == HttpParams(url="http://localhost:1/mcp", headers={"X": "y"}, transport="sse")


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, "exactly one of 'command'"),
        ({"command": "x", "url": "http://x/mcp"}, "exactly one of 'command'"),
        ({"command": ""}, "'command' must be a non-empty string"),
        ({"command": "x", "args": "not a list"}, "'args' must be a list of strings"),
        ({"command": "x", "env": {"A": 1}}, "'env' must be a mapping of strings"),
        ({"command": "x", "bogus": 1}, "Unexpected MCP server parameter(s) ['bogus']"),
        ({"url": "ftp://x"}, "'url' must be an http:// or https:// URL"),
        ({"url": "http://x/mcp", "type": "websocket"}, "'type' must be 'streamable_http' or 'sse'"),
        ({"url": "http://x/mcp", "headers": ["a"]}, "'headers' must be a mapping"),
    ],
)
def test_malformed_params_say_what_is_expected(params: dict[str, Any], expected: str) -> None:
    with pytest.raises(ServerParamsError) as info:
        resolve_params(params)
    assert expected in str(info.value)


def test_placeholders_are_replaced_from_the_environment_in_every_string(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IPYBOX_T_TOKEN", "s3cret")
    monkeypatch.setenv("IPYBOX_T_HOST", "example.com")
    params = resolve_params(
        {"url": "https://${IPYBOX_T_HOST}/mcp", "headers": {"Authorization": "Bearer ${IPYBOX_T_TOKEN}"}}
    )
    assert params == HttpParams(
        url="https://example.com/mcp", headers={"Authorization": "Bearer s3cret"}, transport="streamable_http"
    )
    stdio = resolve_params(
        {"command": "x", "args": ["--key=${IPYBOX_T_TOKEN}"], "env": {"K": "${IPYBOX_T_TOKEN}"}}
    )
    assert stdio == StdioParams(command="x", args=("--key=s3cret",), env={"K": "s3cret"})


def test_placeholders_fall_back_to_the_dotenv_file_and_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".env").write_text("IPYBOX_T_FROM_FILE=file-value\nIPYBOX_T_BOTH=file\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("IPYBOX_T_BOTH", "env")
    params = resolve_params({"command": "x", "args": ["${IPYBOX_T_FROM_FILE}", "${IPYBOX_T_BOTH}"]})
    assert isinstance(params, StdioParams)
    assert params.args == ("file-value", "env")


def test_a_missing_variable_is_an_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("IPYBOX_T_MISSING", raising=False)
    with pytest.raises(ServerParamsError) as info:
        resolve_params({"command": "x", "env": {"K": "${IPYBOX_T_MISSING}"}})
    message = str(info.value)
    assert "IPYBOX_T_MISSING" in message
    assert ".env" in message


# --- sessions over stdio -----------------------------------------------------------------


async def test_a_stdio_session_returns_text_structured_and_nested_results(
    demo_params: dict[str, Any],
) -> None:
    session = MCPSession("demo", resolve_params(demo_params))
    await session.start()
    try:
        assert await session.call_tool("echo", {"text": "hi"}) == "hi"
        assert await session.call_tool("add", {"a": 2, "b": 3}) == {"sum": 5}
        directory = await session.call_tool("directory", {"names": ["Ann", "Bo"], "city": "Rome"})
        assert isinstance(directory, dict)
        assert directory["count"] == 2
        assert directory["people"][1]["addresses"][0] == {
            "street": "1 Main St",
            "city": "Rome",
            "tags": ["home", "bo"],
        }
        order = await session.call_tool(
            "order", {"item": "hat", "color": "red", "dimensions": {"width": 1.5, "height": 2}}
        )
        assert order == {
            "item": "hat",
            "color": "red",
            "size": 2,
            "quantity": 1,
            "dimensions": {"width": 1.5, "height": 2.0, "unit": "cm"},
            "note": None,
        }
    finally:
        await session.close()


async def test_a_tool_error_carries_the_servers_message(demo_params: dict[str, Any]) -> None:
    session = MCPSession("demo", resolve_params(demo_params))
    await session.start()
    try:
        with pytest.raises(MCPServerError) as info:
            await session.call_tool("fail", {"message": "the disk is on fire"})
        assert "the disk is on fire" in str(info.value)
        assert (info.value.server_name, info.value.tool_name) == ("demo", "fail")
        with pytest.raises(MCPServerError, match="no_such_tool"):
            await session.call_tool("no_such_tool", {})
        assert session.alive
        assert await session.call_tool("echo", {"text": "still here"}) == "still here"
    finally:
        await session.close()


async def test_several_calls_to_one_server_are_in_flight_at_once(demo_params: dict[str, Any]) -> None:
    session = MCPSession("demo", resolve_params(demo_params))
    await session.start()
    try:
        # The rendezvous answers only once all four calls wait in it together: one after the
        # other, they never could (each would fail after its timeout).
        calls = (
            session.call_tool("rendezvous", {"key": "four", "count": 4, "timeout": 60}) for _ in range(4)
        )
        assert await asyncio.gather(*calls) == ["4 together"] * 4
    finally:
        await session.close()


async def test_a_crash_fails_the_call_in_flight_clearly_and_ends_the_session(
    demo_params: dict[str, Any],
) -> None:
    session = MCPSession("demo", resolve_params(demo_params))
    await session.start()
    try:
        slow = asyncio.create_task(session.call_tool("slow", {"seconds": 30}))
        with pytest.raises(MCPServerError) as info:
            await session.call_tool("crash", {})
        assert "went away" in str(info.value)
        assert "started again on the next call. It exited with code 3" in str(info.value)
        with pytest.raises(MCPServerError, match="went away"):
            await slow
        assert not session.alive
        with pytest.raises(MCPServerError, match="closed"):
            await session.call_tool("echo", {"text": "x"})
    finally:
        await session.close()


@pytest.mark.slow
async def test_close_stops_the_server_with_its_whole_process_tree(tmp_path: Path) -> None:
    # The server leaves a background child behind in its process group, as wrappers often do.
    script = tmp_path / "wrapper.sh"
    demo = DEMO_SERVER
    script.write_text(
        f"#!/bin/sh\nsleep 300 &\necho $! > {tmp_path / 'child.pid'}\nexec {sys.executable} {demo}\n"
    )
    script.chmod(0o755)
    before = descendants()
    session = MCPSession("wrapped", resolve_params({"command": str(script)}))
    await session.start()
    server_pid = await session.call_tool("pid", {})
    assert isinstance(server_pid, dict)
    child_pid = int((tmp_path / "child.pid").read_text())
    assert pid_alive(child_pid)
    await session.close()
    await session.close()  # idempotent
    assert not pid_alive(server_pid["result"])
    assert await wait_until(lambda: not pid_alive(child_pid))
    assert descendants() <= before


async def test_connect_timeout_is_honoured_for_a_server_that_never_answers() -> None:
    before = descendants()
    silent = {"command": sys.executable, "args": ["-c", "import time; time.sleep(300)"]}
    session = MCPSession("silent", resolve_params(silent), connect_timeout=0.5)
    # The server never answers: without the connect timeout, start() would hang (until pytest's).
    with pytest.raises(MCPServerError) as info:
        await session.start()
    assert "'silent' did not answer within 0.5 s" in str(info.value)
    assert await wait_until(lambda: descendants() <= before)


async def test_connect_timeout_is_honoured_for_an_http_server_that_never_answers() -> None:
    with socket.socket() as listener:  # accepts connections into its backlog, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/mcp"
        session = MCPSession("mute", resolve_params({"url": url}), connect_timeout=0.5)
        # Without the connect timeout, start() would hang (until pytest's).
        with pytest.raises(MCPServerError, match=r"did not answer within 0\.5 s"):
            await session.start()


async def test_a_server_that_cannot_start_is_reported_with_its_name() -> None:
    session = MCPSession("nowhere", resolve_params({"command": "/nonexistent/mcp-server"}))
    with pytest.raises(MCPServerError, match="'nowhere' could not be started"):
        await session.start()


async def test_a_server_that_exits_at_start_is_reported_with_its_exit_code_and_last_stderr_lines() -> None:
    # As a server run by an interpreter without the `mcp` package fails: a traceback, then exit 1.
    failing = (
        "import sys\n"
        "for i in range(40): print(f'noise {i}', file=sys.stderr)\n"
        "print('ModuleNotFoundError: No module named mcp', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    session = MCPSession("broken", resolve_params({"command": sys.executable, "args": ["-c", failing]}))
    with pytest.raises(MCPServerError) as info:
        await session.start()
    message = str(info.value)
    assert "'broken' could not be started" in message
    assert "exited with code 3" in message
    assert message.endswith("  ModuleNotFoundError: No module named mcp")
    # Only the last lines are kept.
    assert "noise 39" in message and "noise 0\n" not in message


async def test_the_stderr_lines_of_a_failed_start_never_show_a_placeholders_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The error reaches the kernel (ToolRunnerError) and the agent; a ${VAR}'s value must not (S3).
    monkeypatch.setenv("IPYBOX_TEST_API_KEY", "sk-very-secret-value")
    leaking = "import os, sys; print('bad key', os.environ['KEY'], sys.argv[1], file=sys.stderr); sys.exit(2)"
    params = {
        "command": sys.executable,
        "args": ["-c", leaking, "--key=${IPYBOX_TEST_API_KEY}"],
        "env": {"KEY": "${IPYBOX_TEST_API_KEY}"},
    }
    session = MCPSession("leaky", resolve_params(params))
    with pytest.raises(MCPServerError) as info:
        await session.start()
    assert "sk-very-secret-value" not in str(info.value)
    assert "bad key *** --key=***" in str(info.value)


async def test_a_server_killed_by_a_signal_at_start_says_so() -> None:
    dying = (
        "import os, signal, sys; print('about to die', file=sys.stderr, flush=True); os.kill(os.getpid(), 9)"
    )
    session = MCPSession("killed", resolve_params({"command": sys.executable, "args": ["-c", dying]}))
    with pytest.raises(MCPServerError, match=r"ended by signal 9; its last lines on stderr:\n  about to die"):
        await session.start()


async def test_a_command_not_on_path_is_an_error_naming_the_folders_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    # Folders named more than once (and the user's own again) are listed once each.
    local = f"{tmp_path}/.local/bin"
    monkeypatch.setenv("PATH", os.pathsep.join(["/nonexistent-bin", local, "/nonexistent-bin/", local]))
    session = MCPSession("nowhere", resolve_params({"command": "no-such-mcp-server"}))
    with pytest.raises(MCPServerError) as info:
        await session.start()
    message = str(info.value)
    assert "the command 'no-such-mcp-server' was not found" in message
    assert f"searched /nonexistent-bin, {local}, {tmp_path}/.cargo/bin. " in message
    assert "give its full path as 'command', or add its folder to PATH" in message


async def test_a_command_in_the_users_local_bin_is_found_without_it_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # scripts/setup.sh installs uv and uvx into ~/.local/bin, which an application's PATH often lacks.
    local_bin = tmp_path / ".local" / "bin"
    local_bin.mkdir(parents=True)
    server = local_bin / "demo-mcp-server"
    server.write_text(f"#!/bin/sh\nexec {sys.executable} {DEMO_SERVER}\n")
    server.chmod(0o755)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    tools = await list_tools("local", {"command": "demo-mcp-server"})
    assert "echo" in {tool.name for tool in tools}


async def test_a_server_gets_what_it_needs_to_reach_the_network_and_no_secrets(
    demo_params: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    passed = {
        "SSL_CERT_FILE": str(tmp_path / "ca.pem"),
        "SSL_CERT_DIR": str(tmp_path),
        "REQUESTS_CA_BUNDLE": str(tmp_path / "ca.pem"),
        "NODE_EXTRA_CA_CERTS": str(tmp_path / "ca.pem"),
        "HTTPS_PROXY": "http://proxy.example:3128",
        "https_proxy": "http://proxy.example:3128",
        "HTTP_PROXY": "http://proxy.example:3128",
        "no_proxy": "localhost,127.0.0.1",
        "UV_INDEX_URL": "https://mirror.example/simple",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "Europe/Berlin",
        "TMPDIR": str(tmp_path),
    }
    withheld = {"OPENAI_API_KEY": "sk-secret", "AWS_SECRET_ACCESS_KEY": "aws-secret", "GITHUB_TOKEN": "ghp-x"}
    for name, value in {**passed, **withheld}.items():
        monkeypatch.setenv(name, value)
    params = {**demo_params, "env": {"NAMED": "${GITHUB_TOKEN}"}}
    session = MCPSession("demo", resolve_params(params))
    await session.start()
    try:
        for name, value in passed.items():
            assert await session.call_tool("getenv", {"name": name}) == value, name
        for name in withheld:
            assert await session.call_tool("getenv", {"name": name}) == "", name
        assert await session.call_tool("getenv", {"name": "NAMED"}) == "ghp-x"
    finally:
        await session.close()


# --- other transports and published servers ----------------------------------------------


@pytest.mark.parametrize("transport", ["streamable_http", "sse"])
async def test_http_sessions_work_over_both_transports(
    transport: str, streamable_http_url: str, sse_url: str
) -> None:
    url = streamable_http_url if transport == "streamable_http" else sse_url
    params = resolve_params({"url": url})
    assert isinstance(params, HttpParams)
    assert params.transport == transport
    session = MCPSession("demo-http", params, connect_timeout=10)
    await session.start()
    try:
        assert await session.call_tool("add", {"a": 20, "b": 22}) == {"sum": 42}
        assert await session.call_tool("greet", {"name": "Ann"}) == "Hello, Ann!"
        with pytest.raises(MCPServerError, match="nope"):
            await session.call_tool("fail", {"message": "nope"})
    finally:
        await session.close()


async def test_list_tools_lists_every_tool_with_its_schemas(demo_params: dict[str, Any]) -> None:
    tools = {tool.name: tool for tool in await list_tools("demo", demo_params)}
    assert {"echo", "greet", "add", "directory", "order", "slow", "fail", "crash"} <= set(tools)
    assert tools["add"].output_schema is not None
    assert tools["greet"].output_schema is None
    assert "$defs" in tools["order"].input_schema


async def test_list_tools_reports_bad_params_before_starting_anything() -> None:
    with pytest.raises(ServerParamsError, match="IPYBOX_T_NOT_SET"):
        await list_tools("x", {"command": "${IPYBOX_T_NOT_SET}"})


async def test_the_published_time_server_runs_over_stdio(time_params: dict[str, Any]) -> None:
    session = MCPSession("time", resolve_params(time_params))
    await session.start()
    try:
        result = await session.call_tool("get_current_time", {"timezone": "Europe/Berlin"})
        assert isinstance(result, dict)
        assert result["timezone"] == "Europe/Berlin"
    finally:
        await session.close()


async def test_the_published_filesystem_server_runs_over_stdio(
    filesystem_params: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "note.txt").write_text("hello from a file")
    session = MCPSession("filesystem", resolve_params(filesystem_params), connect_timeout=120)
    await session.start()
    try:
        result = await session.call_tool("read_text_file", {"path": str(tmp_path / "note.txt")})
        text = result if isinstance(result, str) else str(result)
        assert "hello from a file" in text
    finally:
        await session.close()


def test_resolving_placeholders_leaves_the_applications_parameters_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IPYBOX_T_TOKEN", "resolved-secret")
    params = {
        "url": "http://localhost:1/mcp",
        "headers": {"Authorization": "Bearer ${IPYBOX_T_TOKEN}"},
    }
    original = copy.deepcopy(params)
    resolved = resolve_params(params)
    assert isinstance(resolved, HttpParams)
    assert resolved.headers == {"Authorization": "Bearer resolved-secret"}
    assert params == original  # what the registry stores keeps its placeholder
