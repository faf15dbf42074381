"""The kernel class of ipybox kernels: ipykernel's own, without its debugger.

ipykernel imports debugpy (and pydevd, about 140 modules) when it makes its kernel, for the
Jupyter debugging protocol. ipybox kernels never serve it (their kernel spec says so), yet every
kernel paid about 8 MB and 0.1 s of its start for it; a spare or pooled kernel that warms
`matplotlib.pyplot` (`ipybox.kernel._warm`) spends the memory on what a first cell uses instead.
The kernel spec names this class (``--IPKernelApp.kernel_class``); debugpy stays importable for
a cell that wants it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from ipykernel.ipkernel import IPythonKernel

__all__ = ["Kernel"]


class Kernel(IPythonKernel):
    """ipykernel's `IPythonKernel`, made without importing debugpy."""

    # ipykernel finds out once whether debugpy imports (its `debugger` module, imported as traitlets
    # sets up the instance and again in `__init__`): while debugpy's entry is None, that fails.
    def __new__(cls, *args: Any, **kwargs: Any) -> Kernel:
        with _without_debugpy():
            kernel: Kernel = super().__new__(cls, *args, **kwargs)
            return kernel

    def __init__(self, **kwargs: Any) -> None:
        with _without_debugpy():
            super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # ipykernel is untyped here


@contextlib.contextmanager
def _without_debugpy() -> Iterator[None]:
    held = "debugpy" not in sys.modules
    if held:
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # None: "import nothing"
    try:
        yield
    finally:
        if held and "debugpy" in sys.modules and sys.modules["debugpy"] is None:
            del sys.modules["debugpy"]
