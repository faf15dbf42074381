"""Sandboxed MCP servers: srt as the command of a stdio server (the published filesystem server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources
from ipybox.app import sandbox as _sandbox  # private: the srt that sandboxed MCP servers run under
from tests.net_support import host_of, npm_registry_url
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


@pytest.mark.timeout(300)
async def test_an_mcp_server_run_by_srt_serves_the_workspace_but_cannot_read_dotenv(tmp_path: Path) -> None:
    """srt as the command of a stdio server: the published filesystem server, given the sandboxed
    kernel's working directory as its data, in a sandbox whose settings (kept outside that folder)
    deny `.env` (npx may fetch the package: the registry is the one allowed domain). This is the
    one form under which a server may name the workspace: without srt it is refused."""
    require_sandbox()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".env").write_text("TOKEN=server-secret\n")
    (work / "notes.txt").write_text("hello")
    settings = tmp_path / "srt-settings.json"
    settings.write_text(
        json.dumps(
            {
                "network": {"allowedDomains": [host_of(npm_registry_url())], "deniedDomains": []},
                "filesystem": {
                    "denyRead": [str(work / ".env")],
                    "allowWrite": [str(Path.home() / ".npm"), str(work)],
                    "denyWrite": [],
                },
            }
        )
    )
    srt = _sandbox.find_srt()
    params = {
        "command": srt,
        "args": [
            "--settings",
            str(settings),
            "npx",
            "-y",
            "@modelcontextprotocol/server-filesystem",
            str(work),
        ],
        # srt leaves its proxy's socket in TMPDIR: here, not in /tmp.
        "env": {"TMPDIR": str(tmp_path)},
    }
    tools = await generate_mcp_sources("files", params, work / "mcptools")
    assert "list_directory" in tools and "read_text_file" in tools
    async with CodeExecutor(sandbox=True, working_dir=work, approve_tool_calls=False) as ex:
        listing = (
            f"from mcptools.files import list_directory as l\nprint(l.run(l.Params(path={str(work)!r})))"
        )
        text = (await ex.execute(listing, timeout=120)).text or ""
        assert ".env" in text and "notes.txt" in text
        # What the kernel writes, the server reads: the workspace is its data.
        await ex.execute("open('from-kernel.txt', 'w').write('written in the kernel')")
        read = "from mcptools.files import read_text_file as r\nprint(r.run(r.Params(path={!r})).content)"
        assert (await ex.execute(read.format(str(work / "notes.txt")), timeout=60)).text == "hello"
        written = await ex.execute(read.format(str(work / "from-kernel.txt")), timeout=60)
        assert written.text == "written in the kernel"
        with pytest.raises(CodeExecutionError) as info:
            await ex.execute(read.format(str(work / ".env")), timeout=60)
        assert info.value.ename == "ToolRunnerError"
        assert "server-secret" not in str(info.value)
        assert "permission denied" in str(info.value).lower() or "EACCES" in str(info.value)
