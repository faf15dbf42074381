"""Saving and loading the kernel's namespace: the only place a snapshot's pickles are made or read.

Runs in the kernel (untrusted), standard library only. The application calls these functions from
silent cells (`ipybox.app._snapshot`) and reads back a JSON report; it checks the file's frame
(`ipybox.kernel._snapshot_format`) but never unpickles it. Loading a snapshot therefore runs in the
kernel whatever the snapshot's pickles do, with the kernel's rights (sandboxed when it is): no more
than a cell could do.

Each name gets its own pickle, so that a load that fails for one name keeps the others. A value
that is the value of an earlier name as well is written as a reference to that name (the two
names are the same object again after a load). Functions and classes defined in cells are pickled
by value with ``cloudpickle`` when the kernel's Python has it (ipybox depends on it); without it,
the standard ``pickle`` writes them by reference, and they are left out.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import importlib
import io
import json
import os
import pickle
import platform
import re
import socket
import subprocess
import sys
import threading
import time
import types
from typing import Any

from ipybox.kernel._snapshot_format import (
    MAGIC,
    MAX_TRAILER_BYTES,
    TAIL_BYTES,
    SnapshotFormatError,
    Segment,
    Trailer,
    encode_trailer,
    parse_trailer,
    reason,
    trailer_length,
)

# IPython's history and output cache, ipybox's own names and the module's dunder names: never saved.
_NOT_SAVED = re.compile(r"_+|_i+|_i?\d+|_ih|_oh|_dh|In|Out|__\w+__|_ipybox\w*")
_NOT_REFERENCED = (type(None), bool, int, float, complex, str, bytes)
_KINDS: tuple[tuple[tuple[type, ...], str], ...] = (
    ((io.IOBase,), "an open file or stream (open resources are not kept; open it again after loading)"),
    ((socket.socket,), "a socket (connections are not kept; connect again after loading)"),
    ((threading.Thread,), "a thread (threads are not kept; start it again after loading)"),
    (
        (asyncio.Future, concurrent.futures.Future),
        "a running task or future (running tasks are not kept; start it again after loading)",
    ),
    (
        (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType, types.FrameType, types.TracebackType),
        "a generator, coroutine or frame (a running frame's state cannot be saved)",
    ),
    ((subprocess.Popen,), "a process (processes are not kept; start it again after loading)"),
)


class _TooLarge(Exception):
    pass


class _Missing(Exception):
    pass


class _Segment(io.RawIOBase):
    """Where one name's pickle is written: the file, counted against the cap and hashed."""

    def __init__(self, fd: int, offset: int, limit: int) -> None:
        super().__init__()
        self.fd, self.start, self.offset, self.limit = fd, offset, offset, limit
        self.hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.offset + len(view) > self.limit:
            raise _TooLarge
        while view:
            written = os.pwrite(self.fd, view, self.offset)
            self.hash.update(view[:written])
            self.offset += written
            view = view[written:]
        return len(data) if isinstance(data, bytes) else memoryview(data).nbytes


def _pickler() -> tuple[type[pickle.Pickler], str]:
    try:
        # Imported by name: the kernel side imports only the standard library statically, and a
        # kernel whose Python lacks cloudpickle still saves what the standard pickle can.
        module = importlib.import_module("cloudpickle")
    except ImportError:
        return pickle.Pickler, "pickle"
    return module.Pickler, f"cloudpickle {getattr(module, '__version__', '?')}"


def _shell() -> Any:
    # The kernel's own IPython, found where the kernel loaded it (the kernel side imports no
    # third-party package itself).
    return sys.modules["IPython"].get_ipython()


def _python() -> str:
    return "{}.{}".format(*sys.version_info[:2])


def _user_names(ip: Any) -> list[str]:
    hidden = getattr(ip, "user_ns_hidden", {})
    names = []
    for name, value in list(ip.user_ns.items()):
        if _NOT_SAVED.fullmatch(name) or (name in hidden and hidden[name] is value):
            continue
        names.append(name)
    return names


