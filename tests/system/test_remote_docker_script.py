"""scripts/test-remote-docker.sh says SKIPPED, with the reason, where it cannot have a Docker engine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test-remote-docker.sh"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_without_an_engine_and_without_root_it_skips_and_says_why(tmp_path: Path) -> None:
    # A copy that user `nobody` can read (a clone may live in root's home); the script gives up
    # before it needs anything else of the repository.
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    shutil.copy(SCRIPT.parent / "_dockerd.sh", tmp_path / "scripts")  # what the script sources
    tmp_path.chmod(0o755)
    (tmp_path / "scripts").chmod(0o755)
    result = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "bash",
            "scripts/test-remote-docker.sh",
        ],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "test-remote-docker: SKIPPED: no Docker engine is reachable, and starting one needs root\n"
    )
