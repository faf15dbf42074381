"""The shell scripts the README and CI run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).parents[2]


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


# Package-registry hosts, written as patterns so that this file does not name them either.
REGISTRY_HOSTS = re.compile(
    r"pypi\.org|pythonhosted\.org|pypi\.python\.org|registry\.npmjs\.org|npmjs\.(?:org|com)|"
    r"registry\.yarnpkg\.com|(?:deb|security|ftp|snapshot)\.debian\.org|"
    r"(?:archive|security|ports)\.ubuntu\.com|deb\.nodesource\.com|dl-cdn\.alpinelinux\.org|"
    r"(?:registry-1|index|auth)\.docker\.io|ghcr\.io|quay\.io|crates\.io|proxy\.golang\.org|"
    r"rubygems\.org|repo1?\.maven(?:\.apache)?\.org|(?:conda|repo)\.anaconda\.(?:org|com)",
    re.IGNORECASE,
)


def test_no_tracked_file_outside_the_sources_names_a_package_registry_host() -> None:
    """Scripts, tests, examples and the README learn hosts from the machine or show a placeholder
    (src keeps the installer's default index; lock files record where packages came from)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    names = [
        name
        for name in listed.stdout.decode().split("\0")
        if name
        and not name.startswith("src/")
        and Path(name).name not in ("uv.lock", "package-lock.json")
        and (ROOT / name).is_file()
    ]
    assert "README.md" in names and "docker/build-base.sh" in names
    found = [
        f"{name}:{number}: {line.strip()}"
        for name in names
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if REGISTRY_HOSTS.search(line)
    ]
    assert found == [], "\n".join(found)


def _build_base(*args: str, apt_config: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"APT_CONFIG": str(apt_config)} if apt_config else {})}
    return subprocess.run(
        ["bash", str(ROOT / "docker" / "build-base.sh"), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def test_the_debian_base_build_takes_its_mirror_from_this_machines_apt() -> None:
    if shutil.which("apt-get") is None:
        pytest.skip("apt is not installed here")
    os_release = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    if "ID=debian" not in os_release.splitlines():
        pytest.skip("not a Debian machine: its apt sources are no Debian mirror")
    # apt's own reading of its sources (the index files apt-get update fetched).
    targets = subprocess.run(
        ["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)"], capture_output=True, text=True
    ).stdout.split("\n")
    codename = re.search(r"^VERSION_CODENAME=(\S+)$", os_release, re.MULTILINE)
    assert codename
    mirrors = {
        uri.rstrip("/") for uri, _, release in (t.partition(" ") for t in targets) if release == codename[1]
    }
    if not mirrors:
        pytest.skip("apt has fetched no index of this release (apt-get update has not run)")
    result = _build_base()
    assert result.returncode == 0, result.stderr
    chosen = re.search(r"^build-base: mirror (\S+)$", result.stdout, re.MULTILINE)
    assert chosen and chosen[1] in mirrors, result.stdout


def test_the_debian_base_build_without_apt_sources_asks_for_a_mirror(tmp_path: Path) -> None:
    if shutil.which("apt-config") is None:
        pytest.skip("apt is not installed here")
    (tmp_path / "parts").mkdir()
    config = tmp_path / "apt.conf"
    config.write_text(
        f'Dir::Etc::sourcelist "{tmp_path}/sources.list";\nDir::Etc::sourceparts "{tmp_path}/parts";\n'
    )
    missing = _build_base(apt_config=config)
    assert missing.returncode == 2
    assert "names no Debian mirror" in missing.stderr and "--mirror URL" in missing.stderr
    # The sources apt reads in either format, and a mirror given as an argument.
    (tmp_path / "sources.list").write_text(
        "deb-src http://source.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one-line.example/debian/ bookworm main\n"
    )
    (tmp_path / "parts" / "off.sources").write_text(
        "Types: deb\nURIs: http://disabled.example/debian\nSuites: bookworm-security\nEnabled: no\n"
    )
    (tmp_path / "parts" / "security.sources").write_text(
        "# security\nTypes: deb deb-src\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    found = _build_base(apt_config=config)
    assert found.returncode == 0, found.stderr
    assert "mirror http://one-line.example/debian\n" in found.stdout
    assert "security mirror http://security.example/debian-security\n" in found.stdout
    given = _build_base("--mirror", "http://mirror.example/debian", apt_config=config)
    assert "build-base: mirror http://mirror.example/debian\n" in given.stdout


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


@pytest.mark.parametrize(("options", "status", "verdict"), [((), 1, "FAILED"), (("--warn",), 0, "WARNING")])
def test_the_test_commands_wrapper_names_and_ends_a_process_the_command_left_running(
    options: tuple[str, ...], status: int, verdict: str
) -> None:
    # The shell's background job outlives it, its parent gone: an orphan, as a bridge left by a
    # killed srt is. The grace is a bound only: the orphan would never end on its own. With --warn
    # the leftover is named and ended but the status is the command's own.
    orphan = f"import time; time.sleep({100004 + status})"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/no_leftovers.py",
            *options,
            "--grace",
            "1",
            "sh",
            "-c",
            f"{sys.executable} -c '{orphan}' &",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == status, result.stderr
    assert f"{verdict}: 1 process(es)" in result.stderr and orphan in result.stderr, result.stderr
    assert not [
        proc for proc in psutil.process_iter(["cmdline"]) if orphan in " ".join(proc.info["cmdline"] or [])
    ]


def test_the_test_commands_wrapper_passes_on_the_commands_own_status() -> None:
    for command, status in ((["true"], 0), (["sh", "-c", "exit 3"], 3)):
        result = subprocess.run(
            [sys.executable, "scripts/no_leftovers.py", *command], cwd=ROOT, timeout=120, check=False
        )
        assert result.returncode == status
