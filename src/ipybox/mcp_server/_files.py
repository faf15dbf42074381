"""Files in and out of the workspace, confined to it."""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path, PurePosixPath, PureWindowsPath

MAX_FILE_BYTES = 20 * 1024 * 1024


class WorkspacePathError(ValueError):
    """A path that would leave the workspace, or a file that cannot be transferred."""


def resolve(workspace: Path, relative: str) -> Path:
    """The path `relative` names inside `workspace`, refusing every way out of it.

    Refused: an empty path, an absolute path (POSIX or Windows style), a ``..`` component,
    and a path that leaves the workspace through a symbolic link.

    Raises:
        WorkspacePathError: If the path is refused; the message says why.
    """
    if not isinstance(relative, str) or not relative.strip():
        raise WorkspacePathError(
            "The path is empty: give a path relative to the workspace, e.g. 'data/input.csv'."
        )
    if "\x00" in relative:
        raise WorkspacePathError(f"The path {relative!r} contains a NUL character.")
    posix, windows = PurePosixPath(relative), PureWindowsPath(relative)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or relative.startswith(("/", "\\")):
        raise WorkspacePathError(
            f"The path {relative!r} is absolute: give a path relative to the workspace, e.g. 'data/input.csv'."
        )
    if ".." in posix.parts or ".." in windows.parts:
        raise WorkspacePathError(
            f"The path {relative!r} contains '..': give a path inside the workspace without '..'."
        )
    root = workspace.resolve()
    target = (root / relative).resolve()
    if target != root and not target.is_relative_to(root):
        raise WorkspacePathError(
            f"The path {relative!r} leads out of the workspace through a symbolic link; "
            "only files inside the workspace can be transferred."
        )
    return target


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


def write(workspace: Path, relative: str, content_base64: str, max_bytes: int = MAX_FILE_BYTES) -> Path:
    """Decode `content_base64` and write it to `relative` in the workspace (parents created).

    Raises:
        WorkspacePathError: If the path is refused, the content is not base64, or it is larger
            than `max_bytes`.
    """
    target = resolve(workspace, relative)
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
    if target.is_dir():
        raise WorkspacePathError(f"The path {relative!r} is a folder in the workspace; give a file name.")
    target.parent.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a link put in place after the check above is not followed either.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return target


def read(workspace: Path, relative: str, max_bytes: int = MAX_FILE_BYTES) -> tuple[Path, bytes]:
    """Read the file `relative` in the workspace.

    Raises:
        WorkspacePathError: If the path is refused, is not a file, or the file is larger
            than `max_bytes`.
    """
    target = resolve(workspace, relative)
    if not target.is_file():
        raise WorkspacePathError(
            f"There is no file {relative!r} in the workspace; list files from code, e.g. "
            "`import os; os.listdir('.')`."
        )
    if target.stat().st_size > max_bytes:
        raise WorkspacePathError(_too_large(relative, max_bytes, "download"))
    fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise WorkspacePathError(_too_large(relative, max_bytes, "download"))
    return target, data


def _too_large(relative: str, max_bytes: int, what: str) -> str:
    return (
        f"The file {relative!r} is larger than the {what} limit of {max_bytes // (1024 * 1024)} MiB; "
        "split it into smaller parts (e.g. compress or chunk it from code) and transfer those."
    )
