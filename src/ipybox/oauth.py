"""OAuth logins of HTTP MCP servers: the application's part of the browser step.

An HTTP server whose ``server_params`` hold ``"oauth": true`` logs in on its first use (or
with ``ipybox auth login NAME``). By default the authorization URL is printed to stderr and a
listener on 127.0.0.1 catches the redirect; an application that shows the URL itself, or
receives the redirect on a callback of its own (``"oauth": {"redirect_uri": ...}``), installs
an `AuthorizationHandler` with `set_authorization_handler`.
"""

from ipybox.app.mcp_client import AuthorizationHandler, set_authorization_handler

__all__ = ["AuthorizationHandler", "set_authorization_handler"]

AuthorizationHandler.__module__ = __name__
set_authorization_handler.__module__ = __name__
