"""Python API generation for MCP servers: `generate_mcp_sources`.

A public import path; the code lives in ``ipybox.app.apigen._generate``.
"""

from ipybox.app.apigen import (
    generate_mcp_sources,
)

__all__ = [
    "generate_mcp_sources",
]
