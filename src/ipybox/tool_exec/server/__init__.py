"""The tool server: `ToolServer` runs MCP tools for code in the kernel, after approval.

`ServerRegistry` is the trusted registry of the MCP servers it may run, and `default_registry`
gives this user's. A public import path; the code lives in ``ipybox.app.tools._server`` and
``ipybox.app.mcp_client._registry``.
"""

from ipybox.app.mcp_client import ServerRegistry, default_registry
from ipybox.app.tools import (
    DEFAULT_MAX_INFLIGHT_SIZE,
    DEFAULT_MAX_REQUEST_SIZE,
    DEFAULT_MAX_RESULT_SIZE,
    ToolServer,
)

__all__ = [
    "DEFAULT_MAX_INFLIGHT_SIZE",
    "DEFAULT_MAX_REQUEST_SIZE",
    "DEFAULT_MAX_RESULT_SIZE",
    "ServerRegistry",
    "ToolServer",
    "default_registry",
]
