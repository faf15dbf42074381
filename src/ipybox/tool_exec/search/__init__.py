"""Tool search for code in a kernel: find the generated tools that fit a need.

``search_tools("create an issue in a repository")`` returns the best matches among the tools
generated in ``mcptools/``, each with its import line and how it is called; it stays importable
in any kernel (standard library only).

A public import path; the code lives in ``ipybox.kernel._search``.
"""

from ipybox.errors import ToolSearchError
from ipybox.kernel._search import ToolMatch, search_tools

__all__ = ["ToolMatch", "ToolSearchError", "search_tools"]
