"""``python -m ipybox.mcp_server``: the same server as ``python -m ipybox``."""

import os
import sys

# As in ``ipybox/__main__.py``: the working directory (perhaps the workspace) is not a source of imports.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from ipybox.mcp_server._cli import main

main()
