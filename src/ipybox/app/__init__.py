"""Code that runs in the application's process: the trusted side.

It holds the secrets, the trusted server registry, the approval decisions and the MCP sessions.
One subpackage per subsystem, each with a face (``__init__.py`` and ``__all__``) that says what it
owns and which subsystems it may import; nothing outside a subsystem reaches past its face. From
the highest to the lowest (an import only ever points down this list):

- ``executor/``: `CodeExecutor`, the one composition root: cells, results, snapshots, oversight.
- ``pool/``: `KernelPool`, ready kernels on one gateway for many executors and MCP sessions.
- ``tools/``: the tool server: tool calls and shell commands from the kernel, the stdin channel.
- ``kernels/``: the gateway process, the kernel client and the local and remote kernel sources.
- ``apigen/``: Python sources from an MCP server's tools, and their search index.
- ``approval/``: the policy, the gate, the approval channel's two ends and the audit trail.
- ``mcp_client/``: MCP sessions, the trusted registry, server parameters and OAuth logins.
- ``sandbox/``: srt and its settings, confined file access in the workspace, the shell runner.
- shared leaves: ``_settings`` (`ExecutorSettings`), ``_tracing`` (OpenTelemetry, opt-in) and
  ``_state`` (the user's state folder).

Every module is private; the public names are re-exported by ``ipybox`` and by the public paths
the API reference names (``ipybox.code_exec``, ``ipybox.kernel_mgr.*``, ``ipybox.tool_exec.*``,
``ipybox.mcp_apigen``). ``tests/test_layout.py`` holds the order, the faces and the absence of
cycles; ``docs/architecture-subsystems.md`` draws the map for contributors.
"""
