"""Saving and loading the kernel's namespace: the only place a snapshot's pickles are made or read.

Runs in the kernel (untrusted), standard library only. The application calls these functions from
silent cells (`ipybox.app.executor._snapshot`) and reads back a JSON report; it checks the file's frame
(`ipybox.kernel._snapshot_format`) but never unpickles it. Loading a snapshot therefore runs in the
kernel whatever the snapshot's pickles do, with the kernel's rights (sandboxed when it is): no more
than a cell could do.

Each name gets its own pickle, so that a load that fails for one name keeps the others. A value
that is the value of an earlier name as well is written as a reference to that name (the two
names are the same object again after a load). Functions and classes defined in cells are pickled
by value with ``cloudpickle`` when the kernel's Python has it (ipybox depends on it); without it,
the standard ``pickle`` writes them by reference, and they are left out.

Not ``dill.dump_module``: it pickles ``__main__`` as one object, so that one value it cannot pickle
(in a kernel, ``sys.stdout`` is an output stream on a ZMQ socket, and IPython's own objects sit in
the namespace) fails the whole save, and one that cannot be loaded fails the whole load.
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
    Segment,
    SnapshotFormatError,
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
        (
            types.GeneratorType,
            types.CoroutineType,
            types.AsyncGeneratorType,
            types.FrameType,
            types.TracebackType,
        ),
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


def _module_name(value: types.ModuleType) -> str | None:
    name = getattr(value, "__name__", None)
    return name if isinstance(name, str) and sys.modules.get(name) is value else None


def _defined_in_a_cell(value: Any) -> bool:
    """A function or class of the kernel's own namespace, which the standard pickle writes by name only."""
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__"


class _Writer:
    """One snapshot being written: a pickle per name, then the trailer."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        base, self.pickler_name = _pickler()
        refs: dict[int, str] = {}
        self.refs = refs

        class Pickler(base):  # type: ignore[valid-type,misc]  # a class chosen at run time
            def persistent_id(self, obj: Any) -> str | None:
                return refs.get(id(obj))

        self.pickler = Pickler
        self.fd, self.max_bytes = fd, max_bytes
        self.limit = max_bytes - MAX_TRAILER_BYTES - TAIL_BYTES
        self.offset = len(MAGIC)
        self.segments: list[Segment] = []
        self.modules: dict[str, str] = {}
        self.left_out: dict[str, str] = {}
        os.pwrite(fd, MAGIC, 0)

    def add(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType):
            if (module_name := _module_name(value)) is not None:
                self.modules[name] = module_name
            else:
                self.left_out[name] = "a module that cannot be imported again by its name"
            return
        kind = next((text for kinds, text in _KINDS if isinstance(value, kinds)), None)
        if kind is None and self.pickler_name == "pickle" and _defined_in_a_cell(value):
            kind = "defined in a cell: saving it needs cloudpickle, which the kernel's Python lacks"
        if kind is not None:
            self.left_out[name] = kind
            return
        out = _Segment(self.fd, self.offset, self.limit)
        try:
            self.pickler(out, protocol=5).dump(value)
        except _TooLarge:
            self.left_out[name] = (
                f"too large: the snapshot would pass its cap of {self.max_bytes} bytes (less room for its "
                "table of names)"
            )
        except Exception as exc:  # broad: whatever stops one value's pickle leaves that name out
            self.left_out[name] = reason(f"cannot be pickled: {type(exc).__name__}: {exc}")
        else:
            self.segments.append(Segment(name, self.offset, out.offset - self.offset, out.hash.hexdigest()))
            self.offset = out.offset
            if not isinstance(value, _NOT_REFERENCED):
                self.refs[id(value)] = name
            return
        os.ftruncate(self.fd, self.offset)

    def finish(self) -> Trailer:
        trailer = Trailer(
            python=_python(),
            implementation=platform.python_implementation(),
            pickler=self.pickler_name,
            working_dir=os.getcwd(),
            segments=tuple(self.segments),
            modules=self.modules,
            left_out=self.left_out,
        )
        os.pwrite(self.fd, encode_trailer(trailer), self.offset)
        return trailer


def save(path: str, max_bytes: int) -> str:
    """Write the namespace to the new file `path`; return the report (JSON).

    Raises:
        FileExistsError: If `path` exists.
    """
    started = time.perf_counter()
    ip = _shell()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        writer = _Writer(fd, max_bytes)
        for name in _user_names(ip):
            writer.add(name, ip.user_ns[name])
        trailer = writer.finish()
        size = os.fstat(fd).st_size
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    names = [segment.name for segment in trailer.segments]
    return _report(names, trailer.modules, trailer.left_out, trailer.working_dir, size, started)


def _trailer(fd: int, path: str) -> Trailer:
    """The checked trailer of the snapshot `fd`, written by this kernel's Python.

    Raises:
        ValueError: If it is not a whole snapshot, or another Python wrote it.
    """
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
    return trailer


def _import_modules(trailer: Trailer, namespace: dict[str, Any], left_out: dict[str, str]) -> dict[str, str]:
    modules: dict[str, str] = {}
    for alias, module_name in trailer.modules.items():
        try:
            namespace[alias] = importlib.import_module(module_name)
            modules[alias] = module_name
        except Exception as exc:  # broad: a module that fails to import is reported, the rest load
            left_out[alias] = reason(
                f"module {module_name} could not be imported: {type(exc).__name__}: {exc}"
            )
    return modules


def _load_values(fd: int, trailer: Trailer, namespace: dict[str, Any], left_out: dict[str, str]) -> list[str]:
    loaded: dict[str, Any] = {}

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            if pid not in loaded:
                raise _Missing(pid)
            return loaded[pid]

    # Read from the file itself: large buffers (numpy arrays) go straight from it into their objects.
    with open(fd, "rb", closefd=False) as stream:
        for segment in trailer.segments:
            # The application checked each pickle's SHA-256 on the way in; a change since is the kernel's own.
            stream.seek(segment.offset)
            try:
                value = Unpickler(stream).load()
            except _Missing as exc:
                left_out[segment.name] = f"it refers to {exc.args[0]}, which did not load"
                continue
            except Exception as exc:  # broad: one name that fails to load is reported, the rest load
                left_out[segment.name] = reason(f"could not be loaded: {type(exc).__name__}: {exc}")
                continue
            loaded[segment.name] = namespace[segment.name] = value
    return list(loaded)


def load(path: str, remove: bool = True, chdir: bool = True) -> str:
    """Load the snapshot file `path` into the namespace (and remove the file); return the report (JSON).

    With `chdir`, the kernel goes back to the saved working directory if it exists (not when the
    executor keeps the kernel in a working directory of its own).

    Raises:
        ValueError: If the file is not a whole snapshot, or was written by another Python.
    """
    started = time.perf_counter()
    namespace = _shell().user_ns
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if remove:
            os.unlink(path)
        size = os.fstat(fd).st_size
        trailer = _trailer(fd, path)
        left_out: dict[str, str] = {}
        modules = _import_modules(trailer, namespace, left_out)
        names = _load_values(fd, trailer, namespace, left_out)
    finally:
        os.close(fd)
    for name, why in trailer.left_out.items():
        left_out.setdefault(name, f"not saved: {why}")
    if chdir and os.path.isdir(trailer.working_dir):
        os.chdir(trailer.working_dir)
    return _report(names, modules, left_out, trailer.working_dir, size, started)


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
