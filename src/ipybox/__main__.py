"""``python -m ipybox``: the ipybox MCP server (the ``ipybox`` command)."""

import os
import sys

# `python -m` puts the current directory first on sys.path; when that is the workspace, kernel
# code could plant a module there that this trusted process would import later.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from ipybox.mcp_server._cli import main

main()
