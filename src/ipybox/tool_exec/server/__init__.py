"""The tool server: `ToolServer` runs MCP tools for code in the kernel, after approval.

A public import path; the code lives in ``ipybox.app._tool_server``.
"""

from ipybox.app._tool_server import (
    DEFAULT_MAX_INFLIGHT_SIZE,
    DEFAULT_MAX_REQUEST_SIZE,
    DEFAULT_MAX_RESULT_SIZE,
    ToolServer,
)

__all__ = [
    "DEFAULT_MAX_INFLIGHT_SIZE",
    "DEFAULT_MAX_REQUEST_SIZE",
    "DEFAULT_MAX_RESULT_SIZE",
    "ToolServer",
]
