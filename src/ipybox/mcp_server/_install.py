"""Installing packages for the kernel, with uv when it is there and pip otherwise.

The kernel runs this process's interpreter (``sys.executable``), so packages go into its
environment. A uv-made environment has no pip, hence ``uv pip install --python``.

Under ``--sandbox`` the install runs outside the sandbox (the kernel has no network), so it
must not run code the agent chose: only wheels are accepted (``--only-binary :all:``, no
build scripts run) and URLs are refused (``git+``, ``file:``, ``https:`` and PEP 508 direct
references ``name @ URL``), and the packages go into a folder that only
the kernel has on its path (``--target``), where ``.pth`` files are never processed. Nothing
installed there is ever imported by the server or the gateway.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio

SANDBOX_PACKAGES_DIR = ".ipybox/site-packages"
_OUTPUT_LIMIT = 4000
# A requirement (name, extras, version specifiers, markers) or a VCS/URL requirement; no
# whitespace-separated extra arguments and nothing that looks like an option.
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*([<>=!~^;@].*)?$")


class InstallError(Exception):
    """A package could not be installed; the message carries the installer's output."""


@dataclass(frozen=True)
class Installer:
    """Runs installs for one kernel environment.

    Args:
        python: The kernel's interpreter.
        sandbox_dir: With ``--sandbox``: the kernel-only folder packages go into.
    """

    python: str = sys.executable
    sandbox_dir: Path | None = None

    def command(self, package: str) -> list[str]:
        """The install command for `package`.

        Raises:
            InstallError: If `package` is not a single requirement, or is refused under the sandbox.
        """
        spec = package.strip() if isinstance(package, str) else ""
        is_url = spec.startswith(("git+", "http://", "https://", "file:"))
        requirement = None if is_url else _REQUIREMENT.match(spec)
        if not spec or spec.startswith("-") or "\n" in spec or (not is_url and requirement is None):
            raise InstallError(
                f"{package!r} is not a package requirement: give one name with optional extras and version "
                "specifiers ('requests', 'pandas>=2.2', 'httpx[http2]==0.28.1') or a 'git+https://...' URL."
            )
        if is_url and " " in spec:
            raise InstallError(f"{package!r} contains spaces: give a single URL.")
        # A PEP 508 direct reference, 'name @ git+https://...' or 'name @ file:...', installs from
        # a URL just as a bare URL does.
        direct = requirement is not None and "@" in (requirement.group(2) or "").split(";")[0]
        extra: list[str] = []
        if self.sandbox_dir is not None:
            if is_url or direct:
                raise InstallError(
                    f"Installing from {spec!r} is refused under --sandbox: a URL or local path (git+, file:, "
                    "'name @ URL') can bring a package built from source, whose build code would run outside "
                    "the sandbox. Install a published wheel by name instead."
                )
            extra = ["--target", str(self.sandbox_dir), "--only-binary", ":all:"]
        uv = _find_uv(self.python)
        if uv is not None:
            return [uv, "pip", "install", "--python", self.python, *extra, spec]
        return [self.python, "-m", "pip", "install", "--disable-pip-version-check", *extra, spec]

    async def install(self, package: str, timeout: float = 600) -> str:
        """Install `package` and return the installer's output.

        Raises:
            InstallError: If the requirement is refused, or the installer failed or timed out.
        """
        command = self.command(package)
        if self.sandbox_dir is not None:
            self.sandbox_dir.mkdir(parents=True, exist_ok=True)
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise InstallError(f"Could not run the installer {command[0]!r}: {exc}") from exc
        try:
            async with asyncio.timeout(timeout):
                output, _ = await process.communicate()
        except BaseException:
            if process.returncode is None:
                process.kill()
                with anyio.CancelScope(shield=True):
                    await process.wait()
            raise
        text = output.decode(errors="replace").strip()
        if len(text) > _OUTPUT_LIMIT:
            text = "[...]\n" + text[-_OUTPUT_LIMIT:]
        if process.returncode != 0:
            hint = (
                "\nThis environment has neither uv nor pip: install uv (https://docs.astral.sh/uv/) "
                "or pip into it."
                if "No module named pip" in text
                else ""
            )
            raise InstallError(
                f"Installing {package!r} failed (exit code {process.returncode}) with "
                f"{Path(command[0]).name}:\n{text}{hint}"
            )
        return text


def _find_uv(python: str) -> str | None:
    """uv on PATH, or where it is usually installed (an MCP client may start the server
    with a short PATH), or next to the interpreter."""
    found = shutil.which("uv")
    if found is not None:
        return found
    home = Path.home()
    for candidate in (
        Path(python).parent / "uv",
        home / ".local" / "bin" / "uv",
        home / ".cargo" / "bin" / "uv",
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None
