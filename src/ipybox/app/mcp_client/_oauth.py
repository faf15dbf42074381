"""OAuth logins for HTTP MCP servers (application side only).

A server whose parameters hold ``"oauth"`` is reached through the MCP SDK's
``OAuthClientProvider`` (discovery, client registration, PKCE, refresh); this module adds what
ipybox needs around it:

- `TokenStore`: the SDK's ``TokenStorage`` over one JSON file per server in the user's state
  directory (`oauth_dir`, mode ``0700``; files ``0600``, written atomically). The sandbox's
  settings always deny the folder (`ipybox.app.sandbox.sandbox_settings`); nothing here hands a
  token to a kernel, a generated module, a log line or an error message.
- The browser step: the authorization URL goes to the application's `AuthorizationHandler`
  (`set_authorization_handler`), else to stderr, and a one-shot listener on the loopback
  interface catches the redirect (RFC 8252), refusing a callback whose ``state`` is not the one
  sent. An application with a callback of its own gives ``redirect_uri`` and returns the URL
  its callback received.
- Tokens are refreshed before they expire (the expiry and what discovery found are stored with
  them, which the SDK alone keeps only in memory), and when the server refuses one early, the
  refused request (which did not run) is sent once more with the refreshed token.
- A login that was revoked, or expired beyond refresh, is never renewed behind the user's back:
  the call fails with one `AuthorizationError` naming ``ipybox auth login NAME``, and the stored
  record says so until that command (or ``ipybox auth logout NAME``) runs. Only a server with no
  login at all gets the browser step on its first connection.

The store lives in :mod:`ipybox.app.mcp_client._oauth_store`, the settings in
:mod:`ipybox.app.mcp_client._oauth_settings`, the browser step, the SDK's provider and the
connections built on them in :mod:`ipybox.app.mcp_client._oauth_flow`; this module holds ``login``
and ``logout`` (which open a session) and re-exports the names of the others. It is never imported
inside a kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ipybox.app._state import oauth_dir, private_dir
from ipybox.app.mcp_client._oauth_flow import (
    AuthorizationHandler,
    OAuthConnection,
    oauth_connection,
    set_authorization_handler,
)
from ipybox.app.mcp_client._oauth_settings import OAuthSettings, parse_oauth
from ipybox.app.mcp_client._oauth_store import Login, TokenStore, list_logins
from ipybox.app.mcp_client._params import HttpParams, resolve_params
from ipybox.app.mcp_client._session import MCPSession
from ipybox.errors import ServerParamsError

__all__ = [
    "AuthorizationHandler",
    "Login",
    "OAuthConnection",
    "OAuthSettings",
    "TokenStore",
    "list_logins",
    "login",
    "logout",
    "oauth_connection",
    "oauth_dir",
    "parse_oauth",
    "private_dir",
    "set_authorization_handler",
]

logger = logging.getLogger("ipybox.oauth")


async def login(server_name: str, params: Mapping[str, Any], connect_timeout: float = 30) -> int:
    """Log in to an OAuth-protected HTTP server now: drop its tokens and run the browser step.

    Args:
        server_name: The server's name.
        params: Its parameters (``${VAR}`` placeholders included); they must hold ``"oauth"``.
        connect_timeout: Seconds the server has to answer (the browser step has its own limit).

    Returns:
        How many tools the server offers with the new login.

    Raises:
        ServerParamsError: The parameters are not those of an HTTP server with ``"oauth"``.
        AuthorizationError: The login failed; the message says why.
        MCPServerError: The server could not be reached.
    """
    resolved = resolve_params(params)
    if not isinstance(resolved, HttpParams) or resolved.oauth is None:
        raise ServerParamsError(
            f"MCP server {server_name!r} does not use OAuth: its parameters need a 'url' and \"oauth\": true."
        )
    TokenStore(server_name, resolved.url).clear_tokens()
    session = MCPSession(server_name, resolved, connect_timeout)
    await session.start()
    try:
        return len(await session.list_tools())
    finally:
        await session.close()


def logout(server_name: str) -> bool:
    """Forget the stored login of a server (tokens and client registration); whether there was one.

    The authorization server is not told: revoke the grant there too if it must end at once.
    """
    for login_ in list_logins():
        if login_.server_name == server_name:
            return TokenStore(server_name, login_.url).delete()
    return False
