"""The integration examples in ``examples/`` run as the README says, offline, and do what they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run(script: str, *args: str, cwd: Path) -> str:
    child = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True, timeout=240
    )
    assert child.returncode == 0, child.stderr
    return child.stdout


def test_the_pydantic_ai_example_runs_cells_and_the_application_refuses_a_borrow(tmp_path: Path) -> None:
    out = run("pydantic_ai_toolset.py", str(tmp_path), cwd=tmp_path)
    assert "tool call: library.search_books(" in out
    assert "tool call: library.borrow_book(" in out
    assert "Fluent Python" in out
    assert "was rejected by the application" in out
    assert out.rstrip().endswith("I found the books; borrowing was refused.")


def test_the_smolagents_example_calls_the_applications_tool_and_answers(tmp_path: Path) -> None:
    out = run("smolagents_executor.py", cwd=tmp_path)
    assert "tool call: convert({'amount': 1.0, 'currency': 'EUR'}) approved" in out
    assert out.rstrip().endswith("answer: 225.0")
