"""API generation: typed Python modules from an MCP server's tools, and their search index.

Owns `generate_mcp_sources` (``_generate``), the schema compiler (``_codegen/``) and the index
that the kernel's ``search_tools`` reads (``_search_index``, ``_embedding``).

May import (within ``ipybox.app``): ``mcp_client``, ``sandbox``.
"""

from ipybox.app.apigen._generate import generate_mcp_sources, kernel_writable_warning

__all__ = [
    "generate_mcp_sources",
    "kernel_writable_warning",
]
