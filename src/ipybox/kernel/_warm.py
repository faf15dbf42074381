"""Modules a kernel imports in the background while it is idle (``IPYBOX_WARM_IMPORTS``), so that
the first cell that needs them finds them loaded: a first plot costs its drawing, not pyplot's
import. The application names them (`CodeExecutor(warm_imports=...)`).

The imports start once the kernel is in use and has run no cell for `_QUIET` seconds, so that they
neither slow the cells of a busy kernel nor cost a kernel that lives only for a few quick cells. A
kernel is in use once the application takes it (`arm`, the hidden cell an executor runs in each
kernel it takes, at start and at every reset) or once a cell of its own has run; a spare kernel
waiting to be handed out stays without them (about 34 MB for pyplot), a pool's kernel imports them
before it counts as ready (`wait`). A cell that imports one of them meanwhile waits for that import
(Python's per-module import locks) and then finds it whole. A module that is missing or fails to
import is left alone: the cell that imports it gets the error itself.
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any

__all__ = ["arm", "start", "wait"]

# Seconds without a cell before the imports start.
_QUIET = 0.5
_thread: threading.Thread | None = None
_now = threading.Event()
_armed = threading.Event()
_lock = threading.Lock()
_running = 0
_last = time.monotonic()


def start(names: str, ip: Any) -> None:
    """Import the comma-separated module `names` in a background thread once the kernel is in use and idle."""
    global _thread
    modules = [name.strip() for name in names.split(",") if name.strip()]
    if not modules or _thread is not None:
        return
    ip.events.register("pre_execute", _busy)
    ip.events.register("post_execute", _idle)
    _thread = threading.Thread(target=_import_all, args=(modules,), name="ipybox-warm-imports", daemon=True)
    _thread.start()


def arm() -> None:
    """The application has taken this kernel into use: import once it is idle."""
    _armed.set()


def wait(timeout: float = 20.0) -> None:
    """Import now, whether the kernel is idle or not, and return once done (or after `timeout` s)."""
    _armed.set()
    _now.set()
    if _thread is not None:
        _thread.join(timeout)


def _busy() -> None:
    global _running
    with _lock:
        _running += 1


def _idle() -> None:
    global _running, _last
    with _lock:
        _running = max(0, _running - 1)
        _last = time.monotonic()
    _armed.set()


def _until_quiet() -> None:
    _armed.wait()
    while not _now.is_set():
        with _lock:
            left = 0.1 if _running else _QUIET - (time.monotonic() - _last)
        if left <= 0:
            return
        _now.wait(left)


def _import_all(modules: list[str]) -> None:
    _until_quiet()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # broad: the cell that imports it gets the error itself
            continue
