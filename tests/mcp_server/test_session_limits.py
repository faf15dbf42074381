"""The HTTP server's sessions: idle ones are closed with a clear word to a client that comes
back, a running cell keeps its session, a cap refuses one session too many, and progress is
shown where a person waits (the server's start, ``install_package``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from mcp.shared.exceptions import MCPError

from tests.mcp_server.support import connected, run, text_of, wait_until
from tests.mcp_server.test_http import TOKEN, HttpServer, start_server, stop_server
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.asyncio(loop_scope="module")


@contextlib.contextmanager
def _server(root: Path, *options: str) -> Iterator[HttpServer]:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN, "IPYBOX_STATE_DIR": str(root / "state")}
    (root / "workspace").mkdir()
    started = start_server(root / "workspace", root / "server.log", env, *options)
    try:
        yield started
    finally:
        stop_server(started.process)


def _tree(server: HttpServer) -> set[psutil.Process]:
    return set(psutil.Process(server.process.pid).children(recursive=True))


def _alive(processes: set[psutil.Process]) -> set[psutil.Process]:
    alive = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.add(process)
    return alive


@pytest.mark.parametrize("sandbox", [False, True], ids=["plain", "sandboxed"])
@pytest.mark.slow
async def test_an_idle_session_is_closed_with_its_processes_and_a_returning_client_is_told_why(
    tmp_path: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    options = ["--session-idle-timeout", "1", "--max-sessions", "1", *(["--sandbox"] if sandbox else [])]
    with _server(tmp_path, *options) as server:
        async with connected(server.url, url_token=TOKEN) as idle:
            # The executor started with the server is this session's: all the server runs.
            processes = _tree(server)
            assert processes
            # The client keeps its GET stream open meanwhile; that is no request.
            assert await asyncio.to_thread(
                wait_until, lambda: "closed MCP session" in server.log.read_text(), 60
            )
            assert await asyncio.to_thread(wait_until, lambda: not _alive(processes))
            with pytest.raises(MCPError) as refused:
                await run(idle, "1 + 1")
            message = str(refused.value)
            assert "was closed after 1 s without requests" in message and "Start a new session" in message
            # Its place under the cap is free again.
            async with connected(server.url, url_token=TOKEN) as fresh:
                assert text_of(await run(fresh, "6 * 7")) == "42"


@pytest.mark.slow
async def test_a_running_cell_keeps_its_session_open_past_the_idle_timeout(tmp_path: Path) -> None:
    go = tmp_path / "go"
    # 5 s: far longer than the client takes between two requests, however loaded the machine.
    with _server(tmp_path, "--session-idle-timeout", "5", "--log-level", "INFO") as server:
        async with connected(server.url, url_token=TOKEN) as client:
            assert text_of(await run(client, "kept = 'state'; kept")) == "'state'"
            # The cell runs until the server has seen its idle time pass while it ran.
            code = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n'done'"
            cell = asyncio.create_task(run(client, code, timeout=300))
            passed = "its idle time passed while a request was in flight"
            try:
                assert await asyncio.to_thread(wait_until, lambda: passed in server.log.read_text(), 120)
            finally:
                go.touch()
            assert text_of(await cell) == "'done'"
            assert text_of(await run(client, "kept")) == "'state'"
            assert "closed MCP session" not in server.log.read_text()


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    with _server(tmp_path_factory.mktemp("capped"), "--max-sessions", "1") as server:
        yield server


async def test_the_server_says_on_stderr_what_it_starts_and_when_it_is_ready(capped: HttpServer) -> None:
    log = capped.log.read_text()
    assert "starting the kernel for the first session ..." in log
    assert "the kernel for the first session is ready (" in log
    assert "at most 1 open at once" in log and "idle ones closed after 3600 s" in log
    assert log.index("is ready (") < log.index("listening on")


async def test_one_session_over_the_cap_is_refused_clearly_until_one_closes(capped: HttpServer) -> None:
    async with connected(capped.url, url_token=TOKEN) as first:
        assert text_of(await run(first, "1 + 1")) == "2"
        # The SDK's client raises the server's JSON-RPC error (in the group of its task group).
        with pytest.raises(BaseExceptionGroup) as refused:
            async with connected(capped.url, url_token=TOKEN):
                pass
        assert refused.group_contains(MCPError, match=r"maximum of 1 MCP sessions open \(--max-sessions\)")
        assert text_of(await run(first, "2 + 2")) == "4"
    async with connected(capped.url, url_token=TOKEN) as second:
        assert text_of(await run(second, "3 + 3")) == "6"


@pytest.mark.slow
async def test_install_package_reports_progress_to_a_client_that_asks(capped: HttpServer) -> None:
    messages: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message)

    async with connected(capped.url, url_token=TOKEN) as client:
        result = await client.call_tool(
            "install_package", {"package_name": "cowsay==6.1"}, progress_callback=on_progress
        )
        assert not result.is_error, text_of(result)
        assert messages and messages[0] == "installing cowsay==6.1"
