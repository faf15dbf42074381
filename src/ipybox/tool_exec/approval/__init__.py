"""Public paths of tool call approval over a WebSocket between the tool server and the application.

- ``ipybox.tool_exec.approval.server.ApprovalChannel``: the tool server's side.
- ``ipybox.tool_exec.approval.client.ApprovalClient`` / ``ApprovalRequest``: the application's side.

The code lives in ``ipybox.app``; these modules re-export it.
"""
