"""The MCP tools `save_snapshot` and `load_snapshot`, and the snapshot of a session closed for idleness.

In the ``ipybox`` MCP server's process (trusted). A session's snapshots are files in the
``snapshots`` folder of its own working folder, named by the agent; the server reaches them only
descriptor-relative (`Confined`, never through a link), and the executor checks each file and hands
it to the session's kernel to unpickle (`CodeExecutor.load_snapshot`): the server never unpickles.
Another session's folder is not reachable by name (a name is one path component), and its sandboxed
kernel cannot see this one.

An HTTP session closed for idleness is snapshotted first, under a name no one can guess
(``idle-<random>``), told to the client that comes back with the old session's id. Its next session
may load it by that name, once: the file moves into the new session's own folder (`Handovers`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import mcp_types as types
from pydantic import Field

from ipybox.app.executor import DEFAULT_MAX_SNAPSHOT_BYTES, CodeExecutor, SnapshotReport
from ipybox.app.sandbox import Confined, ConfinedPathError
from ipybox.errors import IpyboxError
from ipybox.mcp_server._cell_answers import _error, _text
from ipybox.mcp_server._declare import Declared, declare
from ipybox.mcp_server._session_limits import _REMEMBERED

logger = logging.getLogger(__name__)

SNAPSHOTS_DIR = "snapshots"
SUFFIX = ".ipybox-snapshot"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_GIB = DEFAULT_MAX_SNAPSHOT_BYTES // (1024 * 1024 * 1024)

SNAPSHOT_TOOLS: dict[str, Declared] = {}
"""The snapshot tools, declared on `SnapshotTools`' methods; listed after the session's other tools."""
_tool = functools.partial(declare, SNAPSHOT_TOOLS)


class Handovers:
    """Snapshots of sessions closed for idleness, by name, until a later session loads them."""

    def __init__(self) -> None:
        self._folders: collections.OrderedDict[str, Path] = collections.OrderedDict()

    def offer(self, name: str, session_folder: Path) -> None:
        self._folders[name] = session_folder
        # As many as closed sessions whose clients are told the name (older ones are not told).
        while len(self._folders) > _REMEMBERED:
            self._folders.popitem(last=False)

    def claim(self, name: str) -> Path | None:
        """The session folder that holds the snapshot `name`, once."""
        return self._folders.pop(name, None)


def _summary(verb: str, name: str, report: SnapshotReport) -> str:
    lines = [
        f"{verb} snapshot {name!r}: {len(report.names)} names ({', '.join(report.names) or 'none'}), "
        f"modules {', '.join(f'{k}={v}' for k, v in report.modules.items()) or 'none'}, working directory "
        f"{report.working_dir}, {report.size} bytes in {report.seconds:.2f} s."
    ]
    if report.left_out:
        lines.append("Left out: " + "; ".join(f"{k}: {v}" for k, v in report.left_out.items()) + ".")
    lines.append("Never kept: " + "; ".join(report.not_kept) + ".")
    return "\n".join(lines)


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a snapshot name: use 1 to 64 letters, digits, '_', '-' or '.', starting with a "
            "letter or digit, e.g. 'after-cleaning'."
        )
    return name + SUFFIX


@contextlib.contextmanager
def _folder(workspace: Path) -> Iterator[int]:
    """A descriptor of the session's snapshots folder (made when missing), closed on leaving."""
    with Confined(workspace) as root:
        folder = root.open_dir(SNAPSHOTS_DIR, create=True)
    try:
        yield folder
    finally:
        os.close(folder)


class SnapshotTools:
    """The snapshot tools of one session (a base of `ToolSession`)."""

    executor: CodeExecutor
    workspace: Path
    handovers: Handovers | None = None

    @_tool(
        title="Save a snapshot of the kernel",
        description=(
            "Save the kernel's state under a name in this session's snapshots folder, to load later "
            "(after a reset, or in a later session of this client): variables, functions, classes and "
            "their instances, imported modules (imported again by name) and the working directory. Open "
            "files, sockets, clients, threads, running tasks and generators are left out, each named with "
            "the reason. A snapshot of the same name is replaced. At most "
            f"{_GIB} GiB."
        ),
        read_only=False,
        destructive=True,
        idempotent=False,
        open_world=False,
    )
    async def save_snapshot(
        self, name: Annotated[str, Field(description="The snapshot's name, e.g. 'after-cleaning'.")]
    ) -> types.CallToolResult:
        """Save the kernel's state as snapshot `name`."""
        try:
            file = _checked(name)
            with _folder(self.workspace) as folder:
                report = await self.executor.save_snapshot(file, dir_fd=folder)
        except (ValueError, IpyboxError, TimeoutError) as exc:
            return _error(f"The snapshot {name!r} was not saved: {exc}")
        return types.CallToolResult(content=[_text(_summary("Saved", name, report))])

    @_tool(
        title="Load a snapshot into the kernel",
        description=(
            "Load a snapshot saved by save_snapshot in this session (or named to this client when its "
            "earlier session was closed for idleness) into the kernel; its names replace those of the "
            "same name. A name that cannot be loaded is reported and the others load."
        ),
        read_only=False,
        destructive=True,
        idempotent=False,
        open_world=False,
    )
    async def load_snapshot(
        self, name: Annotated[str, Field(description="The snapshot's name, as it was saved.")]
    ) -> types.CallToolResult:
        """Load snapshot `name` into the kernel."""
        try:
            file = _checked(name)
            with _folder(self.workspace) as folder:
                self._take_handover(name, file, folder)
                report = await self.executor.load_snapshot(file, dir_fd=folder)
        except (ValueError, IpyboxError, TimeoutError) as exc:
            return _error(f"The snapshot {name!r} was not loaded: {exc}")
        return types.CallToolResult(content=[_text(_summary("Loaded", name, report))])

    def _take_handover(self, name: str, file: str, folder: int) -> None:
        """Move an idle session's snapshot `name` into this session's folder, if it is offered."""
        with contextlib.suppress(FileNotFoundError):
            os.stat(file, dir_fd=folder, follow_symlinks=False)
            return
        old = self.handovers.claim(name) if self.handovers is not None else None
        if old is None:
            return
        with Confined(old) as root:
            source = root.open_dir(SNAPSHOTS_DIR)
        try:
            os.rename(file, file, src_dir_fd=source, dst_dir_fd=folder)
        finally:
            os.close(source)

    async def save_for_idle(self) -> str | None:
        """Snapshot the session before it is closed for idleness; the name, or None if it failed."""
        name = f"idle-{secrets.token_hex(12)}"
        try:
            with _folder(self.workspace) as folder:
                report = await self.executor.save_snapshot(_checked(name), dir_fd=folder)
        except (ConfinedPathError, IpyboxError, TimeoutError, OSError, RuntimeError) as exc:
            logger.warning("The idle session's kernel could not be snapshotted: %s", exc)
            return None
        logger.info("Snapshot %s of an idle session: %d names", name, len(report.names))
        if self.handovers is not None:
            self.handovers.offer(name, self.workspace)
        return name
