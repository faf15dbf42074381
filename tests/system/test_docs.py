"""The API reference's strict build (scripts/docs.sh) refuses what would leave it wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def test_the_docs_build_fails_on_a_broken_reference_an_undocumented_or_a_missing_public_name(
    tmp_path: Path,
) -> None:
    source = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", source, ignore=shutil.ignore_patterns("_build"))
    reference = source / "reference.rst"
    text = reference.read_text()
    assert ".. autoclass:: ipybox.kernel_mgr.server.KernelGateway\n" in text
    reference.write_text(
        text.replace(".. autoclass:: ipybox.kernel_mgr.server.KernelGateway\n", "")
        + "\nSee :class:`ipybox.NoSuch`.\n"
    )
    (tmp_path / "undocumented_module.py").write_text("def helper() -> None:\n    pass\n")
    (source / "extra.rst").write_text(":orphan:\n\n.. autofunction:: undocumented_module.helper\n")

    result = subprocess.run(
        ["bash", "scripts/docs.sh", str(tmp_path / "html"), str(source)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )

    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert any("reference target not found: ipybox.NoSuch" in line for line in warnings), result.stderr
    assert any("undocumented_module.helper has no docstring" in line for line in warnings), result.stderr
    assert any(
        "ipybox.kernel_mgr.server.KernelGateway is public but not in the API reference" in line
        for line in warnings
    ), result.stderr
    assert len(warnings) == 3, result.stderr


def test_the_docs_build_says_where_the_html_went(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", "scripts/docs.sh", str(tmp_path / "html")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    index = tmp_path / "html" / "index.html"
    assert result.stdout.strip().endswith(f"{index.resolve()}"), result.stdout
    assert index.is_file()
