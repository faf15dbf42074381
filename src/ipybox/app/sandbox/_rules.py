"""The settings a sandboxed kernel runs under: the defaults, a custom file, and the fixed rules added to either."""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ipybox.app._state import oauth_dir, private_dir
from ipybox.app.sandbox._srt import private_base
from ipybox.errors import SandboxUnavailableError

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
    """The folder of the stored OAuth logins (`ipybox.app._state.oauth_dir`), made (``0700``) if
    missing so that the sandbox denies a real folder, however the settings read the rest."""
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
