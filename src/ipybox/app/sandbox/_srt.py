"""Finding ``srt`` and what it needs, the private folders of sandboxed kernels, and a start check."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from ipybox._wire import UserEnv
from ipybox.errors import SandboxUnavailableError
from ipybox.gateway import _kernel_launch

SRT_VERSION = "0.0.78"
"""The sandbox-runtime version ipybox is tested with (``scripts/srt/package.json``)."""

_REPO_SRT = Path(__file__).resolve().parents[4] / "scripts" / "srt" / "node_modules" / ".bin" / "srt"
_INSTALL_SRT = f"npm ci --prefix scripts/srt (in a clone of ipybox) or npm install -g @anthropic-ai/sandbox-runtime@{SRT_VERSION}"
# Linux programs srt runs, and the Debian/Ubuntu package of each.
_LINUX_TOOLS = {"bwrap": "bubblewrap", "socat": "socat", "rg": "ripgrep"}


def srt_command() -> str:
    """The ``srt`` an MCP server's configuration can name: where `find_srt` looks (``$IPYBOX_SRT``,
    ``PATH``, a clone's ``scripts/srt/``), else plain ``srt``. Nothing else is checked."""
    found = os.environ.get(UserEnv.SRT) or shutil.which("srt")
    return found or (str(_REPO_SRT) if _REPO_SRT.exists() else "srt")


def find_srt() -> str:
    """Return the ``srt`` command to run, after checking that what it needs is installed.

    Looked up as ``$IPYBOX_SRT``, then ``srt`` on ``PATH``, then the copy ``scripts/setup.sh``
    installs in a clone of ipybox.

    Raises:
        SandboxUnavailableError: ``srt`` or a program it needs is missing, or the platform has no
            sandbox; the message names what is missing and the command that installs it.
    """
    if sys.platform not in ("linux", "darwin"):
        raise SandboxUnavailableError(
            f"sandbox=True works on Linux and macOS only, not on {sys.platform}; start with sandbox=False."
        )
    missing: list[str] = []
    install: list[str] = []
    srt = (
        os.environ.get(UserEnv.SRT) or shutil.which("srt") or (str(_REPO_SRT) if _REPO_SRT.exists() else None)
    )
    if srt is None:
        missing.append("srt (@anthropic-ai/sandbox-runtime)")
        install.append(_INSTALL_SRT)
    if sys.platform == "linux":
        packages = [package for tool, package in _LINUX_TOOLS.items() if shutil.which(tool) is None]
        if packages:
            missing += [
                f"{tool} ({package})" for tool, package in _LINUX_TOOLS.items() if package in packages
            ]
            install.insert(0, "sudo apt-get install " + " ".join(packages))
    if missing:
        raise SandboxUnavailableError(
            f"sandbox=True needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed (not found on PATH). Install with: {'; '.join(install)}. "
            "ipybox never runs the kernel unsandboxed when a sandbox was asked for."
        )
    assert srt is not None
    return srt


def tools_dir() -> Path:
    """A new folder for an executor's tool server socket, private to it: inside `private_base`,
    which every sandboxed kernel has hidden, and bound only into its own kernels."""
    return Path(tempfile.mkdtemp(prefix=f"ipybox-tools-{os.getpid()}-", dir=private_base()))


def private_base() -> Path:
    """The folder that holds the private folders of this user's sandboxed gateways
    (``<tmp>/ipybox-<uid>``, mode 0700). Kernels cannot read it: each sees only its own
    writable folders inside it, not another executor's connection files and sockets."""
    base = Path(tempfile.gettempdir()) / f"ipybox-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    info = base.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise SandboxUnavailableError(
            f"{base} is not a folder of this user's; remove it (or set TMPDIR) and start again."
        )
    return base


def srt_support(srt: str) -> list[Path]:
    """What srt runs inside the sandbox from its own package (its seccomp helper, which must stay
    readable where the settings hide the folder srt is installed in); none when `srt` is not the
    package's command (a wrapper script)."""
    for parent in Path(srt).resolve().parents:
        seccomp = parent / "vendor" / "seccomp"
        if seccomp.is_dir():
            return [seccomp]
    return []


async def check(srt: str, settings_file: Path, tmp_dir: Path, cwd: Path, timeout: float = 30) -> None:
    """Run ``true`` under the settings once (in an IPC namespace of its own), so that a sandbox that cannot start fails the
    gateway's start with srt's own words rather than a kernel that never comes up.

    Raises:
        SandboxUnavailableError: srt refused the settings or could not set up the sandbox.
    """
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(Path.home()), "TMPDIR": str(tmp_dir)}
    # In an IPC namespace of its own, as the kernel will be: a system that refuses one fails here.
    command = _kernel_launch.in_own_ipc_namespace([srt, "--settings", str(settings_file), "-c", "true"])
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=cwd,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        raise SandboxUnavailableError(f"The sandbox (srt) did not start within {timeout:g} s.") from None
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if process.returncode != 0:
        text = output.decode(errors="replace").strip() or "(no output)"
        raise SandboxUnavailableError(
            f"The sandbox (srt) cannot run the kernel with these settings (exit code {process.returncode}): "
            f"{text}"
        )
