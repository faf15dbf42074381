"""Kernels inside Anthropic's sandbox-runtime (``srt``): finding it, its settings, the wrapped command.

Only the kernel runs inside the sandbox; the gateway stays outside and launches each kernel
through a kernel spec whose command is a launcher (`ipybox.gateway._kernel_launch`) that
becomes ``srt -s <settings> -c 'exec python -m ipykernel_launcher …'``. The gateway talks to the
kernel over ZMQ ``ipc://`` sockets in a folder of that kernel's own, the only private folder its
sandbox shows it (srt removes the network namespace, so TCP ports opened inside are unreachable
from outside), and the kernel reaches the tool server through a Unix socket.

Settings are srt's own format. The defaults allow no network at all, hide the home folder (but
the working directory and the kernel's own Python), the shared folders where the host's Unix
sockets live, ``.env`` and the credential files, on Linux everything outside the system folders
(`SYSTEM_READABLE`), and allow writes only to the working directory and the private folders
(which hold the kernel's temporary, IPython and Jupyter folders). A custom settings file
replaces the defaults, but `sandbox_settings` always adds the rules the rest of ipybox depends
on: the protected names in the working directory, the credential files and the stored OAuth
logins (and, for a kernel started as root, what only root may read in ``/etc``), the secrets of the folders the kernel
imports from outside its Python, the trusted registry, the kernel's Python and its tool socket.

srt and the gateway run in a private folder, never in the working directory (`_kernel_launch.wrap`); the
protected names missing in the working directory are held by stand-ins that ipybox makes and
removes, however the application ends (`make_placeholders`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

from ipybox._wire import UserEnv
from ipybox.errors import SandboxUnavailableError
from ipybox.gateway import _kernel_launch

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
    "~/.config/git/credentials",
    "~/.config/gh",
    "~/.azure",
    "~/.npmrc",
    "~/.pypirc",
    "~/.pgpass",
    "~/.my.cnf",
    "~/.cargo/credentials",
    "~/.cargo/credentials.toml",
    "~/.password-store",
    "~/.local/share/keyrings",
    "~/.claude.json",
    "~/.claude/.credentials.json",
    "~/.bash_history",
    "~/.zsh_history",
    "~/.python_history",
    "~/.local/share/fish/fish_history",
    "~/.local/share/uv/credentials",
    "~/.cache/huggingface/token",
    "~/.huggingface/token",
    "~/.config/doctl",
    "~/.oci",
    "~/.terraform.d/credentials.tfrc.json",
    "~/.vault-token",
)
"""Credential files and folders in the home folder. The default settings hide the whole home
folder; these stay hidden under a custom `sandbox_config` that opens it again."""

PROTECTED_WORKSPACE_DIRS = (
    ".git",
    ".vscode",
    ".idea",
    ".claude",
    # Other agents' project configuration (MCP server commands among it) and hook folders that
    # git runs from the work tree.
    ".cursor",
    ".gemini",
    ".roo",
    ".amazonq",
    ".windsurf",
    ".codex",
    ".continue",
    ".husky",
)
PROTECTED_WORKSPACE_FILES = (
    ".env",
    "sandbox-config.json",
    ".mcp.json",
    ".gitconfig",
    ".gitmodules",
    ".bashrc",
    ".bash_profile",
    ".zshrc",
    ".zprofile",
    ".profile",
    ".ripgreprc",
    # Without a writable HEAD the working directory cannot be made into a bare repository whose
    # config (core.fsmonitor, core.hooksPath) git on the host would follow.
    "HEAD",
    ".pre-commit-config.yaml",
    "lefthook.yml",
)
"""Names in the working directory that trusted programs (git, editors, agents, shells, ipybox's
`.env` and the plugin's sandbox settings) read as configuration or run: never writable by a
sandboxed kernel, whether or not they exist (see `make_placeholders`)."""

_STAND_IN_CONTENT = {".mcp.json": b'{"mcpServers": {}}\n'}
"""What a stand-in for a missing protected file holds (others are empty): Claude Code refuses an
empty ``.mcp.json``, and with it every server of the project, even one that made the stand-in."""

HIDDEN_SYSTEM_DIRS = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm")
"""Shared folders where the host's Unix sockets live (terminal multiplexers, agents, D-Bus) and
other users' temporary files; the default settings hide them (the kernel has its own ``TMPDIR``)."""

SYSTEM_READABLE = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/nix/store")
"""What a sandboxed kernel reads on Linux besides its own folders and Python: programs, libraries
and their configuration (locale, time zones, certificates). The default settings hide every other
entry of ``/`` (bwrap gives the kernel its own ``/proc``, ``/dev`` and a read-only ``/sys``)."""

SYSTEM_SECRETS = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/letsencrypt",
    "/etc/wireguard",
    "/etc/NetworkManager/system-connections",
)
"""Secrets in ``/etc`` that only root can read (password hashes, host and TLS keys, Wi-Fi and VPN
keys), hidden by the default settings whoever starts the kernel. A kernel started as root also
has every other file of ``/etc`` hidden that an unprivileged user could not read, whatever the
settings (`root_only`, added by `sandbox_settings`)."""

