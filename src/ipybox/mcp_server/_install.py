"""Installing packages for the kernel, with uv when it is there and pip otherwise.

Packages go into a folder of the workspace's own in ipybox's state folder (`packages_dir`), which
is on the kernel's path (``PYTHONPATH``) and on nobody else's: not into the environment the
server runs from, which ``uv sync`` (and so ``scripts/setup.sh`` in a clone) would reset, and
whose packages the server's own processes import. Installs outlive the server, its restarts and
re-syncs of its environment, and belong to the workspace.

The installer is a trusted program, so it takes nothing from where the kernel can write: it
starts in a private, empty folder (a ``pip/`` package or ``uv.toml`` planted in the workspace is
never seen), reads no configuration file at all (uv ``--no-config``, pip ``--isolated`` and
``python -I``), gets an environment built here (``PATH``, ``HOME``, the certificate and index
settings of the application's environment) and a cache of its own in ipybox's state folder, and
copies files out of it (``UV_LINK_MODE=copy``: no hard link shared with anything else).

Under ``--sandbox`` it also must not run code the agent chose: only wheels are accepted
(``--only-binary :all:``, no build scripts run) and URLs are refused (``git+``, ``file:``,
``https:`` and PEP 508 direct references ``name @ URL``). Sandboxed kernels cannot write the
packages folder (the gateway protects the state folder), so no session can plant code there for
another. The installer then runs inside a sandbox of its own (``srt``) that reaches only the
package index and writes only that folder and its cache.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import anyio

from ipybox.app import sandbox as _sandbox
from ipybox.app.mcp_client import default_registry_path
from ipybox.errors import SandboxUnavailableError
from ipybox.gateway import _kernel_launch

_OUTPUT_LIMIT = 4000
# A requirement (name, extras, version specifiers, markers) or a VCS/URL requirement; no
# whitespace-separated extra arguments and nothing that looks like an option.
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*([<>=!~^;@].*)?$")
# What the installer gets of the application's environment: where programs and certificates are,
# and which package index to use (the only host a sandboxed install can reach).
_PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "SSL_CERT_FILE", "SSL_CERT_DIR", "UV_NATIVE_TLS")
_UV_INDEX_ENV = ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL", "UV_INDEX")
_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
_PYPI_HOSTS = ("pypi.org", "files.pythonhosted.org")


def state_folder() -> Path:
    """ipybox's state folder (the trusted registry's), which no sandboxed kernel can write."""
    return default_registry_path().parent


def packages_dir(workspace: Path) -> Path:
    """The folder installs for `workspace` go into: in the state folder, one per workspace."""
    key = hashlib.sha256(str(workspace.resolve()).encode()).hexdigest()[:16]
    return state_folder() / "packages" / f"{workspace.resolve().name[:40]}-{key}" / "site-packages"


class InstallError(Exception):
    """A package could not be installed; the message carries the installer's output."""


