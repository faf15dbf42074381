"""Files in and out of the workspace for the MCP server's tools, through `ipybox.app.sandbox._confined`."""

from __future__ import annotations

import base64
import binascii
import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipybox.app.mcp_client import default_registry_path
from ipybox.app.sandbox import (
    Confined,
    ConfinedPathError,
    TooLargeError,
    check_unprotected,
    relative_parts,
)

MAX_FILE_BYTES = 20 * 1024 * 1024

WorkspacePathError = ConfinedPathError
"""A path that would leave the workspace, or a file that cannot be transferred."""


@dataclass(frozen=True)
class Rules:
    """What a custom sandbox configuration denies inside the workspace, which the file tools then
    refuse too (so they never hand out what the kernel may not read, or write what it may not).

    Attributes:
        deny_read: Paths (relative to the workspace, ``/``-separated, globs allowed) never downloaded.
        deny_write: Paths never uploaded.
    """

    deny_read: tuple[str, ...] = ()
    deny_write: tuple[str, ...] = ()

    @classmethod
    def from_sandbox_config(cls, workspace: Path, config: dict[str, Any] | None) -> Rules:
        """The rules of srt settings `config` (``filesystem.denyRead`` / ``denyWrite``) for `workspace`."""
        filesystem = (config or {}).get("filesystem") or {}
        return cls(
            deny_read=_inside(workspace, filesystem.get("denyRead") or []),
            deny_write=_inside(workspace, filesystem.get("denyWrite") or []),
        )


def _inside(workspace: Path, entries: list[Any]) -> tuple[str, ...]:
    root = os.path.realpath(workspace)
    inside = []
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            continue
        path = os.path.expanduser(entry)
        path = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
        if path == root or not path.startswith(root + os.sep):
            continue
        inside.append(path[len(root) + 1 :].replace(os.sep, "/"))
    return tuple(inside)


def _denied(parts: tuple[str, ...], patterns: tuple[str, ...]) -> str | None:
    """The pattern that covers the path `parts` (the path or one of its folders), if any."""
    for pattern in patterns:
        for depth in range(1, len(parts) + 1):
            if fnmatch.fnmatchcase("/".join(parts[:depth]), pattern):
                return pattern
    return None


def server_folder(workspace: Path, folder: Path) -> Path:
    """Check `folder`, inside `workspace`, before the server writes into it.

    Code in the kernel can change the workspace: a folder the server writes into (or any of
    its parents up to the workspace) replaced by a symbolic link would make the server write,
    or delete, outside the workspace. Such a folder is refused; one that does not exist yet is
    fine (the server creates it).

    Raises:
        WorkspacePathError: If an existing part of `folder` below the workspace is a symbolic
            link, or `folder` resolves outside the workspace.
    """
    root = workspace.resolve()
    try:
        relative = folder.relative_to(workspace)
    except ValueError:
        raise WorkspacePathError(f"{folder} is not inside the workspace {workspace}.") from None
    if ".." in relative.parts:
        raise WorkspacePathError(f"{folder} contains '..'; the server writes only inside the workspace.")
    path = root
    for part in relative.parts:
        path = path / part
        if path.is_symlink():
            raise WorkspacePathError(
                f"{path.relative_to(root)} in the workspace is a symbolic link (to {os.readlink(path)}); "
                "the server does not write through links. Remove it (e.g. `os.unlink(...)` from code) "
                "and try again."
            )
    if not path.resolve().is_relative_to(root):
        raise WorkspacePathError(
            f"{relative} leads out of the workspace {root}; the server does not write there."
        )
    return folder


def write(
    workspace: Path,
    relative: str,
    content_base64: str,
    max_bytes: int = MAX_FILE_BYTES,
    rules: Rules = Rules(),
) -> int:
    """Decode `content_base64` and write it to `relative` in the workspace; the number of bytes written.

    Parent folders are created; an existing file is replaced (atomically, never written in
    place). Protected names (`ipybox.app.sandbox._confined.PROTECTED_NAMES`, the registry) are refused.

    Raises:
        WorkspacePathError: If the path is refused, the content is not base64, or it is larger
            than `max_bytes`.
    """
    _check(workspace, relative, rules.deny_write, "write")
    # Base64 takes 4 characters per 3 bytes: refuse oversized input before decoding it.
    if len(content_base64) > (max_bytes + 2) // 3 * 4 + 4:
        raise WorkspacePathError(_too_large(relative, max_bytes, "upload"))
    try:
        data = base64.b64decode(content_base64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WorkspacePathError(
            f"The content for {relative!r} is not valid base64 ({exc}); encode the file's bytes with base64."
        ) from exc
    if len(data) > max_bytes:
        raise WorkspacePathError(_too_large(relative, max_bytes, "upload"))
    try:
        with Confined(workspace) as root:
            root.write_atomic(relative, data)
    except OSError as exc:
        raise WorkspacePathError(
            f"Could not write {relative!r} in the workspace: {exc.strerror or exc}."
        ) from exc
    return len(data)


def read(workspace: Path, relative: str, max_bytes: int = MAX_FILE_BYTES, rules: Rules = Rules()) -> bytes:
    """The content of the file `relative` in the workspace.

    Refused: links anywhere on the path, folders, anything but a regular file with a single
    hard link, protected names, and files over `max_bytes`.

    Raises:
        WorkspacePathError: If the path is refused, is not a file, or the file is larger
            than `max_bytes`.
    """
    _check(workspace, relative, rules.deny_read, "read")
    try:
        with Confined(workspace) as root:
            return root.read_bytes(relative, max_bytes)
    except TooLargeError:
        raise WorkspacePathError(_too_large(relative, max_bytes, "download")) from None
    except OSError as exc:
        raise WorkspacePathError(
            f"Could not read {relative!r} in the workspace: {exc.strerror or exc}."
        ) from exc


def check_read(workspace: Path, relative: str, rules: Rules = Rules()) -> None:
    """Refuse `relative` as `read` does by its name (protected names, denied paths, the registry),
    without opening anything: for a file on a remote kernel's host.

    Raises:
        WorkspacePathError: If the path is refused.
    """
    _check(workspace, relative, rules.deny_read, "read")


def _check(workspace: Path, relative: str, denied: tuple[str, ...], what: str) -> None:
    parts = relative_parts(relative)
    check_unprotected(relative, parts)
    if (pattern := _denied(parts, denied)) is not None:
        raise WorkspacePathError(
            f"The path {relative!r} is covered by {pattern!r}, which the sandbox's settings do not let the "
            f"kernel {what}: the file tools refuse it too."
        )
    # The registry is never in the workspace by default; if IPYBOX_STATE_DIR puts it there, it
    # is protected like the sandbox's settings.
    registry = os.path.realpath(default_registry_path().parent)
    root = os.path.realpath(workspace)
    if os.path.commonpath([registry, root]) == root:
        folder = Path(registry).relative_to(root).parts
        if tuple(part.casefold() for part in parts[: len(folder)]) == tuple(p.casefold() for p in folder):
            raise WorkspacePathError(
                f"The path {relative!r} is in the folder of ipybox's trusted registry: it cannot be transferred."
            )


def _too_large(relative: str, max_bytes: int, what: str) -> str:
    return (
        f"The file {relative!r} is larger than the {what} limit of {max_bytes // (1024 * 1024)} MiB; "
        "split it into smaller parts (e.g. compress or chunk it from code) and transfer those."
    )
