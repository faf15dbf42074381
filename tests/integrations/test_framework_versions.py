"""The integrations are optional: `import ipybox` imports no framework, and a framework outside
the supported range is refused at import with the range named (the range being the extra's own)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ipybox.integrations import pydantic_ai, smolagents

ROOT = Path(__file__).parents[2]
FRAMEWORKS = ("pydantic_ai", "smolagents", "agents", "langchain", "langchain_core", "openai")


def test_import_ipybox_and_its_public_names_imports_no_framework() -> None:
    code = f"""
import json, sys
import ipybox, ipybox.integrations
for name in ipybox.__all__:
    getattr(ipybox, name)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r})))
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(child.stdout) == []


@pytest.mark.parametrize(
    ("extra", "supported", "distribution"),
    [
        ("pydantic-ai", pydantic_ai.SUPPORTED, "pydantic-ai-slim"),
        ("smolagents", smolagents.SUPPORTED, "smolagents"),
    ],
)
def test_the_checked_range_is_the_extras_range(extra: str, supported: str, distribution: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["optional-dependencies"][extra]]
    (framework,) = [req for req in requirements if req.name == distribution]
    assert framework.specifier == SpecifierSet(supported)


@pytest.mark.parametrize(
    ("module", "distribution", "supported"),
    [
        ("ipybox.integrations.pydantic_ai", "pydantic_ai_slim", pydantic_ai.SUPPORTED),
        ("ipybox.integrations.smolagents", "smolagents", smolagents.SUPPORTED),
    ],
)
def test_a_framework_version_outside_the_range_is_refused_at_import_naming_the_range(
    tmp_path: Path, module: str, distribution: str, supported: str
) -> None:
    # A distribution's metadata found first on the path is the one importlib.metadata reports.
    info = tmp_path / f"{distribution}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.1\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {module}"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode != 0
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("ipybox.integrations.FrameworkVersionError: ")
    assert f"{supported}, but" in last and "0.0.1 is installed" in last
    assert "pip install 'ipybox[" in last
