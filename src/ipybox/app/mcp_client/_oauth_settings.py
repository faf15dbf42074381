"""The ``"oauth"`` entry of an HTTP MCP server's parameters, checked: `OAuthSettings`, `parse_oauth`.

A leaf of the OAuth modules: the parameters (``_params``) and the browser step (``_oauth_flow``)
both read it, and it imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ipybox.errors import ServerParamsError

__all__ = ["OAuthSettings", "parse_oauth"]

_OAUTH_KEYS = frozenset({"scope", "redirect_uri", "callback_port", "client_metadata_url"})


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
