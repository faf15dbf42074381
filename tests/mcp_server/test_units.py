"""The MCP server's pure parts: install commands, output shaping, Host names."""

from __future__ import annotations

# private-ok: the unit tests of the MCP server's internal parts (install commands, output shaping,
# Host names, the session table, the CLI's parser), which the public server only reaches whole.
import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from mcp.shared.exceptions import MCPError

from ipybox.app import sandbox as _sandbox
from ipybox.mcp_server import _files, _http, _install, _output
from ipybox.mcp_server._http import SessionTable, allowed_hosts
from ipybox.mcp_server._install import Installer, InstallError, packages_dir
from ipybox.mcp_server._server import Settings, new_session_folder


def test_install_commands_take_one_requirement_and_never_an_option() -> None:
    installer = Installer(Path("/state/site"), python="/env/bin/python")
    for spec in [
        "requests",
        "pandas>=2.2",
        "httpx[http2]==0.28.1",
        "pkg ; python_version>'3'",
        "git+https://x/y.git",
    ]:
        command = installer.command(spec)
        assert command[-1] == spec.strip() and "/env/bin/python" in command
        assert command[command.index("--target") + 1] == "/state/site"
    for bad in ["", "-r requirements.txt", "--index-url http://evil", "a b", "pkg\n--pre", "git+https://x y"]:
        with pytest.raises(InstallError):
            installer.command(bad)


def test_under_the_sandbox_installs_are_wheels_into_a_kernel_only_folder(tmp_path: Path) -> None:
    installer = Installer(tmp_path / "site", python="/env/bin/python", sandboxed=True)
    command = installer.command("requests==2.32.3")
    assert command[command.index("--target") + 1] == str(tmp_path / "site")
    assert command[command.index("--only-binary") + 1] == ":all:"
    with pytest.raises(InstallError, match="sandbox"):
        installer.command("git+https://example.com/pkg.git")


def test_installers_read_no_configuration_and_a_sandboxed_one_reaches_only_the_index(tmp_path: Path) -> None:
    environ = {
        "PATH": "/bin",
        "HOME": "/h",
        "AWS_SECRET_ACCESS_KEY": "s",
        "PIP_INDEX_URL": "https://idx.example/simple",
    }
    installer = Installer(tmp_path / "site", python="/env/bin/python", sandboxed=True, environ=environ)
    env = installer.environment(tmp_path)
    assert (
        env["UV_NO_CONFIG"] == "1" and env["UV_LINK_MODE"] == "copy" and env["PIP_CONFIG_FILE"] == os.devnull
    )
    assert "AWS_SECRET_ACCESS_KEY" not in env and env["TMPDIR"] == str(tmp_path)
    assert installer.index_hosts() == ["idx.example"]
    # Nothing configured: the installer's own default index.
    assert Installer(tmp_path, environ={}).index_hosts() == list(_install._PYPI_HOSTS)


def test_output_is_cleaned_and_truncated_with_a_marker_naming_the_full_file(tmp_path: Path) -> None:
    assert _output.clean("\x1b[1;31mred\x1b[0m\n10%\r50%\r100%\nend\r") == "red\n100%\nend"
    text = "A" * 100 + "B" * 10_000 + "Z" * 100
    short = _output.truncate(text, 1000, tmp_path)
    assert short.startswith("A" * 100) and short.endswith("Z" * 100) and len(short) < 1200
    name = short.split(" is in ")[0].split("output is in ")[-1]
    saved = next((tmp_path / ".ipybox" / "outputs").iterdir())
    assert saved.read_text() == text and saved.name in short
    assert name
    assert _output.truncate("short", 1000, tmp_path) == "short"
    assert _output.last_line("one\ntwo\r\x1b[2Kthree\n\n") == "three"