IMPORT_PATH_SECRETS = (
    ".env",
    ".git",
    ".netrc",
    ".npmrc",
    ".pypirc",
    ".pgpass",
    ".git-credentials",
    ".vault-token",
    ".ssh",
    ".aws",
    ".docker",
    ".kube",
    ".gnupg",
)
"""Names hidden in a folder the kernel imports from outside its Python (a flat-layout editable
install, a ``PYTHONPATH`` entry), besides every ``.env.*`` file there (`import_path_secrets`)."""

_ROOT_ONLY_LIMIT = 50_000
"""How many entries of ``/etc`` `root_only` looks at, at most."""


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
    """The default settings: no network, no Unix socket of the host, nothing of the home folder but
    the working directory and the kernel's Python, writes only where a kernel needs them. On Linux,
    nothing of the disk either but `SYSTEM_READABLE` (`sandbox_settings` adds the kernel's Python,
    its ``PYTHONPATH`` and its tool socket)."""
    home = Path.home()
    hidden = [str(home), *HIDDEN_SYSTEM_DIRS]
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        hidden.append(runtime_dir)
    readable = [str(working_dir)]
    if sys.platform == "linux":
        # srt expands a denied "/" into every entry of "/" that no allowRead entry covers, when
        # each kernel starts (a link such as /lib -> usr/lib counts as where it leads).
        hidden = ["/", *hidden, *SYSTEM_SECRETS]
        readable += SYSTEM_READABLE
    return {
        "network": {"allowedDomains": [], "deniedDomains": []},
        "filesystem": {
            "denyRead": [*hidden, str(working_dir / ".env")],
            "allowRead": readable,
            "allowWrite": [str(working_dir)],
            "denyWrite": [],
        },
    }


_root_only_cache: tuple[dict[str, tuple[int, int]], tuple[str, ...]] | None = None


def root_only() -> tuple[str, ...]:
    """The files and folders in ``/etc`` that an unprivileged user cannot read: files not readable by
    all, folders not readable and searchable by all (whose content is not looked at). Links are
    not followed (where one leads inside ``/etc``, its target is listed if it has to be).

    Walked once per process and again when a folder in it changed (a file made or removed), at
    most `_ROOT_ONLY_LIMIT` entries; a file whose mode alone changed since goes unnoticed until then.
    """
    global _root_only_cache
    if _root_only_cache is not None and _unchanged(_root_only_cache[0]):
        return _root_only_cache[1]
    stamps: dict[str, tuple[int, int]] = {}
    found: list[str] = []
    folders = ["/etc"]
    seen = 0
    while folders and seen < _ROOT_ONLY_LIMIT:
        folder = folders.pop()
        try:
            info = os.stat(folder, follow_symlinks=False)
            entries = list(os.scandir(folder))
        except OSError:
            continue
        stamps[folder] = (info.st_mtime_ns, info.st_ino)
        for entry in entries:
            seen += 1
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode):
                if mode & 0o005 != 0o005:
                    found.append(entry.path)
                else:
                    folders.append(entry.path)
            elif stat.S_ISREG(mode) and not mode & 0o004:
                found.append(entry.path)
    _root_only_cache = (stamps, tuple(sorted(found)))
    return _root_only_cache[1]


