"""Snapshots of a kernel's state: moving the file between the application and the kernel, checked.

Application side. The snapshot's bytes are written by the kernel (untrusted) and are unpickled only
by the kernel (`ipybox.kernel._snapshot`, called from silent cells): this module never imports a
pickler. It checks the frame around the pickles (`ipybox.kernel._snapshot_format`: the magic, the
format, the sizes, the cap) whenever a file crosses to or from the kernel, and each pickle's SHA-256
before a file goes into a kernel, so that what the application keeps is a whole snapshot and what it
hands a kernel is undamaged.

How the file travels:

- a local (or pooled) kernel writes and reads a staging file of a random name in its working
  directory, which a sandboxed kernel can write too; the application reads it descriptor-relative,
  never through a link, refuses anything but a regular file with one link, and copies it (checked)
  to the destination by an atomic rename, and removes the staging file in any case;
- a remote kernel (`kernel_gateway_url`) writes the staging file on its own host, and the bytes
  travel over the gateway's connection: back as `RemoteKernelHost.download` reads files, out in
  pieces of base64 in silent cells.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels import KernelHost, RemoteKernelHost
from ipybox.app.pool import PooledKernels
from ipybox.errors import ExecutionError, KernelDiedError, SnapshotError
from ipybox.kernel._snapshot_format import (
    DEFAULT_MAX_SNAPSHOT_BYTES,
    MAGIC,
    TAIL_BYTES,
    SnapshotFormatError,
    Trailer,
    parse_trailer,
    trailer_length,
)

__all__ = ["DEFAULT_MAX_SNAPSHOT_BYTES", "NOT_KEPT", "SnapshotReport", "load", "save"]

Kernels = KernelHost | PooledKernels | RemoteKernelHost

NOT_KEPT = (
    "IPython's own history and output cache (In, Out, _, _1, ...)",
    "open resources: files, sockets, clients holding connections",
    "running tasks, threads and processes",
    "ipybox's own plumbing in the kernel (set up again in every kernel)",
    "the MCP servers' sessions (they start again on their next tool call)",
)
"""What a snapshot never holds, whatever the namespace: every report lists it."""

_KERNEL_MODULE = "__import__('ipybox.kernel._snapshot', fromlist=['save'])"
_CHUNK = 4 * 1024 * 1024
# Bytes of a snapshot per cell on the way to a remote kernel: 4 MiB of base64 in one message.
_PIECE = 3 * 1024 * 1024
_MAX_REPORT_CHARS = 16 * 1024 * 1024


@dataclass(frozen=True)
class SnapshotReport:
    """What a snapshot saved or loaded, and what it left out.

    Attributes:
        path: The snapshot file.
        names: The names saved (or, for a load, restored), each with its value.
        left_out: Names not saved (or not restored), each with the reason: an open file, a socket
            or client, a thread, a running task, a generator or frame, a value that cannot be
            pickled, one over the size cap; for a load also a module that no longer imports, or a
            value that failed to load (the others loaded).
        modules: Names bound to modules, with the module imported again under that name.
        working_dir: The kernel's working directory when the snapshot was saved (a load goes back
            there when it exists, unless the executor keeps the kernel in its `working_dir`).
        size: The snapshot file's size in bytes.
        seconds: How long the save or load took, as the application measured it.
        not_kept: What no snapshot holds (`NOT_KEPT`).
    """

    path: str
    names: tuple[str, ...]
    left_out: dict[str, str]
    modules: dict[str, str]
    working_dir: str
    size: int
    seconds: float
    not_kept: tuple[str, ...] = NOT_KEPT


def _check(fd: int, size: int, max_bytes: int, what: str, hashes: bool = True) -> Trailer:
    """Check the snapshot file `fd` of `size` bytes: its frame, and (`hashes`) each pickle against
    its SHA-256. A file on its way into a kernel is checked whole; one the kernel just wrote only
    for its frame (its checksums are the kernel's own word, and are checked when it is loaded).

    Read with ``pread`` into one buffer, never mapped: a file the kernel can truncate must not be
    able to crash this process (a mapped page that vanishes raises SIGBUS).

    Raises:
        SnapshotError: Saying what is wrong with `what`.
    """
    _cap(size, max_bytes, what)
    try:
        head, tail = _read(fd, len(MAGIC), 0), _read(fd, TAIL_BYTES, max(size - TAIL_BYTES, 0))
        length = trailer_length(head, tail, size)
        trailer = parse_trailer(_read(fd, length, size - TAIL_BYTES - length), size)
    except SnapshotFormatError as exc:
        raise SnapshotError(f"{what} is not a snapshot ipybox can load: {exc}.") from None
    buffer = bytearray(_CHUNK)
    for segment in trailer.segments if hashes else ():
        digest = hashlib.sha256()
        for start in range(segment.offset, segment.offset + segment.size, _CHUNK):
            count = min(_CHUNK, segment.offset + segment.size - start)
            view = memoryview(buffer)[:count]
            if os.preadv(fd, [view], start) != count:
                raise SnapshotError(f"{what} changed while it was read; try again.")
            digest.update(view)
        if digest.hexdigest() != segment.sha256:
            raise SnapshotError(
                f"{what} is damaged: the bytes of {segment.name!r} do not match their checksum."
            )
    return trailer


def _cap(size: int, max_bytes: int, what: str) -> None:
    if size > max_bytes:
        raise SnapshotError(
            f"{what} is {size} bytes, over the cap of {max_bytes} bytes; pass a larger max_bytes if it "
            "is meant to be this large."
        )


def _read(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise SnapshotFormatError("it is cut short (truncated)")
    return data


def _copy(source: int | bytes, out: int, size: int) -> None:
    """Write `source` (a file's first `size` bytes, or bytes) to `out`, in the OS where it can."""
    offset = 0
    copy_range = getattr(os, "copy_file_range", None)
    while offset < size:
        count = min(_CHUNK, size - offset)
        if isinstance(source, bytes):
            done = os.pwrite(out, memoryview(source)[offset : offset + count], offset)
        elif copy_range is not None:
            try:
                done = copy_range(source, out, size - offset, offset, offset)
            except OSError:  # not between these file systems or files: copied through this process
                copy_range = None
                continue
        else:
            done = os.pwrite(out, os.pread(source, count, offset), offset)
        if done == 0:
            raise SnapshotError("The snapshot changed while it was copied; try again.")
        offset += done


def _keep(
    source: int | bytes, size: int, max_bytes: int, what: str, dir_fd: int, name: str, hashes: bool
) -> Trailer:
    """Copy `source` to `name` in `dir_fd`, check the copy, and only then put it in place
    (atomically): an earlier file there stays if anything fails."""
    _cap(size, max_bytes, what)
    temp = f".{name}.{secrets.token_hex(6)}.part"
    out = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        try:
            _copy(source, out, size)
            trailer = _check(out, os.fstat(out).st_size, max_bytes, what, hashes)
        finally:
            os.close(out)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    return trailer


def _open_regular(dir_fd: int | None, path: str, what: str) -> int:
    """A read descriptor of the regular file `path` (relative to `dir_fd`), never through a link."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if dir_fd is not None else 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise SnapshotError(f"There is no snapshot at {what}; check the path (or name).") from None
    except OSError as exc:
        raise SnapshotError(f"{what} cannot be opened: {exc.strerror or exc}.") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (dir_fd is not None and info.st_nlink != 1):
        os.close(fd)
        raise SnapshotError(f"{what} is not a regular file of its own; a snapshot is one.")
    return fd


def _dest(path: Path | str, dir_fd: int | None) -> tuple[int, str]:
    """A descriptor of the folder `path` names (`dir_fd` itself, duplicated, if given), and the file's name."""
    where = Path(path)
    if not where.name or where.name in (".", ".."):
        raise SnapshotError(f"{str(path)!r} does not name a file; give the snapshot a file name.")
    if dir_fd is not None:
        return os.dup(dir_fd), _file_name(path)
    try:
        return os.open(where.parent, os.O_RDONLY | os.O_DIRECTORY), where.name
    except OSError as exc:
        raise SnapshotError(f"The folder of {str(path)!r} cannot be opened: {exc.strerror or exc}.") from None


def _file_name(path: Path | str) -> str:
    """`path` as one file name: with a folder's descriptor, nothing on the way can be a link."""
    name = str(path)
    if not name or "/" in name or name in (".", ".."):
        raise SnapshotError(
            f"With dir_fd, the snapshot is named by a file name in that folder, not {name!r}."
        )
    return name


async def _call(kernels: Kernels, expression: str, timeout: float, doing: str) -> str:
    """The text value of `expression` evaluated silently in the kernel."""
    try:
        text = (await kernels.client.evaluate("", {"value": expression}, timeout=timeout))["value"]
    except KernelDiedError as exc:
        message = await kernels.recover()
        raise SnapshotError(f"The kernel died while it was {doing}: {message}") from exc
    except ExecutionError as exc:
        raise SnapshotError(f"The kernel failed while it was {doing}: {exc.ename}: {exc.evalue}") from None
    return text


def _report(text: str, path: str, size: int, started: float) -> SnapshotReport:
    """The kernel's report (a JSON string's repr), checked for shape."""
    try:
        raw = json.loads(ast.literal_eval(text)) if len(text) <= _MAX_REPORT_CHARS else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raw = None
    if not (
        isinstance(raw, dict)
        and isinstance(raw.get("names"), list)
        and all(isinstance(name, str) for name in raw["names"])
        and _text_map(raw.get("left_out"))
        and _text_map(raw.get("modules"))
        and isinstance(raw.get("working_dir"), str)
    ):
        raise SnapshotError(
            "The kernel's report of the snapshot is not one (was the kernel's ipybox changed?)."
        )
    return SnapshotReport(
        path=path,
        names=tuple(raw["names"]),
        left_out=dict(raw["left_out"]),
        modules=dict(raw["modules"]),
        working_dir=raw["working_dir"],
        size=size,
        seconds=time.perf_counter() - started,
    )


def _text_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _staging_name() -> str:
    return f".ipybox-snapshot-{secrets.token_hex(8)}.part"


def _kernel_folder(settings: ExecutorSettings) -> Path:
    return (settings.working_dir or Path.cwd()).resolve()


async def save(
    kernels: Kernels,
    settings: ExecutorSettings,
    path: Path | str,
    *,
    dir_fd: int | None,
    max_bytes: int,
    timeout: float,
) -> SnapshotReport:
    """Save the kernel's namespace to `path` (relative to `dir_fd` when given); see `CodeExecutor.save_snapshot`."""
    started = time.perf_counter()
    what = repr(str(path))
    folder, name = await asyncio.to_thread(_dest, path, dir_fd)
    try:
        staging = _staging_name()
        if isinstance(kernels, RemoteKernelHost):
            target = staging
        else:
            target = str(_kernel_folder(settings) / staging)
        call = f"{_KERNEL_MODULE}.save({target!r}, {int(max_bytes)})"
        try:
            await _call(kernels, call, timeout, "saving the snapshot")
            if isinstance(kernels, RemoteKernelHost):
                data = await kernels.download(staging, max_bytes)
                trailer = await asyncio.to_thread(
                    _keep, data, len(data), max_bytes, what, folder, name, False
                )
                size = len(data)
            else:
                trailer, size = await asyncio.to_thread(
                    _copy_local, settings, staging, max_bytes, what, folder, name
                )
        finally:
            await _remove_staging(kernels, settings, staging, timeout)
    finally:
        os.close(folder)
    return SnapshotReport(
        path=str(path),
        names=tuple(segment.name for segment in trailer.segments),
        left_out=dict(trailer.left_out),
        modules=dict(trailer.modules),
        working_dir=trailer.working_dir,
        size=size,
        seconds=time.perf_counter() - started,
    )


def _copy_local(
    settings: ExecutorSettings, staging: str, max_bytes: int, what: str, folder: int, name: str
) -> tuple[Trailer, int]:
    kernel_dir = os.open(_kernel_folder(settings), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = _open_regular(kernel_dir, staging, "the kernel's snapshot")
    finally:
        os.close(kernel_dir)
    try:
        size = os.fstat(fd).st_size
        return _keep(fd, size, max_bytes, what, folder, name, False), size
    finally:
        os.close(fd)


async def _remove_staging(kernels: Kernels, settings: ExecutorSettings, staging: str, timeout: float) -> None:
    if isinstance(kernels, RemoteKernelHost):
        with contextlib.suppress(SnapshotError):
            await _call(kernels, f"{_KERNEL_MODULE}.remove({staging!r})", timeout, "cleaning up")
        return

    def unlink() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_kernel_folder(settings) / staging)

    await asyncio.to_thread(unlink)


async def load(
    kernels: Kernels,
    settings: ExecutorSettings,
    path: Path | str,
    *,
    dir_fd: int | None,
    max_bytes: int,
    timeout: float,
) -> SnapshotReport:
    """Load the snapshot at `path` into the kernel; see `CodeExecutor.load_snapshot`."""
    started = time.perf_counter()
    what = repr(str(path))
    fd = await asyncio.to_thread(
        _open_regular, dir_fd, str(path) if dir_fd is None else _file_name(path), what
    )
    staging = _staging_name()
    try:
        size = os.fstat(fd).st_size
        if isinstance(kernels, RemoteKernelHost):
            await asyncio.to_thread(_check, fd, size, max_bytes, what)
            await _send(kernels, fd, size, staging, timeout)
            target = staging
        else:
            folder = await asyncio.to_thread(os.open, _kernel_folder(settings), os.O_RDONLY | os.O_DIRECTORY)
            try:
                await asyncio.to_thread(_keep, fd, size, max_bytes, what, folder, staging, True)
            finally:
                os.close(folder)
            target = str(_kernel_folder(settings) / staging)
        # A kernel kept in its `working_dir` stays there; else it goes back where it was saved.
        call = f"{_KERNEL_MODULE}.load({target!r}, chdir={settings.working_dir is None})"
        text = await _call(kernels, call, timeout, f"loading the snapshot {what}")
    finally:
        os.close(fd)
        await _remove_staging(kernels, settings, staging, timeout)
    return _report(text, str(path), size, started)


async def _send(kernels: RemoteKernelHost, fd: int, size: int, staging: str, timeout: float) -> None:
    """Write the file `fd` to `staging` on a remote kernel's host, a piece per silent cell."""
    for offset in range(0, size, _PIECE):
        piece = await asyncio.to_thread(os.pread, fd, _PIECE, offset)
        data = base64.b64encode(piece).decode("ascii")
        await _call(
            kernels,
            f"{_KERNEL_MODULE}.put({staging!r}, {offset}, {data!r})",
            timeout,
            "receiving the snapshot",
        )
