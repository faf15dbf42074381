"""What code in a kernel calls to run MCP tools: `ToolRunner`, `run_tool` and the others.

Generated modules in ``mcptools/`` import this path; it stays importable in any kernel
(standard library only).

A public import path; the code lives in ``ipybox.kernel._tool_client``.
"""

from ipybox.kernel._tool_client import (
    ToolContent,
    ToolRunner,
    ToolRunnerError,
    arun_tool,
    arun_tool_content,
    request_approval,
    run_shell,
    run_tool,
    run_tool_content,
)

__all__ = [
    "ToolContent",
    "ToolRunner",
    "ToolRunnerError",
    "arun_tool",
    "arun_tool_content",
    "request_approval",
    "run_shell",
    "run_tool",
    "run_tool_content",
]
