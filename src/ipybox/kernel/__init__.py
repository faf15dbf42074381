"""Code that runs inside the kernel's process, beside the agent's (hostile) code.

STANDARD LIBRARY ONLY (a test enforces it): every fresh kernel imports these modules, and
nothing here may hold a secret or trust what the kernel's code can change. Every module is
private; the public paths are ``ipybox.tool_exec.client``, ``ipybox.tool_exec.content`` and
``ipybox.tool_exec.search``.

- ``_tool_client``: what generated tool modules call; sends tool calls to the tool server.
- ``_calls``: the tool client's protocol core, without I/O (requests, the steps of a call, answers).
- ``_http``: the HTTP/1.1 response reader the core uses, with a cap on every part.
- ``_io``: the tool client's sync and async shells, which only move bytes.
- ``_stdin``: tool calls over the kernel's own stdin channel instead (remote kernels), batched.
- ``_content``: the typed content of a tool result.
- ``_ext``: the IPython extension every kernel loads (``!cmd``, approval, import paths).
- ``_search``: tool search over the generated ``mcptools/`` (the query side).
- ``_exec_wall``: the seccomp filter that stops a walled kernel from starting programs.
- ``_with_gateway``: an unsandboxed kernel's launcher, which ends the kernel with its gateway.
- ``_imports``: the refresh the application's own cells run, which calls no hook of the kernel's.
"""
