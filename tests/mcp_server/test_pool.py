"""``ipybox --pool N``: one kernel pool (and one gateway) for the whole MCP server."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from tests.mcp_server.support import connected, run, stdio_params, text_of, wait_until
from tests.mcp_server.test_http import TOKEN, start_server, stop_server

pytestmark = pytest.mark.slow


def _under(process_pid: int, marker: str) -> set[int]:
    found = set()
    for child in psutil.Process(process_pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and marker in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


def _parent(pid: int) -> int | None:
    try:
        parent: int = psutil.Process(pid).ppid()
        return parent
    except psutil.Error:
        return None


def test_a_negative_pool_size_is_refused(tmp_path: Path) -> None:
    from ipybox.mcp_server._cli import parse_args  # private: the CLI's parser, tested without a process

    with pytest.raises(SystemExit):
        parse_args(["--workspace", str(tmp_path), "--pool", "-1"])
    assert parse_args(["--workspace", str(tmp_path), "--pool", "2"]).pool == 2


@pytest.mark.parametrize("shared", [False, True], ids=["session-folders", "shared-workspace"])
async def test_http_sessions_take_kernels_from_one_pool_on_one_gateway_and_nothing_outlives_the_server(
    tmp_path: Path, shared: bool
) -> None:
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    extra = ["--shared-workspace"] if shared else []
    started = await asyncio.to_thread(
        start_server, workspace, tmp_path / "server.log", env, *extra, "--pool", "2"
    )
    process = psutil.Process(started.process.pid)
    try:
        async with (
            connected(started.url, url_token=TOKEN) as first,
            connected(started.url, url_token=TOKEN) as second,
        ):
            assert not (await run(first, "secret = 'first'")).is_error
            other = await run(second, "secret")
            assert other.is_error and "NameError" in text_of(other)
            pids = {text_of(await run(client, "import os; os.getpid()")) for client in (first, second)}
            assert len(pids) == 2
            gateways = _under(started.process.pid, "ipybox.gateway._main")
            # A kernel the gateway is forking shows the gateway's command line until it execs:
            # count only processes whose parent is not itself a gateway.
            assert len({pid for pid in gateways if _parent(pid) not in gateways}) == 1
            # The person who started the server saw the pool fill.
            log = tmp_path / "server.log"
            assert await asyncio.to_thread(wait_until, lambda: "kernels ready: 2 of 2" in log.read_text())
            cwds = {text_of(await run(client, "import os; print(os.getcwd())")) for client in (first, second)}
            if shared:
                assert cwds == {str(workspace.resolve())}
            else:  # each in a session folder of its own, made ahead by the pool
                assert len(cwds) == 2
                assert all(Path(cwd).parent == (workspace / "sessions").resolve() for cwd in cwds)
            # A reset takes a fresh kernel from the pool.
            assert not (await first.call_tool("reset", {})).is_error
            after = text_of(await run(first, "import os; os.getpid()"))
            assert after not in pids
            assert "NameError" in text_of(await run(first, "secret"))
        tree = {child.pid for child in process.children(recursive=True)}
    finally:
        await asyncio.to_thread(stop_server, started.process)
    assert started.process.returncode is not None
    assert await asyncio.to_thread(wait_until, lambda: not any(psutil.pid_exists(pid) for pid in tree))


async def test_the_stdio_session_takes_its_kernels_from_the_pool(tmp_path: Path) -> None:
    async with connected(stdio_params(tmp_path, "--pool", "1")) as client:
        first = text_of(await run(client, "import os; x = 1; os.getpid()"))
        assert not (await client.call_tool("reset", {})).is_error
        second = text_of(await run(client, "import os; os.getpid()"))
        assert first != second
        assert "NameError" in text_of(await run(client, "x"))
