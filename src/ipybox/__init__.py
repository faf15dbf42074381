"""ipybox: a Python code-execution sandbox for agents that act by writing code.

The public names are imported lazily: generated tool modules import
``ipybox.tool_exec.client`` inside every fresh kernel, and that import must not pay for
the kernel gateway, the MCP SDK or the code generator.

The tree follows the processes: ``app/`` runs in the application (trusted), ``gateway/`` in
the kernel gateway's process and its launchers, ``kernel/`` inside the kernel beside the agent's
code (standard library only), ``mcp_server/`` is the ``ipybox`` command. The public paths
(``ipybox.code_exec``, ``ipybox.kernel_mgr``, ``ipybox.tool_exec``, ``ipybox.mcp_apigen``) are
thin re-exports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipybox.app.apigen import generate_mcp_sources
    from ipybox.app.approval import ApprovalRequest
    from ipybox.app.executor import CodeExecutionChunk, CodeExecutionResult, CodeExecutor, SnapshotReport
    from ipybox.app.pool import KernelPool
    from ipybox.errors import CodeExecutionError

__all__ = [
    "ApprovalRequest",
    "CodeExecutionChunk",
    "CodeExecutionError",
    "CodeExecutionResult",
    "CodeExecutor",
    "KernelPool",
    "SnapshotReport",
    "generate_mcp_sources",
]

_EXPORTS = {
    "ApprovalRequest": "ipybox.app.approval",
    "CodeExecutionChunk": "ipybox.app.executor",
    "CodeExecutionError": "ipybox.errors",
    "CodeExecutionResult": "ipybox.app.executor",
    "CodeExecutor": "ipybox.app.executor",
    "KernelPool": "ipybox.app.pool",
    "SnapshotReport": "ipybox.app.executor",
    "generate_mcp_sources": "ipybox.app.apigen",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # The version has one source, the package metadata (pyproject.toml).
        from importlib.metadata import version

        return version("ipybox")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ipybox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