def test_allowed_hosts_are_the_servers_own_address_and_loopback_names() -> None:
    assert allowed_hosts("127.0.0.1", 8000, []) == {"127.0.0.1:8000", "localhost:8000", "[::1]:8000"}
    assert "box.example:8000" in allowed_hosts("0.0.0.0", 8000, ["box.example"])
    assert "proxy.example:443" in allowed_hosts("127.0.0.1", 8000, ["proxy.example:443"])
    assert allowed_hosts("10.0.0.5", 9000, []) == {"10.0.0.5:9000"}


def test_sandbox_options_reach_the_executor_and_the_kernel_env_is_an_allow_list(tmp_path: Path) -> None:
    config = tmp_path / "srt.json"
    config.write_text("{}")
    (tmp_path / ".env").write_text("KERNEL_ENV_A=from-dotenv\nKERNEL_ENV_B=dotenv-loses\nTOKEN=secret\n")
    environ = {
        "HOME": "/home/agent",
        "KERNEL_ENV_B": "environ-wins",
        "PATH": "/bin",
        "KEY": "s",
    }
    settings = Settings(workspace=tmp_path, sandbox=True, sandbox_config=config, environ=environ)
    made = settings.executor().settings
    assert made.sandbox and made.sandbox_config == config
    assert made.working_dir == tmp_path.resolve() and not made.approve_tool_calls
    assert made.kernel_env == {
        "HOME": "/home/agent",
        "A": "from-dotenv",
        "B": "environ-wins",
        "PYTHONPATH": str(packages_dir(tmp_path)),
    }
    assert settings.installer().target == packages_dir(tmp_path) and settings.installer().sandboxed
    assert not packages_dir(tmp_path).is_relative_to(tmp_path)
    # Without the sandbox too, installs go to the same folder, ahead of the kernel's own path.
    plain = Settings(workspace=tmp_path, environ={"HOME": "/h", "KERNEL_ENV_PYTHONPATH": "/mine"})
    assert plain.kernel_env()["PYTHONPATH"] == f"{packages_dir(tmp_path)}{os.pathsep}/mine"
    assert plain.installer().target == packages_dir(tmp_path) and not plain.installer().sandboxed


def test_a_sessions_own_folder_is_its_working_directory_and_the_other_sessions_are_hidden(
    tmp_path: Path,
) -> None:
    settings = Settings(workspace=tmp_path, sandbox=True, session_folders=True, environ={"HOME": "/h"})
    folder = new_session_folder(tmp_path)
    assert folder.parent == tmp_path / "sessions" and folder.stat().st_mode & 0o777 == 0o700
    made = settings.executor(folder).settings
    assert made.working_dir == folder and made.images_dir == folder / "images"
    assert made.sandbox_hidden == (tmp_path / "sessions",)
    assert made.kernel_env["PYTHONPATH"] == str(packages_dir(folder)) != str(packages_dir(tmp_path))
    assert settings.installer(folder).target == packages_dir(folder)
    assert Settings(workspace=tmp_path, sandbox=True).executor().settings.sandbox_hidden == ()
    # A custom config that lets kernels write the whole workspace: the session's own folder is
    # named, so that srt binds it back writable over the hidden sessions folder.
    config = {"filesystem": {"denyRead": [], "allowWrite": [str(tmp_path)], "denyWrite": []}}
    hidden = (tmp_path / "sessions",)
    rules = _sandbox.sandbox_settings(
        config, working_dir=folder, private_dirs=[], protected=[], tool_socket=None, hidden=hidden
    )["filesystem"]
    assert str(tmp_path / "sessions") in rules["denyRead"]
    assert str(folder) in rules["allowRead"] and str(folder) in rules["allowWrite"]
    other = tmp_path / "sessions" / "other"
    read_only: dict[str, Any] = {
        "filesystem": {
            "denyRead": [],
            "allowRead": [str(tmp_path / "sessions"), str(folder / "data")],
            "allowWrite": [str(other)],
            "denyWrite": [],
        }
    }
    rules = _sandbox.sandbox_settings(
        read_only, working_dir=folder, private_dirs=[], protected=[], tool_socket=None, hidden=hidden
    )["filesystem"]
    assert str(folder) in rules["allowRead"] and str(folder) not in rules["allowWrite"]
    # Nothing the settings allow re-opens the sessions folder, but inside the session's own.
    assert str(folder / "data") in rules["allowRead"]
    assert str(tmp_path / "sessions") not in rules["allowRead"] and str(other) not in rules["allowWrite"]


