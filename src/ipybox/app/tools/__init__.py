"""Tools: the tool server that runs the kernel's tool calls and shell commands.

Owns the ASGI tool server (``_server``) and its routes (``_calls``: tool calls, ``_shell_routes``:
approved shell commands), its bounded HTTP and WebSocket protocol (``_http``), and the stdin
channel a remote kernel's calls travel over (``_stdin_channel``).

May import (within ``ipybox.app``): ``approval``, ``mcp_client``, ``sandbox``, ``_settings``,
``_tracing``.
"""

from ipybox.app.tools._server import (
    DEFAULT_MAX_INFLIGHT_SIZE,
    DEFAULT_MAX_REQUEST_SIZE,
    DEFAULT_MAX_RESULT_SIZE,
    ToolServer,
)
from ipybox.app.tools._stdin_channel import StdinToolCalls

__all__ = [
    "DEFAULT_MAX_INFLIGHT_SIZE",
    "DEFAULT_MAX_REQUEST_SIZE",
    "DEFAULT_MAX_RESULT_SIZE",
    "StdinToolCalls",
    "ToolServer",
]
