"""The kernel gateway manager: `KernelGateway` starts and stops a Jupyter Kernel Gateway.

A public import path; the code lives in ``ipybox.app.kernels._gateway``.
"""

from ipybox.app.kernels import (
    KernelGateway,
)

__all__ = [
    "KernelGateway",
]
