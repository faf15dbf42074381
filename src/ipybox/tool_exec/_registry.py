"""The trusted registry of MCP servers that a secured tool server may run.

The application records a server here (``generate_mcp_sources`` does it when it generates a
server's API); the tool server of a ``CodeExecutor`` then starts only servers found here, by
name, and never takes server parameters from a request. Parameters are stored exactly as
given, ``${VAR}`` placeholders unreplaced, so no secret value is written to disk.

The file lives in the user's state directory (``$IPYBOX_STATE_DIR``, else
``$XDG_STATE_HOME/ipybox`` or ``~/.local/state/ipybox`` on Linux and
``~/Library/Application Support/ipybox`` on macOS): never in the working directory or
``~/.ipython``, which a sandboxed kernel may write to.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ServerRegistry", "default_registry_path"]

_FORMAT_VERSION = 1


def default_registry_path() -> Path:
    """Return the registry file's default location (see the module docstring)."""
    state_dir = os.environ.get("IPYBOX_STATE_DIR")
    if state_dir:
        return Path(state_dir).expanduser() / "servers.json"
    home = Path.home()
    if sys.platform == "darwin":
        base = home / "Library" / "Application Support"
    elif sys.platform == "win32":  # pragma: no cover
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_STATE_HOME") or home / ".local" / "state")
    return base / "ipybox" / "servers.json"


class ServerRegistry:
    """A JSON file mapping server names to MCP server parameters, shared by the user's processes.

    Writes are atomic (a temporary file replaced over the old one, mode ``0600``) and
    serialised across processes with a lock file; reads are cached and repeated only when the
    file changed, so a lookup per tool call costs one ``stat``.

    Args:
        path: The registry file; by default :func:`default_registry_path`.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_registry_path()
        self._lock = threading.Lock()
        self._servers: dict[str, dict[str, Any]] = {}
        self._stamp: tuple[int, int, int] | None = None

    def register(self, server_name: str, server_params: Mapping[str, Any]) -> None:
        """Record (or replace) a server's parameters under its name.

        Args:
            server_name: The application's name for the server.
            server_params: Its parameters, stored as given (``${VAR}`` placeholders unreplaced).

        Raises:
            ValueError: ``server_name`` is empty or ``server_params`` is not a JSON-serialisable mapping.
            OSError: The registry file could not be written.
        """
        if not isinstance(server_name, str) or not server_name:
            raise ValueError(f"A server name must be a non-empty string, not {server_name!r}.")
        if not isinstance(server_params, Mapping):
            raise ValueError(f"Server parameters must be a mapping, not {type(server_params).__name__}.")
        try:
            params = json.loads(json.dumps(dict(server_params)))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"The parameters of MCP server {server_name!r} are not JSON-serialisable: {exc}"
            ) from exc
        with self._lock, self._file_lock():
            servers = self._read()
            if servers.get(server_name) == params:
                return
            servers[server_name] = params
            self._write(servers)

    def unregister(self, server_name: str) -> None:
        """Remove a server from the registry (nothing happens if it is not there).

        Raises:
            OSError: The registry file could not be written.
        """
        with self._lock, self._file_lock():
            servers = self._read()
            if servers.pop(server_name, None) is not None:
                self._write(servers)

    def lookup(self, server_name: str) -> dict[str, Any] | None:
        """Return a copy of a registered server's parameters, or ``None`` if it is not registered.

        The file is read again only when it changed since the last read, so a server that
        another process registered is found.

        Raises:
            OSError: The registry file exists but could not be read.
        """
        params = self.lookup_shared(server_name)
        return copy.deepcopy(params) if params is not None else None

    def lookup_shared(self, server_name: str) -> dict[str, Any] | None:
        """Like :meth:`lookup` without the copy, for a lookup on every tool call.

        The caller must not modify the result: it is the registry's cached value.

        Raises:
            OSError: The registry file exists but could not be read.
        """
        with self._lock:
            stamp = self._current_stamp()
            if stamp != self._stamp:
                self._read()
            return self._servers.get(server_name)

    def _current_stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _read(self) -> dict[str, dict[str, Any]]:
        """Read the file into the cache and return a fresh copy of its servers."""
        stamp = self._current_stamp()
        if stamp is None:
            servers: dict[str, dict[str, Any]] = {}
        else:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                data, stamp = {}, None
            except ValueError as exc:
                raise OSError(
                    f"The MCP server registry {self.path} is not valid JSON ({exc}); remove it."
                ) from exc
            servers = data.get("servers", {}) if isinstance(data, dict) else {}
        self._servers, self._stamp = servers, stamp
        return copy.deepcopy(servers)

    def _write(self, servers: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".servers-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump({"version": _FORMAT_VERSION, "servers": servers}, file, indent=2, sort_keys=True)
                file.flush()
                os.fsync(file.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._servers, self._stamp = servers, self._current_stamp()

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Serialise read-modify-write cycles of different processes (POSIX ``flock``)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: in-process lock only
            yield
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