def _unchanged(stamps: dict[str, tuple[int, int]]) -> bool:
    for folder, stamp in stamps.items():
        try:
            info = os.stat(folder, follow_symlinks=False)
        except OSError:
            return False
        if (info.st_mtime_ns, info.st_ino) != stamp:
            return False
    return True


def srt_support(srt: str) -> list[Path]:
    """What srt runs inside the sandbox from its own package (its seccomp helper, which must stay
    readable where the settings hide the folder srt is installed in); none when `srt` is not the
    package's command (a wrapper script)."""
    for parent in Path(srt).resolve().parents:
        seccomp = parent / "vendor" / "seccomp"
        if seccomp.is_dir():
            return [seccomp]
    return []


def _prefixes() -> list[str]:
    """Where the kernel's Python (this interpreter) is installed: its prefixes and real location."""
    return [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        str(Path(os.path.realpath(sys.executable)).parent.parent),
    ]


def python_paths(home: Path) -> list[str]:
    """The folders the kernel's Python (this interpreter) imports from: its prefixes, its real
    location and the ``sys.path`` a fresh interpreter gets (site-packages and what editable
    installs add; not the application's own additions). None that is the home folder or holds it."""
    candidates = [*_prefixes(), *_kernel_sys_path()]
    paths: list[str] = []
    for candidate in candidates:
        path = Path(candidate).resolve()
        if path.exists() and path != path.parent and not home.is_relative_to(path) and str(path) not in paths:
            paths.append(str(path))
    return paths


