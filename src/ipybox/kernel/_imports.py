"""Making files written since the kernel started importable, without calling the kernel's own hooks.

Run by cells the application sends on its own (after ``register_mcp_server``, ``install_package``
and an upload to a remote kernel). ``importlib.invalidate_caches()`` would call every finder on
``sys.meta_path`` and in ``sys.path_importer_cache``, which code in the kernel can put there: only
the standard path finders' caches are cleared here, by their own class's method. (Code in the kernel
can still change anything it imports; what keeps a hidden cell from doing its work for it is that
no tool call made during one is approved, on the application's side.)
"""

from __future__ import annotations

import sys
from importlib.machinery import FileFinder

__all__ = ["refresh"]


def refresh(prefix: str = "") -> None:
    """Clear the path finders' caches, and forget the modules of package `prefix` (if given)."""
    for path, finder in list(sys.path_importer_cache.items()):
        if finder is None:
            # A folder that did not exist when it was first looked in (an install's target).
            del sys.path_importer_cache[path]
        elif type(finder) is FileFinder:
            FileFinder.invalidate_caches(finder)
    if prefix:
        for name in [
            m for m in list(sys.modules) if type(m) is str and (m == prefix or m.startswith(prefix + "."))
        ]:
            del sys.modules[name]
