"""Stand-ins for the protected names missing in a working directory, made and removed however the application ends."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from ipybox.app.sandbox._rules import PROTECTED_WORKSPACE_DIRS, PROTECTED_WORKSPACE_FILES
from ipybox.app.sandbox._srt import private_base

_STAND_IN_CONTENT = {".mcp.json": b'{"mcpServers": {}}\n'}
"""What a stand-in for a missing protected file holds (others are empty): Claude Code refuses an
empty ``.mcp.json``, and with it every server of the project, even one that made the stand-in."""

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
