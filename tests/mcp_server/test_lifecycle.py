"""The server's life cycle: closing stdin, SIGINT and SIGTERM leave no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import DEMO_SERVER, command_line
from tests.mcp_server.support import wait_until

pytestmark = pytest.mark.slow

_TIMEOUT = 60


def _send(process: subprocess.Popen[bytes], message: dict[str, Any]) -> None:
    assert process.stdin is not None
    process.stdin.write(json.dumps(message).encode() + b"\n")
    process.stdin.flush()


def _receive(process: subprocess.Popen[bytes], request_id: int) -> dict[str, Any]:
    assert process.stdout is not None
    while line := process.stdout.readline():
        message: dict[str, Any] = json.loads(line)
        if message.get("id") == request_id:
            return message
    raise AssertionError("the server closed stdout before answering")


def _start_busy_server(workspace: Path, module: str = "ipybox") -> tuple[subprocess.Popen[bytes], set[int]]:
    """A stdio server that has run code and started an MCP server; it and all its descendants."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--workspace", str(workspace), "--log-level", "ERROR"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    _send(
        process,
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        },
    )
    assert "result" in _receive(process, 1)
    _send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
    calls: list[tuple[str, dict[str, Any]]] = [
        ("register_mcp_server", {"server_name": "demo", "server_params": demo}),
        ("execute_ipython_cell", {"code": "from mcptools.demo.pid import Params, run\nrun(Params())"}),
    ]
    for request_id, (name, arguments) in enumerate(calls, start=2):
        _send(
            process,
            {
                "jsonrpc": "2.0",
                "id": request_id,
                "method": "tools/call",
                "params": {"name": name, "arguments": arguments},
            },
        )
        response = _receive(process, request_id)
        assert not response["result"].get("isError"), response
    tree = {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
    names = " ".join(command_line(pid) for pid in tree)
    assert "ipykernel" in names and "ipybox.gateway._main" in names and "demo_server" in names
    return process, tree | {process.pid}


def _assert_all_gone(process: subprocess.Popen[bytes], tree: set[int]) -> None:
    assert process.wait(timeout=_TIMEOUT) is not None
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()
    deadline = time.monotonic() + _TIMEOUT
    alive = tree
    while alive and time.monotonic() < deadline:
        alive = {
            pid
            for pid in alive
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        }
        time.sleep(0.1)  # polling process exits under a deadline
    assert not alive, [psutil.Process(pid).cmdline() for pid in alive]


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_closing_stdin_stops_everything(workspace: Path) -> None:
    process, tree = _start_busy_server(workspace)
    assert process.stdin is not None
    process.stdin.close()
    _assert_all_gone(process, tree)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_everything(workspace: Path, signum: int) -> None:
    process, tree = _start_busy_server(workspace)
    os.kill(process.pid, signum)
    _assert_all_gone(process, tree)


def test_the_reference_module_path_runs_the_server(workspace: Path) -> None:
    process, tree = _start_busy_server(workspace, module="ipybox.mcp_server")
    assert process.stdin is not None
    process.stdin.close()
    _assert_all_gone(process, tree)


@pytest.mark.timeout(300)
def test_sandbox_flag_reaches_the_http_servers_executors(workspace: Path) -> None:
    """Over HTTP, ``--sandbox`` goes to the executors too: the server starts the first session's
    executor before it listens, so it either listens sandboxed or stops with a clear error
    (stdio: test_sandboxed.py)."""
    http = ["--transport", "streamable-http", "--port", "0"]
    log = workspace / "stderr.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "ipybox", "--workspace", str(workspace), "--sandbox", *http],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
    try:
        assert wait_until(lambda: process.poll() is not None or "listening" in log.read_text(), _TIMEOUT)
    finally:
        process.terminate()
        process.wait(timeout=_TIMEOUT)
    stderr = log.read_text()
    if "listening" not in stderr and process.returncode != 0:
        assert "could not start" in stderr and "andbox" in stderr
        assert "Traceback" not in stderr


def test_a_sessions_folder_that_is_a_link_stops_the_http_server_with_a_clear_error(
    workspace: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (workspace / "sessions").symlink_to(elsewhere)
    http = ["--transport", "streamable-http", "--port", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "ipybox", "--workspace", str(workspace), *http],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=_TIMEOUT,
    )
    assert result.returncode == 1 and b"Traceback" not in result.stderr
    assert b"could not start: Cannot make a session folder" in result.stderr
    assert b"--shared-workspace" in result.stderr and not list(elsewhere.iterdir())


def test_bad_options_get_a_clear_error(workspace: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ipybox", "--sandbox-config", str(workspace / "missing.json")],
        capture_output=True,
        timeout=_TIMEOUT,
    )
    assert result.returncode == 2 and b"no such file" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "ipybox", "--port", "9"], capture_output=True, timeout=_TIMEOUT
    )
    assert result.returncode == 2 and b"streamable-http" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "ipybox", "--shared-workspace"], capture_output=True, timeout=_TIMEOUT
    )
    assert result.returncode == 2 and b"--shared-workspace apply only" in result.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "ipybox", "--help"], capture_output=True, timeout=_TIMEOUT
    )
    assert b"--workspace" in help_text.stdout and b"KERNEL_ENV_" in help_text.stdout
    # The console script the README configures Claude Code with.
    script = Path(sys.executable).parent / "ipybox"
    console = subprocess.run([str(script), "--help"], capture_output=True, timeout=_TIMEOUT)
    assert console.returncode == 0 and console.stdout == help_text.stdout


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    script = Path(sys.executable).parent / "ipybox"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=_TIMEOUT)
    assert result.returncode == 0
    assert result.stdout == f"ipybox {version('ipybox')}\n"
