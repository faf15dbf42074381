"""The README's Example runs as pasted, as its text says: saved in a clone's root, run by `.venv/bin/python`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def _example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the README's Example has no Python block"
    return match.group(1)


@pytest.mark.timeout(300)
def test_the_readme_example_runs_as_pasted_without_an_activated_environment(tmp_path: Path) -> None:
    # A copy of the clone's root as far as the example reads it, so that its mcptools/ lands there.
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "library_server.py", tmp_path / "examples")
    (tmp_path / "example.py").write_text(_example())
    # As a user's shell: the environment is not activated, so `python` on PATH is another interpreter.
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(entry for entry in os.environ["PATH"].split(os.pathsep) if entry != venv_bin)
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"} | {"PATH": path}
    result = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert "tool call: " in result.stdout
    assert re.search(r"^\[.*Python.*\]$", result.stdout, re.MULTILINE), result.stdout
