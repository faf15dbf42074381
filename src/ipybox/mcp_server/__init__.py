"""ipybox as an MCP server: the ``ipybox`` command (also ``python -m ipybox.mcp_server``).

A thin layer on `ipybox.CodeExecutor`: each MCP session gets one executor (one kernel)
whose working directory is the workspace, and tools to run code in it
(``execute_ipython_cell``), to generate Python APIs for MCP servers
(``register_mcp_server``), to install packages (``install_package``), to reset the kernel
(``reset``) and to move files in and out of the workspace (``upload_file``,
``download_file``). Run ``ipybox --help`` for the options.
"""

from __future__ import annotations

from ipybox.mcp_server._cli import main

__all__ = ["main"]
