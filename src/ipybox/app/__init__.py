"""Code that runs in the application's process: the trusted side.

It holds the secrets, the trusted server registry, the approval decisions and the MCP
sessions. Every module is private; the public names are re-exported by ``ipybox`` and by the
public paths the API reference names (``ipybox.code_exec``, ``ipybox.kernel_mgr.*``,
``ipybox.tool_exec.server``, ``ipybox.tool_exec.approval.*``, ``ipybox.mcp_apigen``).

- ``_executor``: `CodeExecutor`, which composes the parts below; ``_executor_cells`` runs its cells.
- ``_gateway``: starts and stops the kernel gateway process (``_gateway_process``: the process
  itself); ``_sandbox``: its srt settings.
- ``_kernel_client``: talks to one kernel through the gateway (REST and WebSocket); its kernels
  come from ``_kernel_supply`` (opened by ``_kernel_open``, their stdin answered by ``_kernel_stdin``).
- ``_pool``: `KernelPool`, ready kernels for many executors on one gateway (``_pool_*``,
  ``_pooled_kernels``: its parts).
- ``_tool_server``: runs tool calls from the kernel; ``_registry`` (trusted servers),
  ``_params`` (their parameters), ``_mcp`` (MCP sessions), ``_oauth`` (OAuth logins of HTTP
  servers), ``_shell`` (``!cmd`` of a walled kernel).
- ``_approval_server`` / ``_approval_client``: the approval channel's two ends.
- ``_apigen`` and ``_codegen``: Python sources from an MCP server's tools.
- ``_confined``: every trusted file access inside the workspace.
"""
