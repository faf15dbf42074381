"""Sandboxed MCP servers: srt as the command of a stdio server (the published filesystem server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources
from ipybox.kernel_mgr import _sandbox
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.asyncio


@pytest.mark.timeout(300)
async def test_an_mcp_server_run_by_srt_lists_files_but_cannot_read_dotenv(tmp_path: Path) -> None:
    """srt as the command of a stdio server: the published filesystem server in a sandbox whose
    settings deny `.env` (npx may fetch the package: the registry is the one allowed domain)."""
    require_sandbox()
    files = tmp_path / "files"
    files.mkdir()
    (files / ".env").write_text("TOKEN=server-secret\n")
    (files / "notes.txt").write_text("hello")
    settings = tmp_path / "srt-settings.json"
    settings.write_text(
        json.dumps(
            {
                "network": {"allowedDomains": ["registry.npmjs.org"], "deniedDomains": []},
                "filesystem": {
                    "denyRead": [str(files / ".env")],
                    "allowWrite": [str(Path.home() / ".npm")],
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
            str(files),
        ],
        # srt leaves its proxy's socket in TMPDIR: here, not in /tmp.
        "env": {"TMPDIR": str(tmp_path)},
    }
    tools = await generate_mcp_sources("files", params, tmp_path / "mcptools")
    assert "list_directory" in tools and "read_text_file" in tools
    async with CodeExecutor(working_dir=tmp_path, approve_tool_calls=False) as ex:
        listing = (
            f"from mcptools.files import list_directory as l\nprint(l.run(l.Params(path={str(files)!r})))"
        )
        text = (await ex.execute(listing, timeout=120)).text or ""
        assert ".env" in text and "notes.txt" in text
        read = "from mcptools.files import read_text_file as r\nprint(r.run(r.Params(path={!r})).content)"
        assert (await ex.execute(read.format(str(files / "notes.txt")), timeout=60)).text == "hello"
        with pytest.raises(CodeExecutionError) as info:
            await ex.execute(read.format(str(files / ".env")), timeout=60)
        assert info.value.ename == "ToolRunnerError"
        assert "server-secret" not in str(info.value)
        assert "permission denied" in str(info.value).lower() or "EACCES" in str(info.value)
