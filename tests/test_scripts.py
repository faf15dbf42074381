"""The shell scripts the README and CI run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_script_that_calls_uv_finds_it_the_same_way() -> None:
    scripts = [*ROOT.glob("scripts/*.sh"), *ROOT.glob("benchmarks/*.sh"), ROOT / ".ci" / "run"]
    for script in scripts:
        lines = script.read_text().splitlines()
        first_uv = next((i for i, line in enumerate(lines) if re.match(r"\s*uv\s", line)), None)
        if first_uv is None:
            continue
        sourced = next((i for i, line in enumerate(lines) if line.strip() == "source scripts/_uv.sh"), None)
        assert sourced is not None and sourced < first_uv, (
            f"{script.name} calls uv before sourcing scripts/_uv.sh"
        )


def test_uv_is_found_without_local_bin_on_path() -> None:
    bare = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    result = subprocess.run(
        ["bash", "-c", "source scripts/_uv.sh && uv --version"],
        cwd=ROOT,
        env={"PATH": bare, "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("uv ")


def test_the_set_up_says_how_to_put_uv_on_path_when_it_is_not(tmp_path: Path) -> None:
    # A newcomer's `claude mcp add ... -- uvx ...` failed to connect, with no reason given: setup.sh
    # had put uv in ~/.local/bin, which was not on their PATH, and said nothing.
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "uv").write_text("#!/bin/sh\necho uv 0.0.0\n")
    (home / ".local" / "bin" / "uv").chmod(0o755)
    bare = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    local_bin = str(home / ".local" / "bin")
    notes = {}
    for path in (bare, f"{local_bin}:{bare}"):
        result = subprocess.run(
            ["bash", "-c", "source scripts/_uv.sh && uv_path_note"],
            cwd=ROOT,
            env={"PATH": path, "HOME": str(home)},
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        notes[path] = result.stderr
    assert f'export PATH="{local_bin}:$PATH"' in notes[bare], notes[bare]
    assert notes[f"{local_bin}:{bare}"] == ""
    assert "uv_path_note" in (ROOT / "scripts" / "setup.sh").read_text()
