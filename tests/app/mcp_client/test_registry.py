"""The trusted registry of MCP servers."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Private: default_registry_path is internal (ServerRegistry and default_registry are public in
# ipybox.tool_exec.server).
from ipybox.app.mcp_client._registry import ServerRegistry, default_registry, default_registry_path
from ipybox.mcp_apigen import generate_mcp_sources
from ipybox.tool_exec.client import ToolRunner
from ipybox.tool_exec.server import ToolServer


def test_the_default_file_is_in_the_state_dir_named_by_the_environment(state_dir: Path) -> None:
    assert default_registry_path() == state_dir / "servers.json"
    assert default_registry().path == state_dir / "servers.json"


@pytest.mark.skipif(sys.platform != "linux", reason="XDG layout is the Linux default")
def test_without_ipybox_state_dir_the_xdg_state_home_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IPYBOX_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_registry_path() == tmp_path / "ipybox" / "servers.json"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_registry_path() == Path.home() / ".local" / "state" / "ipybox" / "servers.json"


def test_registered_params_are_stored_as_given_with_placeholders_and_private_mode(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPYBOX_T_SECRET", "do-not-store-me")
    registry = default_registry()
    params = {"url": "https://x.example/mcp", "headers": {"Authorization": "Bearer ${IPYBOX_T_SECRET}"}}
    registry.register("remote", params)
    assert registry.lookup("remote") == params
    text = registry.path.read_text()
    assert "${IPYBOX_T_SECRET}" in text
    assert "do-not-store-me" not in text
    assert stat.S_IMODE(os.stat(registry.path).st_mode) == 0o600
    assert [p.name for p in state_dir.iterdir() if p.name.startswith(".servers-")] == []


def test_lookup_returns_none_for_unknown_servers_and_a_copy_for_known_ones() -> None:
    registry = default_registry()
    assert registry.lookup("nothing") is None
    registry.register("a", {"command": "x", "args": ["1"]})
    found = registry.lookup("a")
    assert found is not None
    found["args"].append("mutated")
    assert registry.lookup("a") == {"command": "x", "args": ["1"]}


def test_a_registration_by_another_process_is_found() -> None:
    registry = default_registry()
    registry.register("first", {"command": "a"})
    assert registry.lookup("second") is None
    code = (
        "from ipybox.app.mcp_client._registry import default_registry\n"
        "default_registry().register('second', {'command': 'b'})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
    assert registry.lookup("second") == {"command": "b"}
    assert registry.lookup("first") == {"command": "a"}


def test_re_registering_replaces_and_unregister_removes() -> None:
    registry = default_registry()
    registry.register("a", {"command": "old"})
    registry.register("a", {"command": "new"})
    assert registry.lookup("a") == {"command": "new"}
    registry.unregister("a")
    registry.unregister("a")
    assert registry.lookup("a") is None
    assert json.loads(registry.path.read_text())["servers"] == {}


@pytest.mark.parametrize(
    ("name", "params"), [("", {"command": "x"}), ("a", ["command"]), ("a", {"x": object()})]
)
def test_bad_registrations_are_refused(name: str, params: object) -> None:
    with pytest.raises(ValueError):
        default_registry().register(name, params)  # type: ignore[arg-type]


def test_a_scope_sees_only_servers_whose_api_lies_in_it(tmp_path: Path) -> None:
    registry = default_registry()
    one, two = tmp_path / "one", tmp_path / "two"
    registry.register("a", {"command": "in-one"}, one / "mcptools")
    registry.register("a", {"command": "in-two"}, two / "mcptools")
    registry.register("plain", {"command": "unscoped"})
    assert registry.lookup("a", one) == {"command": "in-one"}
    assert registry.lookup("a", two) == {"command": "in-two"}
    assert registry.lookup("a", tmp_path / "three") is None
    # An application started in a parent folder reaches none of the projects' servers inside it.
    assert registry.lookup("a", tmp_path) is None
    registry.register("deep", {"command": "deep"}, one / "sub" / "mcptools")
    assert registry.lookup("deep", one) is None and registry.lookup("deep", one / "sub") == {
        "command": "deep"
    }
    # Several folders (a working directory and the PYTHONPATH entries the application chose).
    assert registry.lookup("deep", (tmp_path / "three", one / "sub")) == {"command": "deep"}
    assert registry.lookup("deep", (one, tmp_path)) is None
    # An unscoped registration is for standalone tool servers only.
    assert registry.lookup("plain", one) is None and registry.lookup("plain") == {"command": "unscoped"}
    # Without a scope the latest registration of a name wins.
    assert registry.lookup("a") == {"command": "in-two"}
    registry.unregister("a", two / "mcptools")
    assert registry.lookup("a", two) is None and registry.lookup("a") == {"command": "in-one"}


async def test_a_registry_passed_in_is_where_servers_are_recorded_and_looked_up(
    tmp_path: Path, demo_params: dict[str, Any]
) -> None:
    own = ServerRegistry(tmp_path / "own" / "servers.json")
    await generate_mcp_sources("demo", demo_params, tmp_path / "api", registry=own)
    assert own.lookup("demo") == demo_params
    assert default_registry().lookup("demo") is None
    async with ToolServer(registry=own, approval_required=False, log_level="WARNING") as server:
        runner = ToolRunner("demo", {}, port=server.port, token=server.token)
        assert await runner.run("echo", {"text": "hi"}) == "hi"
