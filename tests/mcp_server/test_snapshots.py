"""The MCP server's `save_snapshot` / `load_snapshot` tools, and the snapshot of an idle HTTP session.

Attacks: a session cannot load another session's snapshot by name (nor by a path for a name), and
a sandboxed session's kernel cannot read another session's snapshot file; an idle session's
snapshot goes only to the client that holds the old session's id, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp.client import Client
from mcp.shared.exceptions import MCPError

from tests.mcp_server.support import connected, run, stdio_params, text_of, wait_until
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


async def _call(client: Client, tool: str, **arguments: str) -> tuple[bool, str]:
    result = await client.call_tool(tool, arguments)
    return bool(result.is_error), text_of(result)


async def test_a_snapshot_is_saved_and_loaded_by_name_in_the_sessions_folder(tmp_path: Path) -> None:
    async with connected(stdio_params(tmp_path)) as client:
        await run(client, "import math as m\ndef area(r):\n    return m.pi * r * r\nsides = [3, 4, 5]")
        failed, text = await _call(client, "save_snapshot", name="shapes")
        assert not failed and "Saved snapshot 'shapes': 2 names (area, sides), modules m=math" in text
        assert "Never kept: IPython's own history" in text
        assert (tmp_path / "snapshots" / "shapes.ipybox-snapshot").is_file()
        await client.call_tool("reset", {})
        failed, text = await _call(client, "load_snapshot", name="shapes")
        assert not failed and text.startswith("Loaded snapshot 'shapes': 2 names")
        assert text_of(await run(client, "print(round(area(1), 2), sides)")) == "3.14 [3, 4, 5]"
        for bad in ["../shapes", "/etc/passwd", "", "a/b"]:
            failed, text = await _call(client, "load_snapshot", name=bad)
            assert failed and "is not a snapshot name: use 1 to 64 letters" in text
        failed, text = await _call(client, "load_snapshot", name="never-saved")
        assert failed and "There is no snapshot at 'never-saved.ipybox-snapshot'" in text


@pytest.mark.slow
@pytest.mark.parametrize("sandbox", [False, True], ids=["plain", "sandboxed"])
async def test_attack_a_session_cannot_load_or_read_another_sessions_snapshot(
    tmp_path: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    with _server(tmp_path, *(["--sandbox"] if sandbox else [])) as server:
        async with (
            connected(server.url, url_token=TOKEN) as first,
            connected(server.url, url_token=TOKEN) as second,
        ):
            await run(first, "secret = 'of the first session'")
            failed, _ = await _call(first, "save_snapshot", name="mine")
            assert not failed
            folder = Path(text_of(await run(first, "import os\nprint(os.getcwd())")))
            file = folder / "snapshots" / "mine.ipybox-snapshot"
            assert file.is_file()
            failed, text = await _call(second, "load_snapshot", name="mine")
            assert failed and "There is no snapshot" in text
            read = text_of(
                await run(
                    second,
                    f"try:\n    print(len(open({str(file)!r}, 'rb').read()))\nexcept OSError as e:\n"
                    "    print(type(e).__name__)",
                )
            )
            if sandbox:
                assert read in ("PermissionError", "FileNotFoundError")
            assert "secret" not in text_of(await run(second, "print(sorted(dir()))"))


@pytest.mark.slow
async def test_an_idle_session_is_snapshotted_and_its_client_can_load_it_in_a_new_session_once(
    tmp_path: Path,
) -> None:
    # 5 s: far longer than the client takes between two requests, however loaded the machine.
    with _server(tmp_path, "--session-idle-timeout", "5") as server:
        async with connected(server.url, url_token=TOKEN) as idle:
            await run(idle, "def greet(n):\n    return 'hi ' + n\nseen = {'a': 1}")
            assert await asyncio.to_thread(
                wait_until, lambda: "closed MCP session" in server.log.read_text(), 120
            )
            with pytest.raises(MCPError) as refused:
                await run(idle, "1 + 1")
        match = re.search(r"load_snapshot\(name='(idle-[0-9a-f]+)'\)", str(refused.value))
        assert match, str(refused.value)
        async with connected(server.url, url_token=TOKEN) as fresh:
            failed, text = await _call(fresh, "load_snapshot", name=match[1])
            assert not failed and "2 names (greet, seen)" in text
            assert text_of(await run(fresh, "print(greet('there'), seen)")) == "hi there {'a': 1}"
        async with connected(server.url, url_token=TOKEN) as other:
            failed, text = await _call(other, "load_snapshot", name=match[1])
            assert failed and "There is no snapshot" in text