@functools.cache
def _kernel_sys_path() -> tuple[str, ...]:
    """``sys.path`` of a fresh interpreter like the kernel's (asked once per process, ~20 ms)."""
    code = "import json, sys; print(json.dumps(sys.path[1:]))"  # [0] is the working directory
    try:
        answer = subprocess.run(
            [sys.executable, "-c", code],
            env={"PATH": os.environ.get("PATH", os.defpath)},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        entries = json.loads(answer.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return ()
    return tuple(entry for entry in entries if isinstance(entry, str) and entry)


def sandbox_settings(
    config: dict[str, Any] | None,
    *,
    working_dir: Path,
    private_dirs: list[Path],
    protected: list[Path],
    tool_socket: Path | None,
    readable: tuple[Path, ...] = (),
    hidden: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """The settings a kernel runs under: `config` (else the defaults) plus the fixed rules.

    Paths in `config` that are neither absolute nor start with ``~`` are taken relative to
    `working_dir` (srt itself runs in a private folder, see `wrap`).

    Args:
        config: A custom settings object (`load_config`), or ``None`` for `default_settings`.
        working_dir: The kernel's working directory.
        private_dirs: Folders the kernel must write (ZMQ sockets, its temporary folder).
        protected: Paths never writable, whatever `config` says (the trusted registry's folder,
            the kernel spec and these settings); `PROTECTED_WORKSPACE_DIRS` and
            `PROTECTED_WORKSPACE_FILES` of `working_dir` are added.
        tool_socket: The tool server's Unix socket, kept reachable.
        readable: Folders the kernel reads besides its own Python (the ``PYTHONPATH`` the
            application gave it, srt's `srt_support`), readable even where the settings hide their
            parent; writable only if the settings say so elsewhere.
        hidden: Folders the kernel can neither read nor write, whatever `config` says, but for
            `working_dir` inside one (the working folders of other kernels live beside it):
            `working_dir` stays readable, and writable if the settings make it so.
    """
    settings = json.loads(json.dumps(config)) if config is not None else default_settings(working_dir)
    network = settings.setdefault("network", {})
    filesystem = settings.setdefault("filesystem", {})
    # srt refuses a settings file that lacks any of these lists.
    for key in ("allowedDomains", "deniedDomains"):
        network.setdefault(key, [])
    for key in ("denyRead", "allowWrite", "denyWrite"):
        filesystem.setdefault(key, [])
    for key, paths in filesystem.items():
        if isinstance(paths, list):
            filesystem[key] = [_absolute(path, working_dir) for path in paths]
    # ZMQ over ipc:// and the tool server's socket are Unix sockets; srt's seccomp filter would
    # refuse to create any, and it cannot filter by path on Linux. Without a network namespace
    # of its own the kernel still reaches only sockets it can see (abstract ones stay behind).
    network["allowAllUnixSockets"] = True
    write = filesystem["allowWrite"]
    write += [str(path) for path in private_dirs if str(path) not in write]
    # Other gateways' private folders stay hidden; this kernel's own writable ones inside are
    # bound back by allowWrite (an allowRead there would bind them read-only).
    deny_read = filesystem["denyRead"]
    # The `.env` files of the folders above the working directory hold secrets too (a project
    # whose kernel works in a subfolder); only existing ones, so that srt leaves no stand-ins there.
    parent_env = [str(folder / ".env") for folder in working_dir.parents if (folder / ".env").is_file()]
    # A kernel started as root reads in /etc only what any user could, whatever the config says.
    as_root = root_only() if sys.platform == "linux" and os.geteuid() == 0 else ()
    _add_new(
        deny_read,
        [
            str(private_base()),
            str(oauth_store()),
            *(str(Path.home() / p[2:]) for p in CREDENTIAL_STORES),
            *parent_env,
            *as_root,
            *(str(folder) for folder in hidden),
        ],
    )
    # srt hides a denied folder behind an empty tmpfs and binds back the allowWrite and allowRead
    # paths inside it; a writable ancestor of the working directory is not bound back, so the
    # working directory is named itself (then it stays writable, not just readable).
    writable = any(
        isinstance(path, str) and working_dir.is_relative_to(Path(path).expanduser()) for path in write
    )
    if hidden and writable and str(working_dir) not in write:
        write.append(str(working_dir))
    deny_write = filesystem["denyWrite"]
    workspace = [working_dir / name for name in (*PROTECTED_WORKSPACE_DIRS, *PROTECTED_WORKSPACE_FILES)]
    deny_write += [str(path) for path in [*protected, *workspace] if str(path) not in deny_write]
    # The kernel cannot start without its own Python (a config may hide the home folder it is
    # in), nor without the tool server's socket; allowRead wins over denyRead.
    allow_read = filesystem.setdefault("allowRead", [])
    extra = [str(path) for path in readable]
    if hidden:
        extra.append(str(working_dir))
    imported = [*python_paths(Path.home()), *extra]
    _add_new(allow_read, [*imported, *([str(tool_socket.parent)] if tool_socket else [])])
    # A folder imported from outside the kernel's Python is readable whole (a flat-layout editable
    # install's project, a PYTHONPATH entry): its secrets stay hidden (denyRead of a name inside
    # wins over allowRead of its folder).
    for folder in imported:
        _add_new(deny_read, import_path_secrets(Path(folder).resolve(), working_dir))
    if hidden:
        # srt re-opens what allowRead and allowWrite name inside a denied folder: inside a hidden
        # one, only the working directory may be.
        for key in ("allowRead", "allowWrite"):
            filesystem[key] = [path for path in filesystem[key] if not _reopens(path, hidden, working_dir)]
    return settings


def oauth_store() -> Path:
    """The folder of the stored OAuth logins (`ipybox.app._oauth.oauth_dir`), made (``0700``) if
    missing so that the sandbox denies a real folder, however the settings read the rest."""
    from ipybox.app._oauth import oauth_dir, private_dir

    return private_dir(oauth_dir())


def _add_new(target: list[Any], paths: Iterable[str]) -> None:
    """Append each of `paths` that `target` does not hold yet, in order."""
    for path in paths:
        if path not in target:
            target.append(path)


def import_path_secrets(folder: Path, working_dir: Path) -> list[str]:
    """The secrets (`IMPORT_PATH_SECRETS` and ``.env.*`` files that exist) in `folder`, a folder the
    kernel reads because it imports from it, unless `folder` lies in the kernel's own Python or is
    `working_dir` (whose rules are the working directory's). Only `folder` itself is looked in."""
    if folder == working_dir.resolve() or any(
        folder.is_relative_to(Path(prefix).resolve()) for prefix in _prefixes()
    ):
        return []
    try:
        with os.scandir(folder) as entries:
            names = [entry.name for entry in entries]
    except OSError:
        return []
    return [
        str(folder / name)
        for name in sorted(names)
        if name in IMPORT_PATH_SECRETS or name.startswith(".env.")
    ]


def _reopens(path: object, hidden: tuple[Path, ...], working_dir: Path) -> bool:
    """Whether the allowed `path` lies in one of the `hidden` folders, outside `working_dir`."""
    if not isinstance(path, str):
        return False
    found = Path(path).expanduser().resolve()
    return any(found.is_relative_to(folder) for folder in hidden) and not found.is_relative_to(working_dir)


def _absolute(path: object, working_dir: Path) -> object:
    if not isinstance(path, str) or path.startswith(("/", "~")):
        return path
    return str(working_dir / path)


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


def nested_protected(working_dir: Path, depth: int = 3) -> list[Path]:
    """The protected names (`PROTECTED_WORKSPACE_DIRS`, `PROTECTED_WORKSPACE_FILES`) found in the
    subfolders of `working_dir`, down to `depth` levels as srt looks for them, without following
    links or entering ``node_modules``. Those in `working_dir` itself are always protected."""
    names = {*PROTECTED_WORKSPACE_DIRS, *PROTECTED_WORKSPACE_FILES}
    found: list[Path] = []
    folders = [working_dir]
    for level in range(depth):
        deeper: list[Path] = []
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                if entry.name in names:
                    if level > 0:
                        found.append(Path(entry.path))
                elif entry.name != "node_modules" and entry.is_dir(follow_symlinks=False):
                    deeper.append(Path(entry.path))
        folders = deeper
    return found


_JOURNAL = "placeholders.json"
_GATEWAY_LOCK = "runtime/gateway.lock"


def make_placeholders(working_dir: Path, private_dir: Path) -> None:
    """Put a read-only stand-in where a protected name is missing in `working_dir`.

    bwrap can protect only a path that exists: for a missing one srt would create an empty file
    itself and remove it when it exits normally, which leaves it behind when srt is killed and,
    with two kernels sharing a working directory, removes it under the other's sandbox (whose
    protection then goes). ipybox makes them instead (an empty folder for `PROTECTED_WORKSPACE_DIRS`,
    which git and editors pass over, an empty file for the rest, but for an ``.mcp.json`` with no
    servers, which Claude Code can read), records each with its device and
    inode in a journal in `private_dir`, and removes them when the gateway stops
    (`remove_placeholders`) or, after the application was killed, at the next start of any
    sandboxed gateway of the user (`sweep`). A placeholder another live gateway recorded is shared,
    and removed by the last one. Every access is relative to a descriptor of `working_dir`, and
    links are never followed.
    """
    with _locked():
        journal: dict[str, Any] = {
            "pid": os.getpid(),
            "created": _create_time(os.getpid()),
            "dir": str(working_dir),
            "names": {},
        }
        shared = {tuple(e) for other in _journals() if _owner_alive(other) for e in _entries(other)}
        try:
            fd = os.open(working_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return  # no working directory yet: the kernel's start fails and says so
        try:
            info = os.fstat(fd)
            journal["dev"], journal["ino"] = info.st_dev, info.st_ino
            names: dict[str, list[int]] = {}
            missing = [
                n for n in (*PROTECTED_WORKSPACE_DIRS, *PROTECTED_WORKSPACE_FILES) if not _exists(n, fd)
            ]
            for name in PROTECTED_WORKSPACE_DIRS + PROTECTED_WORKSPACE_FILES:
                if name not in missing:
                    found = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if (info.st_dev, info.st_ino, found.st_dev, found.st_ino) in shared:
                        names[name] = [found.st_dev, found.st_ino]
            journal["names"] = names
            for name in missing:
                # Writable on the host, bound read-only into the sandbox: srt takes an empty
                # read-only file for a mount point of its own, and removes it when it exits.
                try:
                    if name in PROTECTED_WORKSPACE_DIRS:
                        os.mkdir(name, 0o755, dir_fd=fd)
                    else:
                        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                        made_fd = os.open(name, flags, 0o644, dir_fd=fd)
                        try:
                            os.write(made_fd, _STAND_IN_CONTENT.get(name, b""))
                        finally:
                            os.close(made_fd)
                except FileExistsError:
                    continue  # made by someone else meanwhile: theirs
                made = os.stat(name, dir_fd=fd, follow_symlinks=False)
                names[name] = [made.st_dev, made.st_ino]
            _write_journal(private_dir / _JOURNAL, journal)
        finally:
            os.close(fd)


def remove_placeholders(private_dir: Path) -> None:
    """Remove the placeholders `make_placeholders` recorded in `private_dir` (those still empty,
    and not shared with another live gateway), then the journal."""
    with _locked():
        _remove(private_dir)


def sweep() -> None:
    """Clean up after this user's gateways whose application was killed: their placeholders in
    working directories and their private folders."""
    base = private_base()
    with _locked():
        for folder in base.glob("ipybox-jupyter-*"):
            journal = _read_journal(folder / _JOURNAL)
            if journal is not None and not _owner_alive(journal):
                _remove(folder)
                shutil.rmtree(folder, ignore_errors=True)
        for folder in base.glob("ipybox-tools-*"):
            pid = folder.name.split("-")[2]
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def _remove(private_dir: Path) -> None:
    journal = _read_journal(private_dir / _JOURNAL)
    if journal is None:
        return
    others = [j for j in _journals() if j["_path"] != str(private_dir / _JOURNAL)]
    shared = {tuple(e) for other in others if _owner_alive(other) for e in _entries(other)}
    try:
        fd = os.open(journal["dir"], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        fd = -1
    try:
        if fd >= 0 and (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (journal.get("dev"), journal.get("ino")):
            for name, entry in journal.get("names", {}).items():
                if (journal["dev"], journal["ino"], *entry) not in shared:
                    _remove_one(fd, name, entry)
    finally:
        if fd >= 0:
            os.close(fd)
    with contextlib.suppress(OSError):
        (private_dir / _JOURNAL).unlink()


def _remove_one(fd: int, name: str, entry: list[int]) -> None:
    """Remove `name` if it is still the unchanged stand-in made for it (the recorded inode)."""
    try:
        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return
    if [found.st_dev, found.st_ino] != entry:
        return  # replaced since: not ours
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(found.st_mode):
            os.rmdir(name, dir_fd=fd)  # only an empty folder goes
        elif stat.S_ISREG(found.st_mode) and _holds(fd, name, _STAND_IN_CONTENT.get(name, b"")):
            os.unlink(name, dir_fd=fd)


def _holds(fd: int, name: str, content: bytes) -> bool:
    """Whether the file `name` (no link followed) holds exactly `content`."""
    file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    try:
        return os.read(file_fd, len(content) + 1) == content
    finally:
        os.close(file_fd)


def _exists(name: str, fd: int) -> bool:
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _entries(journal: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    names: dict[str, list[int]] = journal.get("names", {})
    return [(journal["dev"], journal["ino"], *entry) for entry in names.values()]


def _journals() -> list[dict[str, Any]]:
    found = []
    for path in private_base().glob(f"ipybox-jupyter-*/{_JOURNAL}"):
        journal = _read_journal(path)
        if journal is not None:
            journal["_path"] = str(path)
            found.append(journal)
    return found


def _read_journal(path: Path) -> dict[str, Any] | None:
    try:
        journal = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return journal if isinstance(journal, dict) and "dev" in journal else None


def _write_journal(path: Path, journal: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(journal))
    partial.replace(path)


def _create_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _owner_alive(journal: dict[str, Any]) -> bool:
    """Whether the application that wrote `journal`, or its gateway, still runs."""
    created = journal.get("created")
    if (
        isinstance(journal.get("pid"), int)
        and created is not None
        and _create_time(journal["pid"]) == created
    ):
        return True
    # The gateway holds this lock for its whole life (and sandboxed kernels end with it).
    lock = Path(journal.get("_path", "")).parent / _GATEWAY_LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One process at a time makes, removes or sweeps this user's placeholders."""
    fd = os.open(private_base() / "placeholders.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
