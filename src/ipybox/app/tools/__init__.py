"""Tools: the tool server that runs the kernel's tool calls and shell commands.

Owns the ASGI tool server (``_server``), composed of parts that receive what they need in their
constructors: ``_calls`` (tool calls), ``_sessions`` (the MCP servers' sessions), ``_shell_routes``
(approved shell commands), ``_http`` (its bounded HTTP and WebSocket protocol, request bodies) and
``_options`` (its option objects, `Limits` and `Access`); and the stdin channel a remote kernel's
calls travel over (``_stdin_channel``). Every call is decided by ``approval``'s decision chain, and
runs only with the permit the chain gives.

May import (within ``ipybox.app``): ``approval``, ``mcp_client``, ``sandbox``, ``_settings``.
"""

from ipybox.app.tools._server import (
    DEFAULT_MAX_INFLIGHT_SIZE,
    DEFAULT_MAX_REQUEST_SIZE,
    DEFAULT_MAX_RESULT_SIZE,
    Access,
    Limits,
    ToolServer,
)
from ipybox.app.tools._stdin_channel import StdinToolCalls

__all__ = [
    "DEFAULT_MAX_INFLIGHT_SIZE",
    "DEFAULT_MAX_REQUEST_SIZE",
    "DEFAULT_MAX_RESULT_SIZE",
    "Access",
    "Limits",
    "StdinToolCalls",
    "ToolServer",
]
