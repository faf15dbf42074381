"""Public paths of tool execution: MCP tool calls leave the kernel and run on a tool server after approval.

- ``ipybox.tool_exec.server.ToolServer``: the HTTP server that runs MCP tools (``ipybox.app``).
- ``ipybox.tool_exec.client.ToolRunner`` / ``run_tool``: what code in a kernel calls
  (``ipybox.kernel``: standard library only, so it imports cheaply).
- ``ipybox.tool_exec.content``: the typed content of a tool result (``ipybox.kernel``).
- ``ipybox.tool_exec.search.search_tools``: finds generated tools that fit a need (``ipybox.kernel``).
- ``ipybox.tool_exec.approval``: the approval channel and client (``ipybox.app``).

Nothing is imported here, so that importing the kernel-side client stays cheap.
"""
