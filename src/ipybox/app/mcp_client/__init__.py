"""MCP clients: sessions with the MCP servers the application registered, and how they are found.

Owns the trusted registry of servers (``_registry``), their parameters (``_params``), one MCP
session per server over stdio, streamable HTTP or SSE (``_session``, ``_stdio``, ``_transport``,
``_errors``) and OAuth logins for HTTP servers (``_oauth``, ``_oauth_flow``, ``_oauth_settings``,
``_oauth_store``).

May import (within ``ipybox.app``): ``sandbox``, ``_state``.
"""

from ipybox.app.mcp_client._oauth import (
    AuthorizationHandler,
    list_logins,
    login,
    logout,
    set_authorization_handler,
)
from ipybox.app.mcp_client._params import HttpParams, StdioParams, confine, resolve_params
from ipybox.app.mcp_client._registry import ServerRegistry, default_registry, default_registry_path
from ipybox.app.mcp_client._session import MCPSession, list_tools

__all__ = [
    "AuthorizationHandler",
    "HttpParams",
    "MCPSession",
    "ServerRegistry",
    "StdioParams",
    "confine",
    "default_registry",
    "default_registry_path",
    "list_logins",
    "list_tools",
    "login",
    "logout",
    "resolve_params",
    "set_authorization_handler",
]