def save(path: str, max_bytes: int) -> str:
    """Write the namespace to the new file `path`; return the report (JSON).

    Raises:
        FileExistsError: If `path` exists.
    """
    started = time.perf_counter()
    ip = _shell()
    namespace = ip.user_ns
    base, pickler_name = _pickler()
    refs: dict[int, str] = {}

    class Pickler(base):  # type: ignore[valid-type,misc]  # a class chosen at run time
        def persistent_id(self, obj: Any) -> str | None:
            return refs.get(id(obj))

    segments: list[Segment] = []
    modules: dict[str, str] = {}
    left_out: dict[str, str] = {}
    limit = max_bytes - MAX_TRAILER_BYTES - TAIL_BYTES
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, MAGIC)
        offset = len(MAGIC)
        for name in _user_names(ip):
            value = namespace[name]
            if isinstance(value, types.ModuleType):
                module_name = getattr(value, "__name__", None)
                if isinstance(module_name, str) and sys.modules.get(module_name) is value:
                    modules[name] = module_name
                else:
                    left_out[name] = "a module that cannot be imported again by its name"
                continue
            kind = next((text for kinds, text in _KINDS if isinstance(value, kinds)), None)
            if kind is not None:
                left_out[name] = kind
                continue
            out = _Segment(fd, offset, limit)
            try:
                Pickler(out, protocol=5).dump(value)
            except _TooLarge:
                left_out[name] = f"too large: the snapshot would pass its cap of {max_bytes} bytes (less room for its table of names)"
            except Exception as exc:  # broad: whatever stops one value's pickle leaves that name out
                left_out[name] = reason(f"cannot be pickled: {type(exc).__name__}: {exc}")
            else:
                segments.append(Segment(name, offset, out.offset - offset, out.hash.hexdigest()))
                offset = out.offset
                if not isinstance(value, _NOT_REFERENCED):
                    refs[id(value)] = name
                continue
            os.ftruncate(fd, offset)
        trailer = Trailer(
            python=_python(),
            implementation=platform.python_implementation(),
            pickler=pickler_name,
            working_dir=os.getcwd(),
            segments=tuple(segments),
            modules=modules,
            left_out=left_out,
        )
        os.pwrite(fd, encode_trailer(trailer), offset)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    size = os.fstat(fd).st_size
    os.close(fd)
    return _report([s.name for s in segments], modules, left_out, trailer.working_dir, size, started)


def load(path: str, remove: bool = True) -> str:
    """Load the snapshot file `path` into the namespace (and remove the file); return the report (JSON).

    Raises:
        ValueError: If the file is not a whole snapshot, or was written by another Python.
    """
    started = time.perf_counter()
    ip = _shell()
    namespace = ip.user_ns
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    finally:
        if remove:
            os.unlink(path)
    try:
        size = os.fstat(fd).st_size
        head, tail = os.pread(fd, len(MAGIC), 0), os.pread(fd, TAIL_BYTES, max(size - TAIL_BYTES, 0))
        try:
            length = trailer_length(head, tail, size)
            trailer = parse_trailer(os.pread(fd, length, size - TAIL_BYTES - length), size)
        except SnapshotFormatError as exc:
            raise ValueError(f"{path} cannot be loaded: {exc}.") from None
        here = f"{platform.python_implementation()} {_python()}"
        if f"{trailer.implementation} {trailer.python}" != here:
            raise ValueError(
                f"The snapshot was saved by {trailer.implementation} {trailer.python}, and this kernel runs "
                f"{here}; its pickles hold code of that version. Load it in a kernel of {trailer.python}."
            )
        loaded: dict[str, Any] = {}

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                if pid not in loaded:
                    raise _Missing(pid)
                return loaded[pid]

        left_out: dict[str, str] = {}
        modules: dict[str, str] = {}
        for alias, module_name in trailer.modules.items():
            try:
                namespace[alias] = importlib.import_module(module_name)
                modules[alias] = module_name
            except Exception as exc:  # broad: a module that fails to import is reported, the rest load
                left_out[alias] = reason(f"module {module_name} could not be imported: {type(exc).__name__}: {exc}")
        for segment in trailer.segments:
            data = os.pread(fd, segment.size, segment.offset)
            if len(data) != segment.size or hashlib.sha256(data).hexdigest() != segment.sha256:
                left_out[segment.name] = "its bytes changed after the snapshot was checked"
                continue
            try:
                value = Unpickler(io.BytesIO(data)).load()
            except _Missing as exc:
                left_out[segment.name] = f"it refers to {exc.args[0]}, which did not load"
                continue
            except Exception as exc:  # broad: one name that fails to load is reported, the rest load
                left_out[segment.name] = reason(f"could not be loaded: {type(exc).__name__}: {exc}")
                continue
            loaded[segment.name] = namespace[segment.name] = value
        for name, why in trailer.left_out.items():
            left_out.setdefault(name, f"not saved: {why}")
    finally:
        os.close(fd)
    if os.path.isdir(trailer.working_dir):
        os.chdir(trailer.working_dir)
    return _report(list(loaded), modules, left_out, trailer.working_dir, size, started)


def put(path: str, offset: int, data: str) -> int:
    """Write a piece of a snapshot (base64) at `offset` of `path` (made new at offset 0); return its size."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if offset == 0 else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.pwrite(fd, base64.b64decode(data), offset)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove `path` if it is there (a piece of a snapshot on its way, left by a failure)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _report(
    names: list[str], modules: dict[str, str], left_out: dict[str, str], cwd: str, size: int, started: float
) -> str:
    return json.dumps(
        {
            "names": names,
            "modules": modules,
            "left_out": left_out,
            "working_dir": cwd,
            "size": size,
            "seconds": time.perf_counter() - started,
        }
    )
