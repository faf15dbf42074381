"""The ipybox MCP server over streamable HTTP: token, Host/Origin checks, one kernel and one
working folder per session."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx2
import mcp_types as types
import psutil
import pytest
from mcp.client import Client
from mcp.shared.exceptions import MCPError
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, text_of, wait_until
from tests.servers.demo_server import png_bytes

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "test-token-0123456789"
_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class HttpServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def start_server(workspace: Path, log: Path, env: dict[str, str], *extra: str) -> HttpServer:
    """Start ``python -m ipybox --transport streamable-http --port 0 [extra]``; wait for its URL line."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "ipybox", "--workspace", str(workspace)),
                *("--transport", "streamable-http", "--port", "0", "--log-level", "ERROR"),
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=sink,
            env=env,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if match := _LISTENING.search(log.read_text()):
            return HttpServer(match.group(1), process, log)
        if process.poll() is not None:
            break
        time.sleep(0.05)  # polling a log file under a deadline, not waiting "just in case"
    stop_server(process)
    raise RuntimeError(f"the HTTP server did not start:\n{log.read_text()}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    root = tmp_path_factory.mktemp("http")
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN, "IPYBOX_STATE_DIR": str(root / "state")}
    (root / "workspace").mkdir()
    started = start_server(root / "workspace", root / "server.log", env)
    try:
        yield started
    finally:
        stop_server(started.process)


def _kernels(process: subprocess.Popen[bytes]) -> set[int]:
    """Live kernel processes under the server (zombies count as gone)."""
    pids = set()
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "ipykernel" in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.Error:
            pass
    return pids


async def test_a_request_without_the_token_is_refused(server: HttpServer) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient() as http:
        missing = await http.post(server.url, json=body, headers=headers)
        wrong = await http.post(server.url, json=body, headers={**headers, "Authorization": "Bearer nope"})
    assert missing.status_code == 401 and wrong.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    with pytest.raises(ExceptionGroup) as raised:
        async with connected(server.url, url_token="wrong") as client:
            await client.list_tools()
    # The SDK client reports the 401 as an MCPError from inside its task groups, with the
    # server's words (a JSON-RPC error body), not "Server returned an error response".
    errors = raised.value.subgroup(lambda exc: isinstance(exc, MCPError))
    assert errors is not None
    shown = [str(exc) for exc in _leaves(errors)]
    assert any("Authorization: Bearer <token>" in text and "IPYBOX_MCP_TOKEN" in text for text in shown), (
        shown
    )


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]


async def test_a_foreign_host_or_origin_is_refused(server: HttpServer) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    async with httpx2.AsyncClient() as http:
        host = await http.post(server.url, json=body, headers={**headers, "Host": "evil.example:80"})
        origin = await http.post(server.url, json=body, headers={**headers, "Origin": "http://evil.example"})
    assert host.status_code == 421
    assert origin.status_code == 403


async def test_the_token_rule_is_one_for_every_server(server: HttpServer) -> None:
    # The rule of ipybox._infra.BearerToken, as the tool server applies it (tests/test_infra.py).
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient() as http:
        for authorization in (f"bearer {TOKEN}", f"BEARER   {TOKEN}"):
            response = await http.post(
                server.url, json=body, headers={**headers, "Authorization": authorization}
            )
            assert response.status_code == 400  # past the guard: the request has no MCP session
        for authorization in (TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN}x"):
            response = await http.post(
                server.url, json=body, headers={**headers, "Authorization": authorization}
            )
            assert response.status_code == 401


async def test_a_websocket_from_a_foreign_host_or_origin_is_refused(server: HttpServer) -> None:
    url = server.url.replace("http://", "ws://")
    token = {"Authorization": f"Bearer {TOKEN}"}
    for headers in ({**token, "Origin": "http://evil.example"}, {**token, "Host": "evil.example"}, {}):
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(url, additional_headers=headers, open_timeout=30):
                pass
        assert info.value.response.status_code == 403


