"""The trusted registry of MCP servers that a secured tool server may run.

The application records a server here (``generate_mcp_sources`` does it when it generates a
server's API, together with the folder it wrote the API into); the tool server of a
``CodeExecutor`` then starts only servers found here, by name, among those whose API lies in a
folder the application put on its kernel's import path (the working directory and the entries of
``kernel_env``'s ``PYTHONPATH``, or a folder directly in one, such as ``mcptools/``), and never
takes server parameters from a request. Parameters are stored exactly as
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
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ipybox.app._state import state_dir

__all__ = ["ServerRegistry", "default_registry", "default_registry_path"]

_FORMAT_VERSION = 2


def default_registry_path() -> Path:
    """Return the registry file's default location: ``servers.json`` in the user's state folder."""
    return state_dir() / "servers.json"


def default_registry() -> ServerRegistry:
    """The registry of this user, at ``default_registry_path()`` (resolved when called).

    The one place a registry is found from the environment: an application builds it once
    (``CodeExecutor``, the MCP server) and passes it to what needs it; ``generate_mcp_sources``
    and a ``ToolServer`` given none use it.
    """
    return ServerRegistry(default_registry_path())


class ServerRegistry:
    """A JSON file mapping server names to MCP server parameters, scoped by the folder of their API.

    ``generate_mcp_sources`` records a server together with the folder it wrote the server's
    package into (its ``root_dir``); the tool server of a ``CodeExecutor`` runs a server only
    when that folder is one its application put on the kernel's import path (the working
    directory, a ``PYTHONPATH`` entry of ``kernel_env``) or a folder directly in one
    (``mcptools/``), so the kernel of one
    application cannot call, by name, a server another application registered. A server
    registered without a folder is found only by a tool server without a scope (standalone use).

    Writes are atomic (a temporary file replaced over the old one, mode ``0600``) and
    serialised across processes with a lock file; reads are cached and repeated only when the
    file changed, so a lookup per tool call costs one ``stat``.

    Args:
        path: The registry file (:func:`default_registry` gives this user's).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._servers: dict[str, dict[str, Any]] = {}
        self._scoped: dict[str, dict[str, dict[str, Any]]] = {}
        self._views: dict[tuple[Path, ...] | None, dict[str, dict[str, Any]]] = {}
        self._stamp: tuple[int, int, int] | None = None

    def register(
        self, server_name: str, server_params: Mapping[str, Any], root_dir: Path | None = None
    ) -> None:
        """Record (or replace) a server's parameters under its name.

        Args:
            server_name: The application's name for the server.
            server_params: Its parameters, stored as given (``${VAR}`` placeholders unreplaced).
            root_dir: The folder its generated package lives in (made absolute); ``None``
                records it for tool servers without a scope only.

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
            servers, scoped = self._read()
            table = servers if root_dir is None else scoped.setdefault(str(Path(root_dir).resolve()), {})
            if table.get(server_name) == params:
                return
            # Removed and added again: the latest registration of a name comes last.
            table.pop(server_name, None)
            table[server_name] = params
            self._write(servers, scoped)

    def unregister(self, server_name: str, root_dir: Path | None = None) -> None:
        """Remove a server from the registry (nothing happens if it is not there).

        Raises:
            OSError: The registry file could not be written.
        """
        with self._lock, self._file_lock():
            servers, scoped = self._read()
            table = servers if root_dir is None else scoped.get(str(Path(root_dir).resolve()), {})
            if table.pop(server_name, None) is not None:
                self._write(servers, scoped)

    def lookup(self, server_name: str, scope: Path | Sequence[Path] | None = None) -> dict[str, Any] | None:
        """Return a copy of a registered server's parameters, or ``None`` if it is not registered.

        The file is read again only when it changed since the last read, so a server that
        another process registered is found.

        Args:
            server_name: The server's name.
            scope: The folders an executor's kernel imports from (its working directory, then the
                ``PYTHONPATH`` the application gave it): only servers whose API was generated in one
                of them or in a folder directly in one count. ``None``: any registration, the latest
                of a name winning.

        Raises:
            OSError: The registry file exists but could not be read.
        """
        params = self.lookup_shared(server_name, scope)
        return copy.deepcopy(params) if params is not None else None

    def lookup_shared(
        self, server_name: str, scope: Path | Sequence[Path] | None = None
    ) -> dict[str, Any] | None:
        """Like :meth:`lookup` without the copy, for a lookup on every tool call.

        The caller must not modify the result: it is the registry's cached value.

        Raises:
            OSError: The registry file exists but could not be read.
        """
        folders = (scope,) if isinstance(scope, Path) else tuple(scope) if scope is not None else None
        with self._lock:
            stamp = self._current_stamp()
            if stamp != self._stamp:
                self._read()
            view = self._views.get(folders)
            if view is None:
                view = self._views[folders] = self._view(folders)
            return view.get(server_name)

    def _view(self, folders: tuple[Path, ...] | None) -> dict[str, dict[str, Any]]:
        view: dict[str, dict[str, Any]] = {}
        if folders is None:
            view.update(self._servers)
        for root, servers in self._scoped.items():
            if folders is None or any(_importable_from(Path(root), folder) for folder in folders):
                view.update(servers)
        return view

    def _current_stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def _read(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, dict[str, Any]]]]:
        """Read the file into the cache and return fresh copies of its tables."""
        stamp = self._current_stamp()
        data: Any = {}
        if stamp is not None:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                data, stamp = {}, None
            except ValueError as exc:
                raise OSError(
                    f"The MCP server registry {self.path} is not valid JSON ({exc}); remove it."
                ) from exc
        if not isinstance(data, dict):
            data = {}
        self._servers, self._scoped = data.get("servers", {}), data.get("scoped", {})
        self._stamp, self._views = stamp, {}
        return copy.deepcopy(self._servers), copy.deepcopy(self._scoped)

    def _write(
        self, servers: dict[str, dict[str, Any]], scoped: dict[str, dict[str, dict[str, Any]]]
    ) -> None:
        scoped = {root: table for root, table in scoped.items() if table}
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".servers-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump({"version": _FORMAT_VERSION, "servers": servers, "scoped": scoped}, file, indent=2)
                file.flush()
                os.fsync(file.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._servers, self._scoped = servers, scoped
        self._stamp, self._views = self._current_stamp(), {}

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


def _importable_from(root: Path, folder: Path) -> bool:
    """Whether an API generated into `root` belongs to a kernel importing from `folder`: `root` is
    that folder or a folder directly in it (``mcptools/``). Not a folder further below: an
    application started in a parent folder (the home folder, say) would otherwise reach every
    server registered for the projects inside it."""
    return root == folder or root.parent == folder