@dataclass(frozen=True)
class Installer:
    """Runs installs for one kernel environment.

    Args:
        target: The folder packages go into (`packages_dir`), on the kernel's path.
        python: The kernel's interpreter, whose version and platform the packages are for.
        sandboxed: Under ``--sandbox``: wheels only, no URLs, and the installer in a sandbox.
        environ: The application's environment, where the index and certificate settings are read.
    """

    target: Path
    python: str = sys.executable
    sandboxed: bool = False
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

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
        extra = ["--target", str(self.target)]
        if self.sandboxed:
            if is_url or direct:
                raise InstallError(
                    f"Installing from {spec!r} is refused under --sandbox: a URL or local path (git+, file:, "
                    "'name @ URL') can bring a package built from source, whose build code would run outside "
                    "the sandbox. Install a published wheel by name instead."
                )
            extra += ["--only-binary", ":all:"]
        uv = _find_uv(self.python)
        if uv is not None:
            return [uv, "pip", "install", "--no-config", "--python", self.python, *extra, spec]
        pip_settings: list[str] = []
        # --isolated ignores PIP_* variables too: the index and certificate are given as options.
        if index := self.environ.get("PIP_INDEX_URL"):
            pip_settings += ["--index-url", index]
        for url in self.environ.get("PIP_EXTRA_INDEX_URL", "").split():
            pip_settings += ["--extra-index-url", url]
        if cert := self.environ.get("PIP_CERT") or self.environ.get("SSL_CERT_FILE"):
            pip_settings += ["--cert", cert]
        return [
            self.python,
            "-I",
            "-m",
            "pip",
            "install",
            "--isolated",
            "--no-input",
            "--disable-pip-version-check",
            "--cache-dir",
            str(state_folder() / "cache" / "pip"),
            *pip_settings,
            *extra,
            spec,
        ]

    def environment(self, private: Path) -> dict[str, str]:
        """The installer's whole environment: nothing of the application's but `_PASSED_ENV` and
        the index settings; its temporary files in `private`, its cache in the state folder."""
        env = {key: self.environ[key] for key in (*_PASSED_ENV, *_UV_INDEX_ENV) if key in self.environ}
        if not self.sandboxed:
            env.update({key: self.environ[key] for key in _PROXY_ENV if key in self.environ})
        env.update(
            {
                "TMPDIR": str(private),
                "PYTHONNOUSERSITE": "1",
                "PIP_CONFIG_FILE": os.devnull,
                "UV_NO_CONFIG": "1",
                "UV_CACHE_DIR": str(state_folder() / "cache" / "uv"),
                "UV_LINK_MODE": "copy",
                "UV_PYTHON_DOWNLOADS": "never",
            }
        )
        return env

    def index_hosts(self) -> list[str]:
        """The hosts a sandboxed install may reach: those of the configured index URLs, else PyPI's."""
        urls: list[str] = []
        for key in (*_UV_INDEX_ENV, "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
            for item in self.environ.get(key, "").split():
                urls.append(item.split("=", 1)[1] if "=" in item.split("://")[0] else item)
        hosts = [urlsplit(url).hostname or "" for url in urls]
        hosts = [host for host in dict.fromkeys(hosts) if host]
        if not urls or "pypi.org" in hosts:
            hosts = list(dict.fromkeys([*hosts, *_PYPI_HOSTS]))
        return hosts

    async def install(
        self, package: str, timeout: float = 600, on_output: Callable[[str], None] | None = None
    ) -> str:
        """Install `package` and return the installer's output (also given to `on_output` as it comes).

        Raises:
            InstallError: If the requirement is refused, or the installer failed or timed out.
        """
        command = self.command(package)
        cache = state_folder() / "cache"
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.target.mkdir(mode=0o700, parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix="ipybox-install-"))
        try:
            if self.sandboxed:
                command = self._sandboxed(command, private, cache)
            return await self._run(command, package, private, timeout, on_output)
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def _sandboxed(self, command: list[str], private: Path, cache: Path) -> list[str]:
        try:
            srt = _sandbox.find_srt()
        except SandboxUnavailableError as exc:
            raise InstallError(f"Cannot install under --sandbox: {exc}") from exc
        home = Path(self.environ.get("HOME") or Path.home())
        settings = {
            "network": {"allowedDomains": self.index_hosts(), "deniedDomains": []},
            "filesystem": {
                "denyRead": [str(home / path[2:]) for path in _sandbox.CREDENTIAL_STORES],
                "allowWrite": [str(self.target), str(cache), str(private)],
                "denyWrite": [],
            },
        }
        settings_file = private / "srt-settings.json"
        settings_file.write_text(json.dumps(settings))
        # In an IPC namespace of its own, like a kernel (srt's bwrap shares the host's).
        return _kernel_launch.in_own_ipc_namespace(
            [srt, "--settings", str(settings_file), "-c", f"exec {shlex.join(command)}"]
        )

    async def _run(
        self,
        command: list[str],
        package: str,
        private: Path,
        timeout: float,
        on_output: Callable[[str], None] | None,
    ) -> str:
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=private,
                env=self.environment(private),
            )
        except OSError as exc:
            raise InstallError(f"Could not run the installer {command[0]!r}: {exc}") from exc
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(timeout):
                assert process.stdout is not None
                while chunk := await process.stdout.read(4096):
                    chunks.append(chunk)
                    if on_output is not None:
                        on_output(chunk.decode(errors="replace"))
                await process.wait()
        except BaseException:
            if process.returncode is None:
                process.kill()
                with anyio.CancelScope(shield=True):
                    await process.wait()
            raise
        text = b"".join(chunks).decode(errors="replace").strip()
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
                f"{Path(self.command(package)[0]).name}:\n{text}{hint}"
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
