"""Kernels inside Anthropic's sandbox-runtime (``srt``): finding it, its settings, the wrapped command.

Only the kernel runs inside the sandbox; the gateway stays outside and launches each kernel
through a kernel spec whose command is ``srt -s <settings> -c 'exec python -m ipykernel_launcher …'``.
The gateway talks to the kernel over ZMQ ``ipc://`` sockets in a private runtime folder that is
writable inside (srt removes the network namespace, so TCP ports opened inside are unreachable
from outside), and the kernel reaches the tool server through a Unix socket.

Settings are srt's own format. The defaults allow no network at all, hide ``.env`` and the usual
credential stores, and allow writes only to the working directory and the private folders (which
hold the kernel's temporary, IPython and Jupyter folders). A custom settings file replaces the
defaults, but `sandbox_settings` always adds the rules the rest of ipybox depends on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from ipybox.errors import SandboxUnavailableError

SRT_VERSION = "0.0.78"
"""The sandbox-runtime version ipybox is tested with (``scripts/srt/package.json``)."""

_REPO_SRT = Path(__file__).resolve().parents[3] / "scripts" / "srt" / "node_modules" / ".bin" / "srt"
_INSTALL_SRT = f"npm ci --prefix scripts/srt (in a clone of ipybox) or npm install -g @anthropic-ai/sandbox-runtime@{SRT_VERSION}"
# Linux programs srt runs, and the Debian/Ubuntu package of each.
_LINUX_TOOLS = {"bwrap": "bubblewrap", "socat": "socat", "rg": "ripgrep"}

CREDENTIAL_STORES = (
    "~/.ssh",
    "~/.aws",
    "~/.gnupg",
    "~/.config/gcloud",
    "~/.netrc",
    "~/.docker",
    "~/.kube",
    "~/.git-credentials",
    "~/.config/gh",
    "~/.azure",
    "~/.npmrc",
    "~/.pypirc",
    "~/.cargo/credentials",
    "~/.cargo/credentials.toml",
    "~/.password-store",
    "~/.local/share/keyrings",
    "~/.claude/.credentials.json",
)

TRUSTED_WORKSPACE_FILES = (".env", "sandbox-config.json", ".claude")
"""Files in the working directory that trusted programs read as configuration (ipybox's `.env`,
the plugin's sandbox settings, Claude Code's project settings): never writable by the kernel.
While a sandboxed kernel runs, srt keeps an empty placeholder where one did not exist."""


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
        os.environ.get("IPYBOX_SRT")
        or shutil.which("srt")
        or (str(_REPO_SRT) if _REPO_SRT.exists() else None)
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


def load_config(path: Path) -> dict[str, Any]:
    """Read a custom srt settings file.

    Raises:
        SandboxUnavailableError: The file is missing, not JSON, or not a JSON object.
    """
    try:
        config = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SandboxUnavailableError(
            f"The sandbox_config file {str(path)!r} cannot be read: {exc}."
        ) from exc
    except ValueError as exc:
        raise SandboxUnavailableError(
            f"The sandbox_config file {str(path)!r} is not valid JSON ({exc}); see examples/sandbox-kernel.json."
        ) from exc
    if not isinstance(config, dict) or any(
        not isinstance(config.get(key, {}), dict) for key in ("network", "filesystem")
    ):
        raise SandboxUnavailableError(
            f"The sandbox_config file {str(path)!r} must hold a JSON object whose 'network' and 'filesystem' "
            "are objects (srt's settings format); see examples/sandbox-kernel.json."
        )
    return config


def default_settings(working_dir: Path) -> dict[str, Any]:
    """The default settings: no network, no secrets readable, writes only where a kernel needs them."""
    home = Path.home()
    return {
        "network": {"allowedDomains": [], "deniedDomains": []},
        "filesystem": {
            "denyRead": [str(working_dir / ".env"), *(str(home / p[2:]) for p in CREDENTIAL_STORES), "/run"],
            "allowWrite": [str(working_dir)],
            "denyWrite": [],
        },
    }


def sandbox_settings(
    config: dict[str, Any] | None,
    *,
    working_dir: Path,
    private_dirs: list[Path],
    protected: list[Path],
    tool_socket: Path | None,
) -> dict[str, Any]:
    """The settings a kernel runs under: `config` (else the defaults) plus the fixed rules.

    Args:
        config: A custom settings object (`load_config`), or ``None`` for `default_settings`.
        working_dir: The kernel's working directory.
        private_dirs: Folders the kernel must write (ZMQ sockets, its temporary folder).
        protected: Paths never writable, whatever `config` says (the trusted registry's folder,
            the kernel spec and these settings).
        tool_socket: The tool server's Unix socket, kept reachable.
    """
    settings = json.loads(json.dumps(config)) if config is not None else default_settings(working_dir)
    network = settings.setdefault("network", {})
    filesystem = settings.setdefault("filesystem", {})
    # srt refuses a settings file that lacks any of these lists.
    for key in ("allowedDomains", "deniedDomains"):
        network.setdefault(key, [])
    for key in ("denyRead", "allowWrite", "denyWrite"):
        filesystem.setdefault(key, [])
    # ZMQ over ipc:// and the tool server's socket are Unix sockets; srt's seccomp filter would
    # refuse to create any, and it cannot filter by path on Linux.
    network["allowAllUnixSockets"] = True
    write = filesystem.setdefault("allowWrite", [])
    write += [str(path) for path in private_dirs if str(path) not in write]
    # Other gateways' private folders stay hidden; this kernel's own writable ones inside are
    # bound back by allowWrite (an allowRead there would bind them read-only).
    deny_read = filesystem.setdefault("denyRead", [])
    base = str(private_base())
    if base not in deny_read:
        deny_read.append(base)
    deny_write = filesystem.setdefault("denyWrite", [])
    deny_write += [str(path) for path in protected if str(path) not in deny_write]
    if tool_socket is not None:
        # A denyRead covering the socket's folder would hide it; allowRead wins over denyRead.
        allow_read = filesystem.setdefault("allowRead", [])
        if str(tool_socket.parent) not in allow_read:
            allow_read.append(str(tool_socket.parent))
    return settings


async def check(srt: str, settings_file: Path, tmp_dir: Path, cwd: Path, timeout: float = 30) -> None:
    """Run ``true`` under the settings once, so that a sandbox that cannot start fails the
    gateway's start with srt's own words rather than a kernel that never comes up.

    Raises:
        SandboxUnavailableError: srt refused the settings or could not set up the sandbox.
    """
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(Path.home()), "TMPDIR": str(tmp_dir)}
    process = await asyncio.create_subprocess_exec(
        srt,
        "--settings",
        str(settings_file),
        "-c",
        "true",
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


def wrap(srt: str, settings_file: Path, argv: list[str], tmp_dir: Path) -> list[str]:
    """The command that runs `argv` inside srt under `settings_file`, with `tmp_dir` as ``TMPDIR``.

    srt joins its arguments into one shell command without quoting them, so `argv` is quoted
    here and given as ``-c``; ``exec`` leaves no shell between srt and the kernel. srt points
    ``TMPDIR`` at a folder of its own, which need not exist: it is set again for the kernel.
    """
    command = f"TMPDIR={shlex.quote(str(tmp_dir))} exec {shlex.join(argv)}"
    return [srt, "--settings", str(settings_file), "-c", command]