async def test_two_sessions_have_their_own_kernels(server: HttpServer) -> None:
    async with (
        connected(server.url, url_token=TOKEN) as first,
        connected(server.url, url_token=TOKEN, headers={"Origin": server.url.rsplit("/", 1)[0]}) as second,
    ):
        assert not (await run(first, "secret = 'first'")).is_error
        other = await run(second, "secret")
        assert other.is_error and "NameError" in text_of(other)
        pids = {text_of(await run(client, "import os; os.getpid()")) for client in (first, second)}
        assert len(pids) == 2
        # One kernel per session and no spare: a session costs one kernel (and its gateway).
        assert await asyncio.to_thread(wait_until, lambda: len(_kernels(server.process)) == 2)
        assert text_of(await run(first, "secret")) == "'first'"


async def test_two_sessions_work_in_folders_of_their_own_which_the_server_names(server: HttpServer) -> None:
    workspace = (server.log.parent / "workspace").resolve()
    async with (
        connected(server.url, url_token=TOKEN) as first,
        connected(server.url, url_token=TOKEN) as second,
    ):
        folders = [await _cwd(client) for client in (first, second)]
        assert not (await run(first, "open('mine.txt', 'w').write('first')")).is_error
        other = await run(second, "open('mine.txt').read()")
        assert other.is_error and "FileNotFoundError" in text_of(other)
        # Plots and saved outputs land in the session's folder too.
        shown = await run(first, f"from IPython.display import Image\nImage(data={png_bytes()!r})")
        saved = text_of(shown).split("Images saved in the workspace: ")[1].strip()
        long = await run(first, "print('x' * 1000)", max_output_chars=200)
        assert ".ipybox/outputs/" in text_of(long)
    assert folders[0] != folders[1] and {folder.parent for folder in folders} == {workspace / "sessions"}
    # Kept after the sessions end, and named on the server's stderr.
    assert (folders[0] / "mine.txt").read_text() == "first"
    assert (folders[0] / saved).read_bytes() == png_bytes() and saved.startswith("images/")
    assert len(list((folders[0] / ".ipybox" / "outputs").iterdir())) == 1
    assert not (workspace / "images").exists() and not (workspace / ".ipybox").exists()
    log = server.log.read_text()
    assert all(f"a new MCP session works in {folder}\n" in log for folder in folders)


@pytest.mark.slow
async def test_a_server_registered_in_one_session_is_that_sessions_alone(tmp_path: Path) -> None:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    # ${VAR} is still filled in from the workspace's .env, not from the session's folder.
    (workspace / ".env").write_text("DOTENV_SECRET=hidden\n")
    started = await asyncio.to_thread(start_server, workspace, tmp_path / "server.log", env)
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)], "env": {"DEMO_SECRET": "${DOTENV_SECRET}"}}
    call = "from mcptools.demo.getenv import Params, run\nprint(run(Params(name='DEMO_SECRET')))"
    try:
        async with (
            connected(started.url, url_token=TOKEN) as first,
            connected(started.url, url_token=TOKEN) as second,
        ):
            registered = await first.call_tool(
                "register_mcp_server", {"server_name": "demo", "server_params": demo}
            )
            assert not registered.is_error, text_of(registered)
            first_dir, second_dir = await _cwd(first), await _cwd(second)
            assert (first_dir / "mcptools" / "demo" / "getenv.py").is_file()
            assert not (workspace / "mcptools").exists()
            assert text_of(await run(first, call)) == "hidden"
            missing = await run(second, call)
            assert missing.is_error and "ModuleNotFoundError" in text_of(missing)
            # The generated code alone calls nothing: the second session's tool server knows no
            # server of that name.
            shutil.copytree(first_dir / "mcptools", second_dir / "mcptools")
            refused = await run(second, call)
            assert refused.is_error and "not registered for this executor" in text_of(refused)
    finally:
        await asyncio.to_thread(stop_server, started.process)


async def _cwd(client: Client) -> Path:
    return Path(text_of(await run(client, "import os; print(os.getcwd())")))


