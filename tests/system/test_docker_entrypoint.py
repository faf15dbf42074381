"""The Docker image's start check without ``--sandbox`` (``docker/entrypoint.sh`` runs it), without Docker.

A workspace whose ``.git`` or agent settings the container user could write is refused, naming the
read-only mount to add; the same workspace with those names bound read-only (here with bubblewrap,
as ``docker run --mount ...,readonly`` does) passes. ``tests/system/test_docker_image.py`` runs the image.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CHECK = [sys.executable, "-I", "-m", "ipybox.app.sandbox._container"]


def _check(
    workspace: Path, *wrapper: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*wrapper, *CHECK, str(workspace)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
        env=env,
    )


def _workspace(tmp_path: Path) -> Path:
    workspace = tmp_path / "workspace"
    (workspace / ".git" / "hooks").mkdir(parents=True)
    (workspace / ".git" / "config").write_text("[core]\n")
    (workspace / ".mcp.json").write_text('{"mcpServers": {}}')
    (workspace / "notes.txt").write_text("ordinary files stay writable")
    return workspace


def test_a_workspace_whose_git_and_agent_settings_are_writable_is_refused_with_the_mounts_to_add(
    tmp_path: Path,
) -> None:
    workspace = _workspace(tmp_path)
    refused = _check(workspace)
    assert refused.returncode == 1
    assert "the workspace's .git, .mcp.json can be changed" in refused.stderr, refused.stderr
    assert "--mount type=bind,src=/path/to/workspace/.git,dst=/app/workspace/.git,readonly" in refused.stderr
    assert "IPYBOX_WRITABLE_CONFIG=1" in refused.stderr
    assert _check(tmp_path / "empty-workspace").returncode == 0
    # A link in place of a protected name could be pointed anywhere: refused too.
    (workspace / ".vscode").symlink_to(tmp_path)
    assert ".vscode" in _check(workspace).stderr


def test_a_workspace_with_its_protected_names_mounted_read_only_passes(tmp_path: Path) -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap (bwrap) is not installed: it makes the read-only mounts here")
    workspace = _workspace(tmp_path)
    mounts = [
        arg
        for name in (".git", ".mcp.json")
        for arg in ("--ro-bind", str(workspace / name), str(workspace / name))
    ]
    wrapper = [bwrap, "--bind", "/", "/", *mounts, "--dev", "/dev", "--proc", "/proc", "--"]
    probe = subprocess.run([*wrapper, "true"], capture_output=True, text=True, timeout=60, check=False)
    if probe.returncode != 0:
        pytest.skip(f"bubblewrap cannot make mounts here: {probe.stderr.strip()}")
    passed = _check(workspace, *wrapper)
    assert passed.returncode == 0, passed.stderr
    # What the mounts stop: code of the container's user changing git's configuration or hooks.
    attack = subprocess.run(
        [
            *wrapper,
            sys.executable,
            "-c",
            "import sys\n"
            "for path in ('.git/config', '.git/hooks/pre-commit', '.mcp.json', 'notes.txt'):\n"
            "    try:\n"
            "        open(path, 'a').write('x')\n"
            "        print(path, 'written')\n"
            "    except OSError:\n"
            "        print(path, 'refused')\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=workspace,
    )
    assert attack.stdout.split("\n")[:4] == [
        ".git/config refused",
        ".git/hooks/pre-commit refused",
        ".mcp.json refused",
        "notes.txt written",
    ]


def test_the_entrypoint_runs_the_check_without_sandbox_and_reads_no_settings_from_the_workspace() -> None:
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert "python -I -m ipybox.app.sandbox._container" in entrypoint
    assert '--sandbox-config "$workspace' not in entrypoint
    assert "--sandbox-config /app/config/sandbox-config.json" in entrypoint


def test_ipybox_refuses_sandbox_settings_from_inside_the_workspace(tmp_path: Path) -> None:
    """The kernel (or an earlier run without the sandbox) can write the workspace: a settings file
    there could loosen the next start's sandbox, so naming one is refused at once, with the reason."""
    workspace = tmp_path / "workspace"
    (workspace / "conf").mkdir(parents=True)
    (workspace / "conf" / "sandbox.json").write_text("{}")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ipybox",
            "--workspace",
            str(workspace),
            "--sandbox-config",
            "conf/sandbox.json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=workspace,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "lies in the workspace" in result.stderr and "keep it outside" in result.stderr
