"""The pool: `KernelPool`, ready kernels on one gateway for many executors and MCP sessions.

Owns the spare kernels (``_stock``, ``_kernel``), their private folders (``_places``), the checks
of what an executor asks of a pool (``_settings``), how many sessions memory allows
(``_capacity``), and `PooledKernels`, an executor's kernel source backed by a pool.

May import (within ``ipybox.app``): ``kernels``, ``approval``, ``mcp_client``, ``sandbox``,
``_settings``.
"""

from ipybox.app.pool._capacity import max_sessions_for_memory
from ipybox.app.pool._pool import KernelPool
from ipybox.app.pool._pooled_kernels import PooledKernels

__all__ = [
    "KernelPool",
    "PooledKernels",
    "max_sessions_for_memory",
]