@pytest.mark.slow
async def test_progress_and_cancellation_work_over_http(server: HttpServer) -> None:
    async with connected(server.url, url_token=TOKEN) as client:
        messages: list[str | None] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            messages.append(message)

        code = "import time\nfor i in range(3):\n    print(f'line {i}', flush=True)\n    time.sleep(1)"
        result = await client.call_tool("execute_ipython_cell", {"code": code}, progress_callback=on_progress)
        assert not result.is_error
        assert any(message and message.startswith("line") for message in messages)

        await run(client, "kept = 'state'")
        call = asyncio.create_task(run(client, "import time\ntime.sleep(60)"))
        done, _ = await asyncio.wait({call}, timeout=2)
        assert not done
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert text_of(await asyncio.wait_for(run(client, "kept"), timeout=30)) == "'state'"


@pytest.mark.slow
async def test_uploads_up_to_the_documented_limit_pass_over_http(server: HttpServer) -> None:
    limit = 20 * 1024 * 1024
    # Not a repeating pattern, so no layer can pass it by compressing it.
    payload = os.urandom(limit)
    # The SDK's client caps one server-sent event at 1 MiB unless told otherwise.
    async with connected(server.url, url_token=TOKEN, max_sse_event_size=2 * limit) as client:
        # Files go to the session's own folder.
        workspace = await _cwd(client)
        upload = await client.call_tool(
            "upload_file", {"path": "big/at-limit.bin", "content_base64": base64.b64encode(payload).decode()}
        )
        assert not upload.is_error, text_of(upload)
        assert (workspace / "big" / "at-limit.bin").read_bytes() == payload
        download = await client.call_tool("download_file", {"path": "big/at-limit.bin"})
        blobs = [b.resource for b in download.content if isinstance(b, types.EmbeddedResource)]
        assert len(blobs) == 1 and isinstance(blobs[0], types.BlobResourceContents)
        assert base64.b64decode(blobs[0].blob) == payload

        over = base64.b64encode(payload + b"x").decode()
        refused = await client.call_tool("upload_file", {"path": "big/over.bin", "content_base64": over})
        assert refused.is_error and "larger than the upload limit of 20 MiB" in text_of(refused)
        assert not (workspace / "big" / "over.bin").exists()


async def test_with_a_shared_workspace_every_session_works_in_the_workspace_itself(tmp_path: Path) -> None:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    started = await asyncio.to_thread(
        start_server, workspace, tmp_path / "server.log", env, "--shared-workspace"
    )
    try:
        async with (
            connected(started.url, url_token=TOKEN) as first,
            connected(started.url, url_token=TOKEN) as second,
        ):
            assert {await _cwd(first), await _cwd(second)} == {workspace.resolve()}
            assert not (await run(first, "open('shared.txt', 'w').write('first')")).is_error
            assert text_of(await run(second, "print(open('shared.txt').read())")) == "first"
            upload = await second.call_tool("upload_file", {"path": "up.txt", "content_base64": "aGk="})
            assert not upload.is_error and (workspace / "up.txt").read_text() == "hi"
        assert not (workspace / "sessions").exists()
        assert "a new MCP session works in" not in started.log.read_text()
    finally:
        await asyncio.to_thread(stop_server, started.process)


async def test_a_closed_session_stops_its_kernel(server: HttpServer) -> None:
    before = _kernels(server.process)
    async with connected(server.url, url_token=TOKEN) as client:
        pid = int(text_of(await run(client, "import os; os.getpid()")))
        assert pid in _kernels(server.process)
    # Its kernel and the spare kernel it keeps for a fast reset both go.
    assert await asyncio.to_thread(wait_until, lambda: _kernels(server.process) <= before - {pid})


