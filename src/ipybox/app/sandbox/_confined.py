"""Trusted file access inside a folder that kernel code can write (application side only).

Code in the kernel can change the workspace at any moment, in particular between a trusted
process checking a path and using it: a folder replaced by a symbolic link sends a write, a
read or a delete somewhere else; a hard link makes a file of the workspace another name for a
file outside it. Every trusted read and write inside such a folder therefore goes through
`Confined`, which

- holds the root folder open as a descriptor and walks every path one component at a time
  with ``os.open(name, O_DIRECTORY | O_NOFOLLOW, dir_fd=parent)``: a link anywhere on the path
  is refused, never followed, and a folder swapped after it was opened changes nothing (the
  descriptor still names the folder that was checked);
- writes a file by creating a new one next to it (``O_CREAT | O_EXCL``) and renaming it over
  the old name, so an inode the kernel planted (a hard link to a file elsewhere) is replaced,
  never written through;
- reads only regular files with a single link, checked on the open descriptor;
- removes trees with ``shutil.rmtree(..., dir_fd=...)``, which does not follow links.

The root itself is taken as the application names it: it must be a folder that kernel code
cannot replace (the workspace is the kernel's working directory; the kernel can write inside it,
not swap it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import TracebackType
from typing import NoReturn, Self

from ipybox.app.sandbox._rules import PROTECTED_WORKSPACE_DIRS

__all__ = [
    "PROTECTED_NAMES",
    "Confined",
    "ConfinedPathError",
    "TooLargeError",
    "check_unprotected",
    "open_child_dir",
    "relative_parts",
    "remove_entry",
    "write_new",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC

PROTECTED_NAMES = frozenset(
    {
        # The folders the sandbox keeps unwritable (git, editors, agents, hook set-ups) ...
        *PROTECTED_WORKSPACE_DIRS,
        # ... and the files that hold secrets or the sandbox's and agents' settings. Not the
        # sandbox's other protected files (``HEAD``, ``.bashrc``): compared at any depth and
        # without case, those names would refuse ordinary data (a ``head/`` folder).
        ".env",
        "sandbox-config.json",
        "srt-settings.json",
        ".srt-settings.json",
        ".mcp.json",
    }
)
"""Names (of a file or a folder, at any depth, compared without case) that the trusted side
neither hands out nor writes for an agent: secrets (``.env``), the sandbox's settings, and the
configuration that agents, editors and git read from a project (writing it would loosen the
sandbox at the next start, or run code at the next ``git`` command)."""


class ConfinedPathError(ValueError):
    """A path that leaves the confined folder, passes through a link, or names the wrong kind of file.

    The message is a full sentence that names the path and says what to do. ``missing`` is
    true when the path (or a folder on it) does not exist, and nothing else was wrong with it.
    """

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def relative_parts(relative: str) -> tuple[str, ...]:
    """The components of `relative`, a path inside a folder, refusing every way out of it.

    Refused: an empty path, a NUL character, an absolute path (POSIX or Windows style) and a
    ``..`` component. ``.`` and empty components are dropped.

    Raises:
        ConfinedPathError: If the path is refused; the message says why.
    """
    if not isinstance(relative, str) or not relative.strip():
        raise ConfinedPathError(
            "The path is empty: give a path relative to the workspace, e.g. 'data/input.csv'."
        )
    if "\x00" in relative:
        raise ConfinedPathError(f"The path {relative!r} contains a NUL character.")
    posix, windows = PurePosixPath(relative), PureWindowsPath(relative)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or relative.startswith(("/", "\\")):
        raise ConfinedPathError(
            f"The path {relative!r} is absolute: give a path relative to the workspace, e.g. 'data/input.csv'."
        )
    if ".." in posix.parts or ".." in windows.parts:
        raise ConfinedPathError(
            f"The path {relative!r} contains '..': give a path inside the workspace without '..'."
        )
    parts = tuple(part for part in relative.replace("\\", "/").split("/") if part not in ("", "."))
    if not parts:
        raise ConfinedPathError(f"The path {relative!r} names the workspace itself: give a file inside it.")
    return parts


def _parts(relative: str | Iterable[str]) -> tuple[str, ...]:
    """Components of a path given as a string (checked by `relative_parts`) or as a sequence."""
    if isinstance(relative, str):
        return relative_parts(relative)
    parts = tuple(relative)
    for part in parts:
        if part in ("", ".", "..") or "/" in part or "\x00" in part or (os.sep != "/" and os.sep in part):
            raise ConfinedPathError(f"{part!r} is not a file or folder name.")
    return parts


def check_unprotected(relative: str, parts: Iterable[str]) -> None:
    """Refuse a path with a component in `PROTECTED_NAMES`.

    Raises:
        ConfinedPathError: If a component is protected.
    """
    for part in parts:
        if part.casefold() in PROTECTED_NAMES:
            raise ConfinedPathError(
                f"The path {relative!r} goes through {part!r}, which holds secrets or configuration that "
                "trusted programs read (the sandbox protects it): it cannot be transferred. Use another name."
            )


class Confined:
    """A folder held open, with file operations that never leave it.

    Paths are relative to the folder, as `relative_parts` accepts them. Use as a context
    manager, or call `close`.

    Args:
        root: The folder; it must exist and is opened as the application names it.
        label: How error messages name the folder.

    Raises:
        ConfinedPathError: If `root` is not a folder.
    """

    def __init__(self, root: Path | str, label: str = "the workspace") -> None:
        self.root = Path(root)
        self.label = label
        try:
            self._fd = os.open(self.root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ConfinedPathError(f"{str(root)!r} is not a folder ({exc.strerror}).") from exc

    def close(self) -> None:
        """Close the folder's descriptor."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open_dir(self, relative: str | Iterable[str], *, create: bool = False) -> int:
        """A descriptor of the folder `relative` (the caller closes it), walked without following links.

        Args:
            relative: The folder, as a path or as its components (empty for the root).
            create: Create missing folders on the way (``mkdir -p``).

        Raises:
            ConfinedPathError: If a component is a link or not a folder, or (without `create`) is missing.
        """
        parts = _parts(relative)
        fd = os.dup(self._fd)
        try:
            for index, part in enumerate(parts):
                where = "/".join(parts[: index + 1])
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise ConfinedPathError(
                            f"There is no folder {where!r} in {self._name}.", missing=True
                        ) from None
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    child = self._open_child_dir(fd, part, where)
                except OSError as exc:
                    self._explain(fd, part, where, exc)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, relative: str) -> None:
        """Create the folder `relative` and its missing parents (``mkdir -p``), never through a link.

        Raises:
            ConfinedPathError: If a component is a link or a file.
        """
        os.close(self.open_dir(relative, create=True))

    def read_bytes(self, relative: str, max_bytes: int) -> bytes:
        """The content of the regular file `relative`.

        Refused: a link (anywhere on the path), a folder, anything but a regular file, a file
        with more than one hard link (it may be another name for a file outside or a protected
        one), and a file larger than `max_bytes`.

        Raises:
            ConfinedPathError: If the file is refused; the message says why.
        """
        parts = relative_parts(relative)
        parent = self.open_dir(parts[:-1])
        try:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=parent)
            except FileNotFoundError:
                raise ConfinedPathError(
                    f"There is no file {relative!r} in {self._name}; list files from code, e.g. "
                    "`import os; os.listdir('.')`.",
                    missing=True,
                ) from None
            except OSError as exc:
                self._explain(parent, parts[-1], relative, exc)
        finally:
            os.close(parent)
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise ConfinedPathError(f"{relative!r} is a folder, not a file: name a file inside it.")
            if not stat.S_ISREG(info.st_mode):
                raise ConfinedPathError(
                    f"{relative!r} is not a regular file (a pipe, socket or device): it cannot be read."
                )
            if info.st_nlink > 1:
                raise ConfinedPathError(
                    f"{relative!r} has {info.st_nlink} hard links: it may be another name for a file outside "
                    "the workspace, so it is not read. Copy it from code (e.g. `shutil.copy(...)`) and read the copy."
                )
            if info.st_size > max_bytes:
                raise TooLargeError(relative, max_bytes)
            os.set_blocking(fd, True)
            chunks, size = [], 0
            while size <= max_bytes and (chunk := os.read(fd, min(max_bytes + 1 - size, 1 << 20))):
                chunks.append(chunk)
                size += len(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise TooLargeError(relative, max_bytes)
        return data

    def write_atomic(self, relative: str, data: bytes | str, mode: int = 0o644) -> None:
        """Replace (or create) the file `relative` with `data`; missing parent folders are created.

        The data goes to a new file in the same folder, which is then renamed over the old
        name: readers see the old or the new content, and whatever inode the name held before
        (a hard link to a file elsewhere) is never written.

        Raises:
            ConfinedPathError: If a component is a link, the name is a folder, or the path ends in ``/``.
        """
        if relative.endswith(("/", "\\")):
            raise ConfinedPathError(
                f"The path {relative!r} names a folder (it ends in '/'): give a file name."
            )
        parts = relative_parts(relative)
        payload = data.encode("utf-8") if isinstance(data, str) else data
        parent = self.open_dir(parts[:-1], create=True)
        name = parts[-1]
        try:
            try:
                existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None:
                if stat.S_ISLNK(existing.st_mode):
                    raise ConfinedPathError(self._link_message(parent, name, relative))
                if stat.S_ISDIR(existing.st_mode):
                    raise ConfinedPathError(f"{relative!r} is a folder in {self._name}: give a file name.")
            temp = f".{name[:64]}.{secrets.token_hex(6)}.tmp"
            fd = os.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=parent
            )
            try:
                if existing is not None and stat.S_ISREG(existing.st_mode):
                    # A replaced file keeps its permission bits (not set-id or sticky ones).
                    os.fchmod(fd, stat.S_IMODE(existing.st_mode) & 0o777)
                with os.fdopen(fd, "wb") as file:
                    file.write(payload)
                # rename never follows a link: if one took the name meanwhile, it is replaced.
                os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                try:
                    os.unlink(temp, dir_fd=parent)
                except OSError:
                    pass
                raise
        except IsADirectoryError:
            raise ConfinedPathError(f"{relative!r} is a folder in {self._name}: give a file name.") from None
        finally:
            os.close(parent)

    def listdir(self, relative: str | Iterable[str] = ()) -> list[str]:
        """The names in the folder `relative` (the root by default), sorted.

        Raises:
            ConfinedPathError: If a component is a link or not a folder.
        """
        fd = self.open_dir(relative)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def remove_tree(self, relative: str | Iterable[str]) -> None:
        """Delete `relative`: a folder with everything in it, or a file or link (never followed).

        A missing name is not an error.
        """
        parts = _parts(relative)
        if not parts:
            raise ConfinedPathError(f"The root of {self._name} cannot be removed.")
        parent = self.open_dir(parts[:-1])
        try:
            remove_entry(parent, parts[-1])
        finally:
            os.close(parent)

    def replace_folder(self, relative: str | Iterable[str], fill: Callable[[int], None]) -> None:
        """Make `relative` a new folder that `fill` writes, swapped in whole by a rename.

        `fill` gets a descriptor of a fresh folder next to `relative` (use `write_new`); once it
        returns, the folder is renamed to `relative`. A failure leaves the old folder in place;
        the old one (or whatever kernel code put in its place: a link is renamed and unlinked,
        never followed) is removed only once the new one is in. Missing parents are created.

        Raises:
            ConfinedPathError: If a parent is a link or a file.
            OSError: If `fill` or the swap fails.
        """
        parts = _parts(relative)
        if not parts:
            raise ConfinedPathError(f"The root of {self._name} cannot be replaced.")
        name = parts[-1]
        parent = self.open_dir(parts[:-1], create=True)
        # mkdir, not mkdtemp: the new folder gets the usual permissions, not 0700.
        staging = f".{name[:64]}.{secrets.token_hex(6)}.new"
        retired = f".{name[:64]}.{secrets.token_hex(6)}.old"
        try:
            os.mkdir(staging, 0o777, dir_fd=parent)
            try:
                staged = open_child_dir(parent, staging)
                try:
                    fill(staged)
                finally:
                    os.close(staged)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(name, retired, src_dir_fd=parent, dst_dir_fd=parent)
                try:
                    os.rename(staging, name, src_dir_fd=parent, dst_dir_fd=parent)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.rename(retired, name, src_dir_fd=parent, dst_dir_fd=parent)
                    raise
            finally:
                for leftover in (staging, retired):
                    with contextlib.suppress(OSError):
                        remove_entry(parent, leftover)
        finally:
            os.close(parent)

    @property
    def _name(self) -> str:
        return self.label

    def _open_child_dir(self, fd: int, part: str, where: str) -> int:
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            self._explain(fd, part, where, exc)

    def _explain(self, parent: int, name: str, where: str, exc: OSError) -> NoReturn:
        """Raise the `ConfinedPathError` that says why opening `name` failed."""
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            info = None
        if (info is not None and stat.S_ISLNK(info.st_mode)) or exc.errno == errno.ELOOP:
            raise ConfinedPathError(self._link_message(parent, name, where)) from None
        if info is not None and stat.S_ISDIR(info.st_mode):
            # Not a folder when opened, a folder now: something swapped it meanwhile.
            raise ConfinedPathError(
                f"{where!r} in {self._name} changed while it was opened (replaced by a symbolic link or a "
                "file, then back); trusted file access does not follow links. Try again once it stays put."
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise ConfinedPathError(f"{where!r} in {self._name} is a file, not a folder.") from None
        raise ConfinedPathError(f"{where!r} in {self._name} cannot be opened: {exc.strerror}.") from exc

    def _link_message(self, parent: int, name: str, where: str) -> str:
        try:
            target = os.readlink(name, dir_fd=parent)
        except OSError:
            target = "?"
        return (
            f"{where!r} in {self._name} is a symbolic link (to {target!r}); trusted file access does not "
            "follow links, which kernel code could point anywhere. Remove the link (e.g. `os.unlink(...)` "
            "from code) or use another path, and try again."
        )


class TooLargeError(ConfinedPathError):
    """A file larger than the limit of the operation."""

    def __init__(self, relative: str, max_bytes: int) -> None:
        self.relative = relative
        self.max_bytes = max_bytes
        super().__init__(
            f"The file {relative!r} is larger than the limit of {max_bytes / (1024 * 1024):g} MiB; "
            "split it into smaller parts (e.g. compress or chunk it from code) and transfer those."
        )


def write_new(dir_fd: int, name: str, data: bytes | str, mode: int = 0o644) -> None:
    """Write the file `name`, which must not exist yet, in the folder `dir_fd` (from `Confined.open_dir`).

    Raises:
        FileExistsError: If the name exists, whatever it is (a link is not followed).
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as file:
        file.write(payload)


def open_child_dir(dir_fd: int, name: str) -> int:
    """A descriptor of the folder `name` in the folder `dir_fd`; a link there is not followed.

    Raises:
        OSError: If `name` is missing, a link (``ELOOP``) or not a folder.
    """
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def remove_entry(dir_fd: int, name: str) -> None:
    """Delete `name` in the folder `dir_fd`: a folder with its content, or a file or link, never followed.

    A missing name is not an error.
    """
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        # Safe against links planted inside the tree while it is removed (it opens each folder
        # with O_NOFOLLOW relative to its parent); a link found there is unlinked, not followed.
        if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - every POSIX system ipybox runs on
            raise ConfinedPathError(f"{name!r} cannot be removed safely on this platform.")
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except IsADirectoryError:
            shutil.rmtree(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
