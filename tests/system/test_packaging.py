"""The built distribution: a wheel and an sdist that install and run on their own."""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mcp.client.stdio import StdioServerParameters

from tests.mcp_server.support import connected, run, server_env, text_of

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def _uv() -> str:
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), str(Path.home() / ".local" / "bin")]:
        candidate = Path(folder) / "uv"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.skip("uv is not installed (scripts/setup.sh installs it)")


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class Installed:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def ipybox(self) -> Path:
        return self.venv / "bin" / "ipybox"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [_uv(), "build", "--quiet", "--out-dir", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("ipybox-*.whl")
    (sdist,) = out.glob("ipybox-*.tar.gz")
    return Built(wheel=wheel, sdist=sdist)


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The wheel alone in a fresh virtual environment (its dependencies from the package index)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    uv = _uv()
    # A clean environment: nothing of this project's .venv or of the test run leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT", "PYTHON"))}
    subprocess.run(
        [uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=env, timeout=120
    )
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), str(built.wheel)],
        check=True,
        env=env,
        timeout=600,
    )
    yield Installed(venv=venv)


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_has_one_source() -> None:
    import ipybox

    project = _pyproject()["project"]
    assert isinstance(project, dict)
    assert ipybox.__version__ == project["version"]
    stray = subprocess.run(
        ["git", "grep", "-n", "-F", project["version"], "--", "src"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    assert stray == "", f"the version is written in the sources as well:\n{stray}"


@pytest.mark.timeout(600)
def test_the_wheel_carries_the_metadata_users_look_for(built: Built) -> None:
    import ipybox

    assert built.wheel.name == f"ipybox-{ipybox.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(built.wheel) as wheel:
        names = wheel.namelist()
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(wheel.read(metadata_name).decode())
    assert "ipybox/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert metadata["Name"] == "ipybox"
    assert metadata["Version"] == ipybox.__version__
    assert metadata["Summary"]
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.11"
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Repository", "Issues"} <= urls.keys()
    assert str(metadata.get_payload()).startswith("# ipybox"), "the README is the long description"
    # Traces are opt-in: their SDK and exporter come only with the extra.
    assert "otel" in (metadata.get_all("Provides-Extra") or [])
    assert not any(
        "opentelemetry-sdk" in r and "extra" not in r for r in metadata.get_all("Requires-Dist") or []
    )
    # So are the framework integrations: each framework comes only with its extra.
    assert {"pydantic-ai", "smolagents"} <= set(metadata.get_all("Provides-Extra") or [])
    for framework in ("pydantic-ai-slim", "smolagents"):
        assert not any(
            r.startswith(framework) and "extra" not in r for r in metadata.get_all("Requires-Dist") or []
        )


@pytest.mark.timeout(600)
def test_the_sdist_holds_sources_tests_and_license(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "src/ipybox/py.typed",
        "src/ipybox/__init__.py",
    } <= names
    assert any(name.startswith("tests/") for name in names)
    assert not any(name.startswith((".venv/", ".git/")) for name in names)


@pytest.mark.timeout(900)
def test_the_wheel_installs_into_a_fresh_environment(installed: Installed) -> None:
    import ipybox

    out = subprocess.run(
        [str(installed.python), "-c", "import ipybox, ipybox.code_exec; print(ipybox.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=installed.venv,
    ).stdout
    assert out.strip() == ipybox.__version__


@pytest.mark.timeout(900)
def test_the_installed_command_prints_its_help(installed: Installed) -> None:
    result = subprocess.run([str(installed.ipybox), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "--workspace DIR" in result.stdout
    assert "--sandbox" in result.stdout


@pytest.mark.timeout(900)
async def test_the_installed_command_serves_a_real_stdio_mcp_session(
    installed: Installed, tmp_path: Path
) -> None:
    params = StdioServerParameters(
        command=str(installed.ipybox),
        args=["--workspace", str(tmp_path)],
        env=server_env(),
        cwd=str(tmp_path),
    )
    async with connected(params) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert {"execute_ipython_cell", "register_mcp_server", "install_package", "reset"} <= tools
        result = await run(client, "import sys, os\nprint(6 * 7, sys.prefix, os.getcwd())")
    assert not result.is_error, text_of(result)
    answer, prefix, cwd = text_of(result).split()
    assert answer == "42"
    assert Path(prefix) == installed.venv, "the kernel runs in the installed environment"
    assert Path(cwd) == tmp_path