@pytest.mark.slow
async def test_a_token_is_generated_and_printed_once_when_none_is_set(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "IPYBOX_MCP_TOKEN"}
    (tmp_path / "workspace").mkdir()
    started = await asyncio.to_thread(start_server, tmp_path / "workspace", tmp_path / "server.log", env)
    try:
        await asyncio.to_thread(wait_until, lambda: "bearer token" in started.log.read_text())
        lines = [line for line in started.log.read_text().splitlines() if "bearer token" in line]
        assert len(lines) == 1
        token = lines[0].rsplit(" ", 1)[1]
        async with connected(started.url, url_token=token) as client:
            tools = await client.list_tools()
            assert "execute_ipython_cell" in {tool.name for tool in tools.tools}
            assert text_of(await run(client, "6 * 7")) == "42"
    finally:
        await asyncio.to_thread(stop_server, started.process)


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
    return alive


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow
async def test_a_signal_stops_the_http_server_with_its_sessions(tmp_path: Path, signum: int) -> None:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    (tmp_path / "workspace").mkdir()
    started = await asyncio.to_thread(start_server, tmp_path / "workspace", tmp_path / "server.log", env)
    try:
        async with connected(started.url, url_token=TOKEN) as client:
            assert not (await run(client, "x = 1")).is_error
            tree = {child.pid for child in psutil.Process(started.process.pid).children(recursive=True)}
            assert _kernels(started.process)
            os.kill(started.process.pid, signum)
            await asyncio.to_thread(started.process.wait, 60)
        assert await asyncio.to_thread(wait_until, lambda: not _alive(tree))
    finally:
        await asyncio.to_thread(stop_server, started.process)


@pytest.mark.slow
async def test_a_signal_stops_an_idle_http_server_with_its_warm_executor(tmp_path: Path) -> None:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    (tmp_path / "workspace").mkdir()
    started = await asyncio.to_thread(start_server, tmp_path / "workspace", tmp_path / "server.log", env)
    try:
        # The executor started with the server, for the first session, is running but unused.
        tree = {child.pid for child in psutil.Process(started.process.pid).children(recursive=True)}
        assert _kernels(started.process)
        assert len(list((tmp_path / "workspace" / "sessions").iterdir())) == 1
        started.process.terminate()
        await asyncio.to_thread(started.process.wait, 60)
        assert await asyncio.to_thread(wait_until, lambda: not _alive(tree))
        # Its folder, which no session used, is gone too.
        assert list((tmp_path / "workspace" / "sessions").iterdir()) == []
    finally:
        await asyncio.to_thread(stop_server, started.process)


async def _post(
    http: httpx2.AsyncClient, url: str, body: Mapping[str, object], session: str | None = None
) -> httpx2.Response:
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}
    if session is not None:
        headers["Mcp-Session-Id"] = session
    return await http.post(url, json=body, headers=headers)


@pytest.mark.slow
async def test_an_idle_session_is_closed_after_the_session_timeout(tmp_path: Path) -> None:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    (tmp_path / "workspace").mkdir()
    started = await asyncio.to_thread(
        start_server, tmp_path / "workspace", tmp_path / "server.log", env, "--session-timeout", "2"
    )
    try:
        # Plain HTTP requests, so that no GET stream keeps the session busy between them.
        async with httpx2.AsyncClient(timeout=60) as http:
            init = {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            }
            opened = await _post(
                http, started.url, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}
            )
            assert opened.status_code == 200, opened.text
            session = opened.headers["mcp-session-id"]
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            assert (await _post(http, started.url, note, session)).status_code == 202
            call = {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "execute_ipython_cell", "arguments": {"code": "import os; os.getpid()"}},
            }
            answer = await _post(http, started.url, call, session)
            assert answer.status_code == 200, answer.text
            pid = int(re.search(r'"text":\s*"(\d+)"', answer.text).group(1))  # type: ignore[union-attr]
            assert pid in _kernels(started.process)
            # No request for 2 s: the session is closed and its kernel stopped.
            assert await asyncio.to_thread(wait_until, lambda: pid not in _kernels(started.process))
            assert (await _post(http, started.url, call, session)).status_code == 404
    finally:
        await asyncio.to_thread(stop_server, started.process)
