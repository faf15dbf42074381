"""An OAuth authorization server and OAuth-protected MCP servers, for the OAuth tests.

Built from the MCP SDK's server-side auth (``mcp.server.auth``: an
``OAuthAuthorizationServerProvider`` behind its authorization, token, registration and
revocation routes; a token verifier and protected resource metadata on each MCP server), as the
SDK's ``simple-auth`` example does. The authorization server approves every authorization at
once (the test stands in for the person), binds each token to the ``resource`` it was asked for,
and has test-only ``/admin`` routes to revoke every token, end every access token, make the MCP
server redirect elsewhere, and count what happened.

Prints ``READY <json>`` with the URLs once every server listens:
``as`` (the authorization server), ``mcp`` and ``sse`` (its MCP server), ``other`` (a second
MCP server of the same authorization server: another resource), ``foreign`` (an MCP server
whose authorization server's metadata names another origin as issuer), ``evil`` (records
what it receives).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from typing import Any

import uvicorn
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    OAuthAuthorizationServerProvider,
    RefreshToken,
    TokenError,
    construct_redirect_uri,
)
from mcp.server.auth.routes import create_auth_routes
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions, RevocationOptions
from mcp.server.mcpserver import MCPServer
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken
from pydantic import AnyHttpUrl
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

TOKEN_LIFETIME = 3600
STATS: dict[str, Any] = {"authorizations": 0, "refreshes": 0, "calls": 0, "evil": [], "foreign": []}
REDIRECT: dict[str, str | None] = {"to": None}


class Provider(OAuthAuthorizationServerProvider[AuthorizationCode, RefreshToken, AccessToken]):
    """An in-memory authorization server that approves every request at once."""

    def __init__(self) -> None:
        self.clients: dict[str, OAuthClientInformationFull] = {}
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        assert client_info.client_id is not None
        self.clients[client_info.client_id] = client_info

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        code = secrets.token_urlsafe(32)
        assert client.client_id is not None
        self.codes[code] = AuthorizationCode(
            code=code,
            scopes=params.scopes or ["notes"],
            expires_at=time.time() + 300,
            client_id=client.client_id,
            code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource,
            subject="alice",
        )
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: str
    ) -> AuthorizationCode | None:
        return self.codes.get(authorization_code)

    def issue(self, client_id: str, scopes: list[str], resource: str | None) -> OAuthToken:
        access, refresh = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        self.access[access] = AccessToken(
            token=access,
            client_id=client_id,
            scopes=scopes,
            expires_at=int(time.time()) + TOKEN_LIFETIME,
            resource=resource,
            subject="alice",
        )
        self.refresh[refresh] = RefreshToken(
            token=refresh, client_id=client_id, scopes=scopes, resource=resource, subject="alice"
        )
        return OAuthToken(
            access_token=access,
            expires_in=TOKEN_LIFETIME,
            scope=" ".join(scopes),
            refresh_token=refresh,
        )

    async def exchange_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: AuthorizationCode
    ) -> OAuthToken:
        if self.codes.pop(authorization_code.code, None) is None:
            raise TokenError("invalid_grant", "authorization code already used")
        STATS["authorizations"] += 1
        return self.issue(
            authorization_code.client_id, authorization_code.scopes, authorization_code.resource
        )

    async def load_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: str
    ) -> RefreshToken | None:
        return self.refresh.get(refresh_token)

    async def exchange_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: RefreshToken, scopes: list[str]
    ) -> OAuthToken:
        # Rotation: the old refresh token and every access token of the client end.
        self.refresh.pop(refresh_token.token, None)
        for token in [t for t, a in self.access.items() if a.client_id == refresh_token.client_id]:
            del self.access[token]
        STATS["refreshes"] += 1
        return self.issue(refresh_token.client_id, scopes or refresh_token.scopes, refresh_token.resource)

    async def load_access_token(self, token: str) -> AccessToken | None:
        return self.access.get(token)

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)


PROVIDER = Provider()


class Verifier:
    """The MCP servers' token check: a token this authorization server issued and did not revoke."""

    async def verify_token(self, token: str) -> AccessToken | None:
        access = PROVIDER.access.get(token)
        if access is None or (access.expires_at is not None and access.expires_at < time.time()):
            return None
        return access


