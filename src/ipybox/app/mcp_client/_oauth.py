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

The store lives in :mod:`ipybox.app.mcp_client._oauth_store`, the browser step and the SDK's provider in
:mod:`ipybox.app.mcp_client._oauth_flow`; this module holds the settings, the connections built on them,
``login`` and ``logout``, and re-exports the names of both. It is never imported inside a kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx2
from mcp.client.auth import OAuthFlowError

from ipybox.app.mcp_client._oauth_flow import AuthorizationHandler, _Provider, set_authorization_handler
from ipybox.app.mcp_client._oauth_store import Login, TokenStore, list_logins, oauth_dir, private_dir
from ipybox.errors import AuthorizationError, ServerParamsError

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

_OAUTH_KEYS = frozenset({"scope", "redirect_uri", "callback_port", "client_metadata_url"})
# How long the browser step may take before the login is given up.
LOGIN_TIMEOUT = 300.0


@dataclass(frozen=True)
class OAuthSettings:
    """The ``"oauth"`` entry of an HTTP server's parameters.

    Attributes:
        scope: The scopes to ask for (space-separated), or ``None`` for the server's choice.
        redirect_uri: The application's own callback URL; ``None`` for a loopback listener.
        callback_port: The loopback listener's port (``0``: a free one, kept with the client's
            registration).
        client_metadata_url: An HTTPS URL of a Client ID Metadata Document to use as the client
            id where the authorization server supports it, instead of registering dynamically.
    """

    scope: str | None = None
    redirect_uri: str | None = None
    callback_port: int = 0
    client_metadata_url: str | None = None


def parse_oauth(value: Any) -> OAuthSettings | None:
    """Validate the ``"oauth"`` entry of HTTP server parameters: ``true``, or a mapping of settings.

    Raises:
        ServerParamsError: The entry has the wrong shape; the message names the allowed keys.
    """
    if value is None or value is False:
        return None
    if value is True:
        return OAuthSettings()
    if not isinstance(value, Mapping):
        raise ServerParamsError(
            f"'oauth' must be true or a mapping with any of {sorted(_OAUTH_KEYS)}, not {value!r}."
        )
    unknown = sorted(set(value) - _OAUTH_KEYS)
    if unknown:
        raise ServerParamsError(
            f"Unexpected 'oauth' setting(s) {unknown}; allowed are {sorted(_OAUTH_KEYS)}."
        )
    for key in ("scope", "redirect_uri", "client_metadata_url"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise ServerParamsError(f"'oauth': {key!r} must be a string, not {value[key]!r}.")
    redirect_uri = value.get("redirect_uri")
    if redirect_uri is not None and not redirect_uri.startswith(("http://", "https://")):
        raise ServerParamsError(
            f"'oauth': 'redirect_uri' must be an http:// or https:// URL, not {redirect_uri!r}."
        )
    port = value.get("callback_port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ServerParamsError(
            f"'oauth': 'callback_port' must be a port number (0 for a free one), not {port!r}."
        )
    return OAuthSettings(
        scope=value.get("scope"),
        redirect_uri=redirect_uri,
        callback_port=port,
        client_metadata_url=value.get("client_metadata_url"),
    )


@dataclass
class OAuthConnection:
    """The OAuth side of one HTTP connection: the ``auth`` to give the HTTP client, and the
    `AuthorizationError` that ended the connection, when one did."""

    auth: httpx2.Auth
    provider: _Provider

    @property
    def failure(self) -> AuthorizationError | None:
        return self.provider.failure

    def explain(self, exc: BaseException) -> AuthorizationError | None:
        """The `AuthorizationError` behind `exc` (a failed connection or call), if it was one."""
        if self.provider.failure is not None:
            return self.provider.failure
        flow = _find(exc, OAuthFlowError)
        if flow is None:
            return None
        return self.provider._fail(
            f"The OAuth authorization for MCP server {self.server_name!r} failed: {flow}. Check the server's URL "
            f"and 'oauth' settings, then run `ipybox auth login {self.server_name}`."
        )

    @property
    def server_name(self) -> str:
        return self.provider.server_name

    def close(self) -> None:
        """Release the loopback callback's port."""
        self.provider.close()


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        if isinstance(current, BaseExceptionGroup):
            stack.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                stack.append(linked)
    return None


def oauth_connection(
    server_name: str,
    url: str,
    settings: OAuthSettings,
    *,
    interactive: bool | None = None,
    login_timeout: float = LOGIN_TIMEOUT,
    on_wait: Callable[[bool], None] | None = None,
) -> OAuthConnection:
    """The OAuth side of one connection to `url`; `OAuthConnection.close` it when the connection ends.

    Args:
        server_name: The server's name.
        url: The server's URL.
        settings: Its ``"oauth"`` settings.
        interactive: Whether the browser step may run; by default only when the server has no
            stored login (a login that needs renewing fails with `AuthorizationError` instead).
        login_timeout: Seconds the browser step may take.
        on_wait: Called with ``True`` when the browser step starts waiting for the person and
            with ``False`` when it ends (a connect deadline pauses meanwhile).

    Raises:
        OSError: The loopback callback's port cannot be used.
    """
    store = TokenStore(server_name, url)
    if interactive is None:
        record = store.read()
        interactive = not record.get("tokens") and not record.get("login_required")
    provider = _Provider(server_name, url, settings, store, interactive, login_timeout)
    provider.on_wait = on_wait
    return OAuthConnection(auth=provider, provider=provider)


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
    from ipybox.app.mcp_client._params import HttpParams, resolve_params
    from ipybox.app.mcp_client._session import MCPSession

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
