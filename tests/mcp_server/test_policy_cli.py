"""``ipybox --policy FILE`` and ``ipybox audit``: the real server process, the SDK's client, an MCP
server with annotated tools, and the audit command reading what the server recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of

pytestmark = pytest.mark.slow
ANNOTATED = Path(__file__).parents[1] / "servers" / "annotated_server.py"
POLICY = """\
default = "ask"
trusted_servers = ["annot"]

[[rule]]
decision = "deny"
annotations = { destructiveHint = true }

[[rule]]
decision = "allow"
annotations = { readOnlyHint = true }
"""


def _audit(*args: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "ipybox", "audit", "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=server_env(),
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


async def test_the_servers_policy_file_decides_inner_calls_and_ipybox_audit_shows_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(tmp_path / "state"))
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    async with connected(stdio_params(workspace, "--policy", str(policy))) as client:
        params = {"command": sys.executable, "args": [str(ANNOTATED)]}
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "annot", "server_params": params}
        )
        assert not registered.is_error, text_of(registered)
        read = await run(
            client, "from mcptools.annot import read_item\nprint(read_item.run(read_item.Params(key='a')))"
        )
        assert text_of(read) == "read_item a"
        deleted = await run(
            client, "from mcptools.annot import delete_item\ndelete_item.run(delete_item.Params(key='a'))"
        )
        assert deleted.is_error
        # Who refused it, and where that rule is written (policy.toml's first [[rule]] is on line 4).
        assert f"Tool call annot.delete_item was refused by policy rule 1 ({policy.name}:4)." in text_of(
            deleted
        )
    records = _audit("--server", "annot")
    assert [(r["tool"], r["decision"], r["decided_by"], r["outcome"]) for r in records] == [
        ("read_item", "allowed", "rule 2", "ok"),
        ("delete_item", "denied", "rule 1", "rejected"),
    ]
    assert [r["tool"] for r in _audit("--decision", "denied")] == ["delete_item"]
