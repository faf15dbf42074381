"""What ``ipybox`` says when it starts: the policy it loaded and where the audit trail is, and a
stdin it cannot serve MCP on (closed, ``/dev/null``), named before any kernel starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_TIMEOUT = 60
POLICY = """\
default = "ask"

[[rule]]
decision = "allow"
tool = "read_*"

[[rule]]
decision = "deny"
tool = "delete_*"
"""


@pytest.fixture
def command(tmp_path: Path) -> list[str]:
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY)
    return [sys.executable, "-m", "ipybox", "--workspace", str(tmp_path / "w"), "--policy", str(policy)]


def test_dev_null_on_stdin_is_named_and_exits_non_zero_with_stdout_a_pipe(
    command: list[str], tmp_path: Path, state_dir: Path
) -> None:
    result = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_TIMEOUT
    )
    assert result.returncode == 1
    assert "stdin is /dev/null" in result.stderr and "--transport streamable-http" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    # Said at the default log level, before anything else can fail.
    assert f"policy {tmp_path / 'policy.toml'}: 2 rules loaded, default 'ask'" in result.stderr
    assert f"audit trail: {state_dir / 'audit' / 'audit.sqlite3'}" in result.stderr


def test_a_closed_stdin_is_named_and_exits_non_zero(command: list[str]) -> None:
    # bash closes fd 0 (`<&-`) before it runs the server.
    result = subprocess.run(
        ["bash", "-c", 'exec "$@" <&-', "ipybox", *command, "--no-audit"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=_TIMEOUT,
    )
    assert result.returncode == 1
    assert "stdin is closed" in result.stderr and "Traceback" not in result.stderr
    assert "audit trail: off (--no-audit)" in result.stderr
