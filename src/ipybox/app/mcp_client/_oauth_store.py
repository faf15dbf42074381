"""The stored OAuth logins: one owner-only JSON file per server, and the SDK's ``TokenStorage`` over it.

Application side only, never imported inside a kernel. `TokenStore` keeps a server's tokens,
client registration, what discovery found and whether the login must be renewed by hand, in
`oauth_dir` (``0700``; files ``0600``, written atomically under a lock); `list_logins` lists
them for ``ipybox auth``. :mod:`ipybox.app.mcp_client._oauth` re-exports these names.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp.client.auth.oauth2 import OAuthContext
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

from ipybox.app._state import oauth_dir, private_dir

# A token is refreshed once less than this much of its life is left (at most half its life).
_REFRESH_MARGIN = 60.0


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise read-modify-write of the stored logins across processes."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Login:
    """What ``ipybox auth list`` shows of a stored login (never a token).

    Attributes:
        server_name: The server's name.
        url: The server's URL the login is for.
        state: ``"active"``, ``"login required"`` (revoked or expired beyond refresh) or
            ``"registered"`` (a client registration but no tokens).
        expires_at: When the access token expires (seconds since the epoch), if known.
        refreshable: Whether a refresh token is held.
    """

    server_name: str
    url: str
    state: str
    expires_at: float | None
    refreshable: bool


class TokenStore:
    """The SDK's ``TokenStorage`` for one server: a JSON file in `oauth_dir`, owner-only.

    The record names the server's URL; tokens and client registration are given only to a
    connection to that URL (a server registered again under the same name at another URL gets
    none of them).

    Args:
        server_name: The server's name.
        url: The server's URL.
        folder: The folder of the stored logins; by default `oauth_dir`.
    """

    def __init__(self, server_name: str, url: str, folder: Path | None = None) -> None:
        self.server_name = server_name
        self.url = url
        self.folder = folder if folder is not None else oauth_dir()
        digest = hashlib.sha256(server_name.encode()).hexdigest()[:32]
        self.path = self.folder / f"{digest}.json"

    def read(self) -> dict[str, Any]:
        """The record for this server and URL (empty when there is none)."""
        try:
            record = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        if not isinstance(record, dict) or record.get("url") != self.url:
            return {}
        return record

    def _update(self, **changes: Any) -> None:
        folder = private_dir(self.folder)
        with _locked(folder):
            record = self.read() or {"server_name": self.server_name, "url": self.url}
            record.update(changes)
            _write_private(self.path, json.dumps(record, indent=1))

    @property
    def login_required(self) -> bool:
        """Whether the login was revoked or expired beyond refresh (``ipybox auth login`` renews it)."""
        return bool(self.read().get("login_required"))

    @property
    def refresh_due(self) -> float | None:
        """When the stored access token should be refreshed (seconds since the epoch), if known."""
        return self.read().get("refresh_due")

    async def get_tokens(self) -> OAuthToken | None:
        tokens = self.read().get("tokens")
        return OAuthToken.model_validate(tokens) if tokens else None

    async def set_tokens(self, tokens: OAuthToken) -> None:
        expires_at = refresh_due = None
        if tokens.expires_in is not None:
            now = time.time()
            expires_at = now + tokens.expires_in
            refresh_due = expires_at - min(_REFRESH_MARGIN, tokens.expires_in / 2)
        self._update(
            tokens=tokens.model_dump(mode="json", exclude_none=True),
            expires_at=expires_at,
            refresh_due=refresh_due,
            login_required=False,
        )

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        info = self.read().get("client_info")
        return OAuthClientInformationFull.model_validate(info) if info else None

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self._update(client_info=client_info.model_dump(mode="json", exclude_none=True))

    def set_discovered(self, context: OAuthContext) -> None:
        """Keep what discovery found (authorization server and resource metadata) with the login."""
        self._update(
            discovered={
                "oauth_metadata": _dump(context.oauth_metadata),
                "resource_metadata": _dump(context.protected_resource_metadata),
                "auth_server_url": context.auth_server_url,
            }
        )

    def require_login(self) -> None:
        """Drop the tokens and mark the login as needing ``ipybox auth login``."""
        self._update(tokens=None, expires_at=None, refresh_due=None, login_required=True)

    def clear_tokens(self) -> None:
        """Drop the tokens (keeping the client's registration) so the next connection logs in anew."""
        self._update(tokens=None, expires_at=None, refresh_due=None, login_required=False)

    def delete(self) -> bool:
        """Remove the record; whether there was one."""
        if not self.folder.is_dir():
            return False
        with _locked(self.folder):
            try:
                self.path.unlink()
            except FileNotFoundError:
                return False
        return True


def _dump(model: Any) -> Any:
    return model.model_dump(mode="json", exclude_none=True) if model is not None else None


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, mode ``0600`` from the start."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def list_logins(folder: Path | None = None) -> list[Login]:
    """Every stored login, by server name."""
    folder = folder if folder is not None else oauth_dir()
    logins = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("server_name"), str):
            continue
        tokens = record.get("tokens") or {}
        state = "login required" if record.get("login_required") else "active" if tokens else "registered"
        logins.append(
            Login(
                server_name=record["server_name"],
                url=str(record.get("url", "")),
                state=state,
                expires_at=record.get("expires_at"),
                refreshable=bool(tokens.get("refresh_token")),
            )
        )
    return sorted(logins, key=lambda login: login.server_name)
