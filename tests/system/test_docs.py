"""The documentation site's strict build (scripts/docs.sh) refuses what would leave it wrong."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def _site_copy(tmp_path: Path) -> Path:
    """A copy of the site's sources in `tmp_path`, its config pointing at this clone's code."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "scripts" / "docs_hooks.py", tmp_path / "docs_hooks.py")
    config = (ROOT / "mkdocs.yml").read_text()
    assert "  - scripts/docs_hooks.py\n" in config and "paths: [src]" in config
    config = config.replace("  - scripts/docs_hooks.py\n", "  - docs_hooks.py\n")
    (tmp_path / "mkdocs.yml").write_text(config.replace("paths: [src]", f"paths: [{ROOT / 'src'}]"))
    return tmp_path / "mkdocs.yml"


def _build(out: Path, config: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/docs.sh", str(out), *([str(config)] if config else [])],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_docs_build_fails_on_a_broken_link_or_reference_an_undocumented_or_a_missing_public_name(
    tmp_path: Path,
) -> None:
    config = _site_copy(tmp_path / "site")
    compat = tmp_path / "site" / "docs" / "reference" / "compat.md"
    text = compat.read_text()
    assert "::: ipybox.kernel_mgr.server.KernelGateway\n" in text
    compat.write_text(
        text.replace("::: ipybox.kernel_mgr.server.KernelGateway\n", "")
        + "\nSee [the gateway][ipybox.NoSuch] and [a page](../no-such-page.md).\n"
    )
    hooks = tmp_path / "site" / "docs_hooks.py"
    hooks.write_text(
        hooks.read_text().replace(
            '    "ipybox.utils": ["arun"],\n',
            '    "ipybox.utils": ["arun"],\n    "undocumented_module": None,\n',
        )
    )
    (tmp_path / "undocumented_module.py").write_text(
        '__all__ = ["helper"]\n\n\ndef helper() -> None:\n    pass\n'
    )

    result = _build(tmp_path / "html", config, PYTHONPATH=str(tmp_path))

    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert any("ipybox.NoSuch" in line for line in warnings), result.stderr
    assert any("no-such-page.md" in line for line in warnings), result.stderr
    assert any("undocumented_module.helper has no docstring" in line for line in warnings), result.stderr
    assert any(
        "ipybox.kernel_mgr.server.KernelGateway is public but not in the API reference" in line
        for line in warnings
    ), result.stderr
    assert "Documentation built" not in result.stdout


def test_the_docs_build_says_where_the_html_went_and_writes_llms_txt(tmp_path: Path) -> None:
    result = _build(tmp_path / "html")
    assert result.returncode == 0, result.stderr
    index = tmp_path / "html" / "index.html"
    assert result.stdout.strip().endswith(f"{index.resolve()}"), result.stdout
    assert index.is_file()
    llms = (tmp_path / "html" / "llms.txt").read_text()
    assert "guide/running-code/" in llms and "reference/ipybox/" in llms
    full = (tmp_path / "html" / "llms-full.txt").read_text()
    assert "ipybox.CodeExecutor" in full


def _checked(html: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("check_docs_site", ROOT / "scripts" / "check_docs_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # private: the checker is a script, whose parts are tested here without a browser.
    page = module._Page()
    page.feed(html)
    problems: list[str] = module._problems("page", page)
    return problems


def test_the_site_check_names_raw_markdown_and_a_missing_navigation_or_search_box() -> None:
    rendered = (
        '<nav class="md-nav"><a class="md-nav__link" href="x">x</a></nav>'
        '<input class="md-search__input"><p>Text with <code>```python</code> in code is fine.</p>'
    )
    assert _checked(rendered) == []
    problems = _checked("<p>## Heading</p><p>```python</p><p>**bold** and [a](page.md)</p>")
    assert any("no navigation" in problem for problem in problems)
    assert any("no search box" in problem for problem in problems)
    assert sum("raw Markdown" in problem for problem in problems) == 4, problems
