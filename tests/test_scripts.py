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
