"""Modules a kernel imports in the background from its start (``IPYBOX_WARM_IMPORTS``), so that
the first cell that needs them finds them loaded: a first plot costs its drawing, not pyplot's
import. The application names them (`CodeExecutor(warm_imports=...)`); a spare or pooled kernel
imports them while it waits to be handed out.

A cell that imports one of them meanwhile waits for that import (Python's per-module import
locks) and then finds it done. A module that is missing or fails to import is left alone: the
cell that imports it gets the error itself.
"""

from __future__ import annotations

import importlib
import threading

__all__ = ["start", "wait"]

_thread: threading.Thread | None = None


def start(names: str) -> None:
    """Import the comma-separated module `names` in a background thread."""
    global _thread
    modules = [name.strip() for name in names.split(",") if name.strip()]
    if modules and _thread is None:
        _thread = threading.Thread(
            target=_import_all, args=(modules,), name="ipybox-warm-imports", daemon=True
        )
        _thread.start()


def wait(timeout: float = 20.0) -> None:
    """Return once the warm imports are done (or after `timeout` seconds)."""
    if _thread is not None:
        _thread.join(timeout)


def _import_all(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # broad: the cell that imports it gets the error itself
            continue