async def admin(request: Request) -> Response:
    action = request.path_params["action"]
    if action == "revoke":
        PROVIDER.access.clear()
        PROVIDER.refresh.clear()
    elif action == "expire-access":
        PROVIDER.access.clear()
    elif action == "redirect":
        REDIRECT["to"] = (await request.json())["to"]
    elif action == "token-for":
        # A valid token for a given resource, as another client of the same server would hold.
        resource = (await request.json())["resource"]
        issued = PROVIDER.issue("someone-else", ["notes"], resource)
        return JSONResponse({"access_token": issued.access_token})
    return JSONResponse(STATS)


def mcp_app(issuer: str, resource: str, sse: bool = False) -> Starlette:
    server = MCPServer(
        "notes",
        token_verifier=Verifier(),
        auth=AuthSettings(
            issuer_url=AnyHttpUrl(issuer),
            resource_server_url=AnyHttpUrl(resource),
            validate_token_resource=True,
            required_scopes=["notes"],
        ),
    )

    @server.tool()
    def add_note(text: str) -> str:
        """Store a note (counts every call that ran)."""
        STATS["calls"] += 1
        return f"noted: {text}"

    return server.sse_app() if sse else server.streamable_http_app()


class Redirecting:
    """Sends every request elsewhere while the test asks for it (``/admin/redirect``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and REDIRECT["to"]:
            await RedirectResponse(str(REDIRECT["to"]), status_code=307)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def recorder(name: str) -> Starlette:
    async def record(request: Request) -> Response:
        STATS[name].append({"path": request.url.path, "authorization": request.headers.get("authorization")})
        return JSONResponse({"error": "nothing here"}, status_code=404)

    return Starlette(routes=[Route("/{path:path}", record, methods=["GET", "POST", "DELETE"])])


def foreign_as(own: str, claimed_issuer: str) -> Starlette:
    """An authorization server whose metadata claims another origin's issuer."""

    async def metadata(request: Request) -> Response:
        return JSONResponse(
            {
                "issuer": claimed_issuer,
                "authorization_endpoint": f"{own}/authorize",
                "token_endpoint": f"{own}/token",
                "registration_endpoint": f"{own}/register",
                "response_types_supported": ["code"],
                "code_challenge_methods_supported": ["S256"],
            }
        )

    async def record(request: Request) -> Response:
        STATS["foreign"].append({"path": request.url.path})
        return JSONResponse({"error": "invalid_request"}, status_code=400)

    return Starlette(
        routes=[
            Route("/.well-known/oauth-authorization-server", metadata),
            Route("/{path:path}", record, methods=["GET", "POST"]),
        ]
    )


def _listen() -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def main() -> None:
    names = ["as", "mcp", "sse", "other", "foreign", "foreign_as", "evil"]
    sockets = {name: _listen() for name in names}
    url = {name: base for name, (_, base) in sockets.items()}
    as_app = Starlette(
        routes=[
            *create_auth_routes(
                provider=PROVIDER,
                issuer_url=AnyHttpUrl(url["as"]),
                client_registration_options=ClientRegistrationOptions(enabled=True, valid_scopes=["notes"]),
                revocation_options=RevocationOptions(enabled=True),
            ),
            Route("/admin/{action}", admin, methods=["POST", "GET"]),
        ]
    )
    apps: dict[str, Any] = {
        "as": as_app,
        "mcp": Redirecting(mcp_app(url["as"], f"{url['mcp']}/mcp")),
        "sse": mcp_app(url["as"], f"{url['sse']}/sse", sse=True),
        "other": mcp_app(url["as"], f"{url['other']}/mcp"),
        "foreign": mcp_app(url["foreign_as"], f"{url['foreign']}/mcp"),
        "foreign_as": foreign_as(url["foreign_as"], url["as"]),
        "evil": recorder("evil"),
    }
    servers = [
        uvicorn.Server(uvicorn.Config(apps[name], log_level="warning", lifespan="auto")) for name in names
    ]
    print("READY " + json.dumps(url), flush=True)
    await asyncio.gather(
        *(server.serve(sockets=[sockets[name][0]]) for server, name in zip(servers, names, strict=True))
    )


if __name__ == "__main__":
    asyncio.run(main())
