"""`CodeExecutor.save_snapshot` and `load_snapshot`: the kernel's state to a file and back.

Application side only. `_Snapshots` is a base of :class:`ipybox.app.executor._executor.CodeExecutor`; the
work is in :mod:`ipybox.app.executor._snapshot`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ipybox.app._settings import ExecutorSettings
from ipybox.app.executor import _snapshot
from ipybox.app.executor._snapshot import DEFAULT_MAX_SNAPSHOT_BYTES, SnapshotReport
from ipybox.app.tools import ToolServer


class _Snapshots:
    """`CodeExecutor`'s snapshots."""

    _settings: ExecutorSettings
    _lock: asyncio.Lock

    def _require_started(self) -> tuple[_snapshot.Kernels, ToolServer]:
        raise NotImplementedError  # pragma: no cover  (`_Cells` provides it)

    async def save_snapshot(
        self,
        path: Path | str,
        *,
        max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
        timeout: float = 120,
        dir_fd: int | None = None,
    ) -> SnapshotReport:
        """Write the kernel's state to the file `path`, to be loaded later into a fresh kernel.

        Kept: the user's variables, functions, classes and their instances (each name pickled on
        its own, in the kernel; names that held one object hold one object again), the modules
        bound to names (imported again by name) and the working directory. Not kept, and named in
        the report: open files, sockets and clients, threads, running tasks, generators and frames,
        values that cannot be pickled (each name with its reason), IPython's history and output
        cache, ipybox's own plumbing and the MCP servers' sessions (`SnapshotReport.not_kept`).

        The file is written by the kernel and only checked here (never unpickled); it replaces
        `path` atomically once whole. A name whose value would take the file over `max_bytes` is
        left out, with that reason.

        Args:
            path: The snapshot file to write (its folder must exist).
            max_bytes: The largest snapshot (default 2 GiB).
            timeout: Seconds the kernel may take to write it.
            dir_fd: A descriptor of the folder to write in; `path` is then a file name in it,
                and no link is followed.

        Returns:
            The names saved and left out, the modules, the working directory, size and time.

        Raises:
            RuntimeError: If the executor is not started.
            SnapshotError: If the kernel failed, died or wrote no whole snapshot, or `path`'s folder
                cannot be written.
            TimeoutError: If the kernel took longer than `timeout`.
        """
        kernels, _ = self._require_started()
        async with self._lock:
            return await _snapshot.save(
                kernels, self._settings, path, dir_fd=dir_fd, max_bytes=max_bytes, timeout=timeout
            )

    async def load_snapshot(
        self,
        path: Path | str,
        *,
        max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
        timeout: float = 120,
        dir_fd: int | None = None,
    ) -> SnapshotReport:
        """Load the snapshot at `path` into the kernel (normally a fresh one); its names replace
        those of the same name.

        The file is checked here (whole, of this format, under `max_bytes`) and unpickled only in the
        kernel, with the kernel's rights (sandboxed when the executor is): a hostile snapshot can do
        what a cell can, nothing more. A name that fails to load is reported in `left_out` and the
        others load; the file is never changed.

        Args:
            path: The snapshot file.
            max_bytes: The largest snapshot taken (default 2 GiB).
            timeout: Seconds the kernel may take to load it.
            dir_fd: A descriptor of the folder the file is in; `path` is then a file name in it,
                and no link is followed.

        Returns:
            The names restored and those that were not (with the reason), the modules, the working
            directory, size and time.

        Raises:
            RuntimeError: If the executor is not started.
            SnapshotError: If the file is missing, cut short, not a snapshot, over `max_bytes`, from
                another Python version, or the kernel failed or died loading it.
            TimeoutError: If the kernel took longer than `timeout`.
        """
        kernels, _ = self._require_started()
        async with self._lock:
            return await _snapshot.load(
                kernels, self._settings, path, dir_fd=dir_fd, max_bytes=max_bytes, timeout=timeout
            )
