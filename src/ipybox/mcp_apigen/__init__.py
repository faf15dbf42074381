"""Python API generation for MCP servers: `generate_mcp_sources`.

A public import path; the code lives in ``ipybox.app._apigen``.
"""

from ipybox.app._apigen import (
    generate_mcp_sources,
)

__all__ = [
    "generate_mcp_sources",
]
