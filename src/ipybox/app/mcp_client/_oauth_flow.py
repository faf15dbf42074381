"""The OAuth browser step and the MCP SDK's ``OAuthClientProvider`` that ipybox runs it with.

Application side only, never imported inside a kernel. The application's `AuthorizationHandler`
(`set_authorization_handler`, else the URL goes to stderr), the one-shot loopback listener that
catches the redirect, and `_Provider`: the SDK's provider over a `TokenStore`, refreshing early
and running the browser step only when allowed; `oauth_connection`, the OAuth side of one HTTP
connection built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

import httpx2
from mcp.client.auth import OAuthClientProvider, OAuthFlowError
from mcp.client.auth.oauth2 import OAuthContext
from mcp.shared.auth import (
    AuthorizationCodeResult,
    OAuthClientMetadata,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)

from ipybox._infra import listen
from ipybox.app.mcp_client._oauth_settings import OAuthSettings
from ipybox.app.mcp_client._oauth_store import _REFRESH_MARGIN, TokenStore
from ipybox.errors import AuthorizationError

# How long the browser step may take before the login is given up.
LOGIN_TIMEOUT = 300.0

_CALLBACK_PATH = "/callback"


_MAX_CALLBACK_REQUEST = 16 * 1024


class AuthorizationHandler(Protocol):
    """The application's part of the browser step.

    Called with the server's name and the URL the person must open. Return ``None`` when the
    loopback listener will catch the redirect (the handler only showed or opened the URL), or
    the full URL the browser was redirected to when the handler caught it itself, as the
    application's own callback (the ``redirect_uri`` of the server's ``"oauth"`` settings)
    does. Its ``state`` must be the one of the authorization URL. Raise
    :class:`~ipybox.errors.AuthorizationError` to refuse the login.
    """

    async def __call__(self, server_name: str, authorization_url: str) -> str | None: ...


_handler: AuthorizationHandler | None = None


def set_authorization_handler(handler: AuthorizationHandler | None) -> None:
    """Install the application's `AuthorizationHandler` for every OAuth login of this process
    (``None``: print the URL to stderr and wait on the loopback listener)."""
    global _handler
    _handler = handler


async def _print_url(server_name: str, authorization_url: str) -> str | None:
    print(
        f"ipybox: to authorize access to MCP server {server_name!r}, open this URL in a browser:\n"
        f"  {authorization_url}",
        file=sys.stderr,
        flush=True,
    )
    return None


class _LoopbackCallback:
    """A one-shot HTTP listener on 127.0.0.1 for the authorization redirect.

    Only a request to the callback path whose ``state`` is the one sent counts; any other gets
    400 and the wait goes on.
    """

    def __init__(self, port: int) -> None:
        try:
            self._sock = listen("127.0.0.1", port)
        except OSError as exc:
            raise OSError(
                f"the OAuth callback port {port} on 127.0.0.1 cannot be used: {exc.strerror}"
            ) from exc
        self.port: int = self._sock.getsockname()[1]
        self.redirect_uri = f"http://127.0.0.1:{self.port}{_CALLBACK_PATH}"

    def close(self) -> None:
        self._sock.close()

    async def wait(self, state: str) -> AuthorizationCodeResult:
        """Serve until a callback with `state` arrives; its code (or the error it carries)."""
        result: asyncio.Future[AuthorizationCodeResult] = asyncio.get_running_loop().create_future()

        # Connections still open when the wait ends (a page that connected and sent nothing) are
        # closed with it, not left holding a socket each.
        writers: set[asyncio.StreamWriter] = set()

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.add(writer)
            try:
                line = await reader.readuntil(b"\r\n\r\n")
                status, text = self._handle(line[:_MAX_CALLBACK_REQUEST], state, result)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                status, text = 400, "Bad request."
            body = text.encode()
            writer.write(
                f"HTTP/1.1 {status} {'OK' if status == 200 else 'Bad Request'}\r\nContent-Type: text/plain; "
                f"charset=utf-8\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, sock=self._sock, limit=_MAX_CALLBACK_REQUEST)
        try:
            return await result
        finally:
            server.close()
            for writer in writers:
                writer.close()
            await server.wait_closed()

    @staticmethod
    def _handle(head: bytes, state: str, result: asyncio.Future[AuthorizationCodeResult]) -> tuple[int, str]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or parts[0] != b"GET":
            return 400, "Bad request."
        target = urlsplit(parts[1].decode("latin-1"))
        query = {key: values[0] for key, values in parse_qs(target.query).items()}
        if target.path != _CALLBACK_PATH or query.get("state") != state or result.done():
            return 400, "This is not the authorization ipybox is waiting for."
        if "error" in query:
            result.set_exception(OAuthFlowError(f"the authorization server refused: {query['error']}"))
            return 200, "Authorization refused; you can close this window."
        if not query.get("code"):
            return 400, "The callback carries no authorization code."
        result.set_result(AuthorizationCodeResult(code=query["code"], state=state, iss=query.get("iss")))
        return 200, "Authorization complete; you can close this window and return to ipybox."


@dataclass
class _Context(OAuthContext):
    """The SDK's context, refreshing a token before it expires rather than at the last second."""

    def update_token_expiry(self, token: OAuthToken) -> None:
        if token.expires_in is None:
            self.token_expiry_time = None
        else:
            self.token_expiry_time = (
                time.time() + token.expires_in - min(_REFRESH_MARGIN, token.expires_in / 2)
            )


