"""ipybox: a Python code-execution sandbox for agents that act by writing code.

The public names are imported lazily: generated tool modules import
``ipybox.tool_exec.client`` inside every fresh kernel, and that import must not pay for
the kernel gateway, the MCP SDK or the code generator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipybox.code_exec import CodeExecutionChunk, CodeExecutionResult, CodeExecutor
    from ipybox.errors import CodeExecutionError
    from ipybox.mcp_apigen import generate_mcp_sources
    from ipybox.tool_exec.approval.client import ApprovalRequest

__all__ = [
    "ApprovalRequest",
    "CodeExecutionChunk",
    "CodeExecutionError",
    "CodeExecutionResult",
    "CodeExecutor",
    "generate_mcp_sources",
]

_EXPORTS = {
    "ApprovalRequest": "ipybox.tool_exec.approval.client",
    "CodeExecutionChunk": "ipybox.code_exec",
    "CodeExecutionError": "ipybox.errors",
    "CodeExecutionResult": "ipybox.code_exec",
    "CodeExecutor": "ipybox.code_exec",
    "generate_mcp_sources": "ipybox.mcp_apigen",
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