def test_only_the_most_recent_full_outputs_are_kept(tmp_path: Path) -> None:
    for _ in range(_output._KEEP_OUTPUTS + 5):
        _output.truncate("x" * 500, 200, tmp_path)
    assert len(list((tmp_path / ".ipybox" / "outputs").iterdir())) == _output._KEEP_OUTPUTS


def test_pep508_direct_references_and_file_urls_are_refused_under_the_sandbox(tmp_path: Path) -> None:
    plain = Installer(tmp_path / "site", python="/env/bin/python")
    sandboxed = Installer(tmp_path / "site", python="/env/bin/python", sandboxed=True)
    for spec in [
        "pkg @ git+https://github.com/x/y",
        "pkg[extra] @ https://example.com/pkg-1.0.tar.gz",
        "pkg@file:///tmp/pkg",
        "pkg @ file:///tmp/pkg ; python_version>'3'",
        "file:///tmp/pkg",
        "https://example.com/pkg-1.0-py3-none-any.whl",
    ]:
        assert plain.command(spec)[-1] == spec
        with pytest.raises(InstallError, match="refused under --sandbox"):
            sandboxed.command(spec)
    assert sandboxed.command("pkg ; python_version>'3'")[-1] == "pkg ; python_version>'3'"


def test_a_server_folder_behind_a_link_is_refused(tmp_path: Path) -> None:
    workspace, outside = tmp_path / "workspace", tmp_path / "outside"
    (workspace / ".ipybox").mkdir(parents=True)
    outside.mkdir()
    assert (
        _files.server_folder(workspace, workspace / ".ipybox" / "outputs")
        == workspace / ".ipybox" / "outputs"
    )
    (workspace / ".ipybox" / "outputs").symlink_to(outside)
    with pytest.raises(_files.WorkspacePathError, match="symbolic link"):
        _files.server_folder(workspace, workspace / ".ipybox" / "outputs")
    # A link further up counts too, even one that stays inside the workspace.
    (workspace / "real").mkdir()
    (workspace / "mcptools").symlink_to(workspace / "real")
    with pytest.raises(_files.WorkspacePathError, match="symbolic link"):
        _files.server_folder(workspace, workspace / "mcptools" / "demo")
    with pytest.raises(_files.WorkspacePathError):
        _files.server_folder(workspace, tmp_path / "elsewhere")
    short = _output.truncate("A" * 5000, 1000, workspace)
    assert "the complete output was not saved" in short and not list(outside.iterdir())


class _StubExecutor:
    def __init__(self, stopped: list[int], number: int) -> None:
        self.stopped, self.number = stopped, number

    async def stop(self) -> None:
        self.stopped.append(self.number)


class _StubSettings:
    """Counts the executors a SessionTable starts and stops; `fail` makes starting fail."""

    session_folders = False

    def __init__(self, fail: bool = False) -> None:
        self.started = 0
        self.stopped: list[int] = []
        self.fail = fail

    async def start_session(self) -> Any:
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("no kernel today")
        self.started += 1
        return SimpleNamespace(executor=_StubExecutor(self.stopped, self.started))


def _ctx(session_id: str) -> Any:
    return SimpleNamespace(request=SimpleNamespace(headers={"mcp-session-id": session_id}))


