"""The application's client of one kernel: `KernelClient`, `ExecutionResult`.

A public import path; the code lives in ``ipybox.app.kernels._client`` (`ExecutionResult` in
``ipybox.app.kernels._output``).
"""

from ipybox.app.kernels import (
    ExecutionError,
    ExecutionResult,
    KernelClient,
)

__all__ = [
    "ExecutionError",
    "ExecutionResult",
    "KernelClient",
]