class _Provider(OAuthClientProvider):
    """``OAuthClientProvider`` that runs the browser step only when allowed, and records why it failed."""

    def __init__(
        self,
        server_name: str,
        url: str,
        settings: OAuthSettings,
        store: TokenStore,
        interactive: bool,
        login_timeout: float,
    ) -> None:
        self.server_name = server_name
        self._store = store
        self._interactive = interactive
        self._login_timeout = login_timeout
        self._callback: _LoopbackCallback | None = None
        self._state: str | None = None
        self._authorization_url = ""
        self.failure: AuthorizationError | None = None
        self.on_wait: Callable[[bool], None] | None = None
        client_info = store.read().get("client_info") or {}
        registered = (client_info.get("redirect_uris") or [None])[0]
        redirect_uri = settings.redirect_uri or registered
        if settings.redirect_uri is None and (redirect_uri is None or interactive):
            port = settings.callback_port or (urlsplit(registered).port if registered else 0) or 0
            try:
                self._callback = _LoopbackCallback(port)
            except OSError:
                if not port or settings.callback_port:
                    raise
                # The registered port is taken: register again with a free one.
                self._callback = _LoopbackCallback(0)
            redirect_uri = self._callback.redirect_uri
        metadata = OAuthClientMetadata(
            client_name="ipybox",
            redirect_uris=[redirect_uri],  # type: ignore[list-item]  # pydantic takes the string
            grant_types=["authorization_code", "refresh_token"],
            response_types=["code"],
            token_endpoint_auth_method="none",
            scope=settings.scope,
        )
        super().__init__(
            server_url=url,
            client_metadata=metadata,
            storage=store,
            redirect_handler=self._redirect,
            callback_handler=self._wait_for_callback,
            client_metadata_url=settings.client_metadata_url,
        )
        fields = {f.name: getattr(self.context, f.name) for f in dataclasses.fields(OAuthContext) if f.init}
        self.context = _Context(**fields)
        # Registered with another redirect URI (its port is taken, or the settings changed).
        self._reregister = registered is not None and registered != redirect_uri

    async def _initialize(self) -> None:
        await super()._initialize()
        # What discovery found when the tokens were issued: a refresh in a new process goes to the
        # authorization server's token endpoint (the SDK alone would guess the MCP server's origin).
        discovered = self._store.read().get("discovered") or {}
        if discovered.get("oauth_metadata") and self.context.oauth_metadata is None:
            self.context.oauth_metadata = OAuthMetadata.model_validate(discovered["oauth_metadata"])
            self.context.auth_server_url = discovered.get("auth_server_url")
        if discovered.get("resource_metadata") and self.context.protected_resource_metadata is None:
            self.context.protected_resource_metadata = ProtectedResourceMetadata.model_validate(
                discovered["resource_metadata"]
            )
        if self._reregister:
            self.context.client_info = None
        if self.context.current_tokens is not None:
            # The SDK does not keep the expiry across processes; the store does.
            self.context.token_expiry_time = self._store.refresh_due

    async def _handle_token_response(self, response: httpx2.Response) -> None:
        await super()._handle_token_response(response)
        self._store.set_discovered(self.context)

    async def _handle_refresh_response(self, response: httpx2.Response) -> bool:
        sent = self.context.current_tokens
        if await super()._handle_refresh_response(response):
            return True
        # Another process may have refreshed first (the refresh token rotates): take its tokens.
        record = self._store.read()
        tokens = record.get("tokens")
        if tokens and sent is not None and tokens.get("refresh_token") != sent.refresh_token:
            self.context.current_tokens = OAuthToken.model_validate(tokens)
            self.context.token_expiry_time = record.get("refresh_due")
            return self.context.is_token_valid()
        return False

    async def _auth_flow(self, request: httpx2.Request) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        """The SDK's flow, except that a stored login whose token the server refuses is refreshed
        (and the refused request, which the server did not act on, sent once more) before the
        login counts as gone; the SDK alone would start a new authorization."""
        inner = super()._auth_flow(request)
        outgoing = await inner.__anext__()
        while True:
            response = yield outgoing
            if outgoing is request and response.status_code == 401 and not self._interactive:
                refreshable = self.context.can_refresh_token()
                await inner.aclose()  # releases the SDK's lock; nothing else of its flow runs
                if refreshable:
                    refreshed = yield await self._refresh_token()
                    if await self._handle_refresh_response(refreshed):
                        self._add_auth_header(request)
                        retried = yield request
                        if retried.status_code != 401:
                            return
                raise self._login_gone()
            try:
                outgoing = await inner.asend(response)
            except StopAsyncIteration:
                return

    def close(self) -> None:
        if self._callback is not None:
            self._callback.close()

    def _fail(self, message: str) -> AuthorizationError:
        self.failure = AuthorizationError(message, self.server_name)
        return self.failure

    def _login_gone(self) -> AuthorizationError:
        self._store.require_login()
        return self._fail(
            f"The OAuth login for MCP server {self.server_name!r} is no longer valid: the server refused "
            "its token and it could not be refreshed (revoked, or expired). Run "
            f"`ipybox auth login {self.server_name}` to log in again; the call was not run."
        )

    async def _redirect(self, authorization_url: str) -> None:
        if not self._interactive:
            raise self._login_gone()
        self._state = parse_qs(urlsplit(authorization_url).query).get("state", [""])[0]
        self._authorization_url = authorization_url

    async def _wait_for_callback(self) -> AuthorizationCodeResult:
        assert self._state is not None
        handler = _handler or _print_url
        if self.on_wait is not None:
            self.on_wait(True)
        try:
            async with asyncio.timeout(self._login_timeout):
                # The loopback listener waits from before the URL is shown; a handler that caught
                # the redirect itself returns it instead.
                waiting = asyncio.ensure_future(self._callback.wait(self._state)) if self._callback else None
                try:
                    redirected = await handler(self.server_name, self._authorization_url)
                    if redirected is None and waiting is not None:
                        return await waiting
                finally:
                    if waiting is not None:
                        waiting.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await waiting
        except AuthorizationError as exc:
            # The handler refused the browser step (the MCP server does: nobody is at its stderr).
            self.failure = exc
            raise
        except TimeoutError:
            raise self._fail(
                f"No authorization for MCP server {self.server_name!r} arrived within {self._login_timeout:g} s; "
                f"run `ipybox auth login {self.server_name}` and complete the login in the browser."
            ) from None
        finally:
            if self.on_wait is not None:
                self.on_wait(False)
        return self._code_from(redirected)

    def _code_from(self, redirected: str | None) -> AuthorizationCodeResult:
        """The code of the URL the browser was redirected to, once it is the one expected."""
        if redirected is None:
            raise self._fail(
                f"The authorization handler returned no callback URL for MCP server {self.server_name!r}, but its "
                "'oauth' settings name a redirect_uri of the application's: return the URL the callback received."
            )
        if self._callback is not None and not redirected.startswith(self._callback.redirect_uri + "?"):
            raise self._fail(
                f"The OAuth callback for MCP server {self.server_name!r} was refused: it did not come back to "
                f"{self._callback.redirect_uri}."
            )
        query = {key: values[0] for key, values in parse_qs(urlsplit(redirected).query).items()}
        if query.get("state") != self._state:
            raise self._fail(
                f"The OAuth callback for MCP server {self.server_name!r} was refused: its state does not match "
                "the authorization request (a forged or stale redirect)."
            )
        if "error" in query or not query.get("code"):
            raise self._fail(
                f"The authorization server refused access to MCP server {self.server_name!r}: "
                f"{query.get('error', 'no authorization code')}."
            )
        return AuthorizationCodeResult(code=query["code"], state=query["state"], iss=query.get("iss"))


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