async def test_a_session_table_starts_one_executor_per_session_and_forgets_ended_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _StubSettings()
    table = SessionTable(cast(Any, settings))
    owner = asyncio.create_task(table.own(_ctx("a"), cast(Any, None)))
    tools = await table.get(_ctx("a"))
    # A second notifications/initialized of the session starts nothing and ends at once.
    await asyncio.wait_for(table.own(_ctx("a"), cast(Any, None)), timeout=5)
    assert settings.started == 1 and len(table) == 1 and await table.get(_ctx("a")) is tools
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    assert len(table) == 0 and settings.stopped == [1]

    # A session that never initializes leaves nothing behind.
    monkeypatch.setattr(_http, "_SESSION_START_TIMEOUT", 0.2)
    with pytest.raises(MCPError, match="did not start"):
        await table.get(_ctx("never"))
    assert len(table) == 0


async def test_a_session_whose_executor_failed_reports_it_and_is_forgotten_when_it_ends() -> None:
    table = SessionTable(cast(Any, _StubSettings(fail=True)))
    owner = asyncio.create_task(table.own(_ctx("b"), cast(Any, None)))
    with pytest.raises(MCPError, match="no kernel today"):
        await asyncio.wait_for(table.get(_ctx("b")), timeout=5)
    assert len(table) == 1
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    assert len(table) == 0


def test_approve_tool_calls_and_otel_reach_the_executor_and_bad_timeouts_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ipybox.mcp_server._cli import parse_args

    args = parse_args(
        ["--workspace", str(tmp_path), "--approve-tool-calls", "--approval-timeout", "5", "--otel"]
    )
    assert args.approve_tool_calls and args.approval_timeout == 5 and args.otel
    settings = Settings(
        workspace=tmp_path, approve_tool_calls=True, approval_timeout=5, environ={"HOME": "/h"}
    )
    executor = settings.executor()
    assert executor.settings.approve_tool_calls and executor.settings.approve_shell_cmds
    assert executor.settings.approval_timeout == 5
    assert not parse_args(["--workspace", str(tmp_path)]).approve_tool_calls
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse_args(["--workspace", str(tmp_path), "--approval-timeout", bad])
        assert "--approval-timeout" in capsys.readouterr().err


def test_the_idle_timeout_and_the_session_cap_are_parsed_and_bad_values_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ipybox.mcp_server._cli import parse_args

    http = ["--workspace", str(tmp_path), "--transport", "streamable-http"]
    args = parse_args(http)
    assert args.session_timeout == 3600 and args.max_sessions is None
    assert parse_args([*http, "--session-idle-timeout", "none"]).session_timeout is None
    assert parse_args([*http, "--session-timeout", "90", "--max-sessions", "4"]).session_timeout == 90
    for bad in (
        ["--max-sessions", "0"],
        ["--session-idle-timeout", "soon"],
        ["--session-idle-timeout", "-1"],
    ):
        with pytest.raises(SystemExit):
            parse_args([*http, *bad])
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--workspace", str(tmp_path), "--max-sessions", "4"])
    assert "only with --transport streamable-http" in capsys.readouterr().err


async def test_a_session_whose_cell_runs_with_no_request_in_flight_is_not_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ipybox.mcp_server import _session_limits

    monkeypatch.setattr(_session_limits, "_BUSY_RECHECK", 0.01)
    limits = _session_limits.SessionLimits(idle_timeout=0.01)
    looked: list[bool] = []

    def cell_running() -> bool:
        # The cell (one waiting for an approval over the 2026 protocol) runs for three looks.
        looked.append(len(looked) < 3)
        return looked[-1]

    await asyncio.wait_for(limits.until_idle("s", cell_running), timeout=30)
    # Closed only once it was seen not running; the session's id then answers with the reason.
    assert looked[-1] is False and looked.count(True) == 3
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    app = limits.wrap(cast(Any, None))
    await app(
        {"type": "http", "method": "POST", "headers": [(b"mcp-session-id", b"s")]}, cast(Any, None), send
    )
    assert sent[0]["status"] == 404 and b"closed after 0.01 s without requests" in sent[1]["body"]
