"""The application's client of one kernel: `KernelClient`, `ExecutionResult`.

A public import path; the code lives in ``ipybox.app._kernel_client`` (`ExecutionResult` in
``ipybox.app._kernel_output``).
"""

from ipybox.app._kernel_client import (
    ExecutionError,
    ExecutionResult,
    KernelClient,
)

__all__ = [
    "ExecutionError",
    "ExecutionResult",
    "KernelClient",
]
