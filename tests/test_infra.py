"""The application's shared infrastructure, each helper on real sockets, servers and processes.

The public servers built on it are attacked in tests/app/tools/test_security.py (tool server) and
tests/mcp_server/test_http.py (MCP server).
"""

from __future__ import annotations

# private-ok: ipybox._infra is internal; each of its helpers is tested here on its own.
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx2
import psutil
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from ipybox._infra import BearerToken, Guard, Uvicorn, kill_tree, listen, running, strip_ansi

TOKEN = "infra-token-0123456789"


async def _hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def _hello_ws(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


@pytest.fixture
async def guarded() -> AsyncIterator[int]:
    """A real uvicorn server behind a `Guard`, on a socket from `listen`; yields its port."""
    app = Starlette(routes=[Route("/", _hello), WebSocketRoute("/ws", _hello_ws)])
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = Uvicorn(
        Guard(app, token=TOKEN, allowed_hosts={f"127.0.0.1:{port}", f"localhost:{port}"}),
        log_config=None,
        log_level=None,
        lifespan="off",
    )
    task = await server.start([sock])
    try:
        yield port
    finally:
        server.request_exit()
        await task
        sock.close()


async def _http_status(port: int, headers: dict[str, str]) -> int:
    async with httpx2.AsyncClient(timeout=10) as http:
        return (await http.get(f"http://127.0.0.1:{port}/", headers=headers)).status_code


async def _ws_status(port: int, headers: dict[str, str]) -> int:
    """101 when the WebSocket opens (and says hello), else the status it was refused with."""
    try:
        async with ws_connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers, open_timeout=10) as ws:
            assert await ws.recv() == "hello"
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


ACCEPTED = [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER   {TOKEN}"]
REFUSED = [
    "",
    TOKEN,
    f"Basic {TOKEN}",
    f"Bearer{TOKEN}",
    f"Bearer {TOKEN.upper()}",
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    f"Bearer {TOKEN} {TOKEN}",
    "Bearer",
]


@pytest.mark.parametrize("authorization", ACCEPTED)
async def test_the_token_is_accepted_with_any_case_of_the_scheme_and_white_space_around(
    guarded: int, authorization: str
) -> None:
    # White space around the value: HTTP servers strip it before the application sees the header.
    assert BearerToken(TOKEN).accepts(f" \t{authorization}  ".encode())
    assert await _http_status(guarded, {"Authorization": authorization}) == 200
    assert await _ws_status(guarded, {"Authorization": authorization}) == 101


@pytest.mark.parametrize("authorization", REFUSED)
async def test_anything_but_the_token_is_refused_over_http_and_websocket(
    guarded: int, authorization: str
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    assert not BearerToken(TOKEN).accepts(authorization)
    assert await _http_status(guarded, headers) == 401
    assert await _ws_status(guarded, headers) == 403


async def test_a_foreign_host_or_origin_is_refused_over_http_and_websocket(guarded: int) -> None:
    token = {"Authorization": f"Bearer {TOKEN}"}
    foreign_host = {**token, "Host": "evil.example"}
    foreign_origin = {**token, "Origin": "http://evil.example"}
    assert await _http_status(guarded, foreign_host) == 421
    assert await _http_status(guarded, foreign_origin) == 403
    # What a web page after a DNS rebinding, or on another site, would open.
    assert await _ws_status(guarded, foreign_host) == 403
    assert await _ws_status(guarded, foreign_origin) == 403
    same_origin = {**token, "Origin": f"http://localhost:{guarded}/"}
    assert await _http_status(guarded, same_origin) == 200
    assert await _ws_status(guarded, same_origin) == 101


def test_an_empty_token_is_refused_when_the_check_is_built() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        BearerToken("")


def test_listen_picks_a_free_port_and_a_taken_one_raises() -> None:
    with listen("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        assert port > 0
        with pytest.raises(OSError):
            listen("127.0.0.1", port)


def _start_tree(script: str, **kwargs: object) -> subprocess.Popen[str]:
    """A Python process that runs `script`; it prints its child's pid once it is ready."""
    process: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, **kwargs
    )
    return process


async def _ended(proc: psutil.Process) -> bool:
    """Whether `proc` ends within 30 s; an orphan that nobody reaps counts as ended as a zombie."""
    deadline = time.monotonic() + 30
    # Polling under a deadline: the process is no child of ours, nothing signals its end.
    while running(proc) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    return not running(proc)


_STUBBORN_TREE = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
signal.pause()
"""


async def test_kill_tree_kills_a_tree_that_ignores_sigterm_once_the_grace_is_over() -> None:
    with _start_tree(_STUBBORN_TREE) as process:
        assert process.stdout is not None
        child = psutil.Process(int(process.stdout.readline()))
        await kill_tree(process.pid, grace=0.2)
        assert process.wait(timeout=30) == -signal.SIGKILL
        assert await _ended(child)


async def test_kill_tree_with_group_kills_what_outlived_its_parent() -> None:
    # The leader starts a child in its own process group and exits: the orphan is no
    # descendant of anything we know, only of the group.
    script = "import subprocess, sys; print(subprocess.Popen(['sleep', '600']).pid, flush=True)"
    with _start_tree(script, start_new_session=True) as leader:
        assert leader.stdout is not None
        orphan = psutil.Process(int(leader.stdout.readline()))
        assert leader.wait(timeout=30) == 0
    assert orphan.is_running() and os.getpgid(orphan.pid) == leader.pid
    await kill_tree(leader.pid, grace=5, group=True)
    assert await _ended(orphan)


def test_strip_ansi_removes_every_kind_of_escape_sequence() -> None:
    coloured = "\x1b[1;31mred\x1b[0m"
    title = "\x1b]0;title\x07"
    link = "\x1b]8;;https://example.com\x1b\\link\x1b]8;;\x1b\\"
    dcs = "\x1bPq#0;2;0;0;0\x1b\\"
    two_byte = "\x1b7\x1bc\x1b(B"
    assert strip_ansi(f"{coloured} {title}{link} {dcs}{two_byte}done") == "red link done"
