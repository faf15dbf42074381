"""``ipybox auth``: the stored OAuth logins of HTTP MCP servers (list, login, logout)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import webbrowser
from typing import Any

from ipybox.errors import AuthorizationError, IpyboxError

_DESCRIPTION = """\
Manage the OAuth logins of HTTP MCP servers whose parameters hold "oauth": true. Tokens and
client registrations are kept in the user's state directory (owner-only; never readable by a
sandboxed kernel) and refreshed before they expire. A server without a login logs in on its
first call; a login that was revoked or expired beyond refresh fails with an error until
`ipybox auth login NAME` runs.
"""


def parse_auth_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``ipybox auth ...`` (without the leading ``auth``)."""
    parser = argparse.ArgumentParser(prog="ipybox auth", description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{list,login,logout}")
    commands.add_parser("list", help="show the stored logins (never a token)")
    login = commands.add_parser(
        "login",
        help="log in to a server now: open the authorization URL, catch the callback, store the tokens",
    )
    login.add_argument(
        "name", help="the server's name, as registered (register_mcp_server, generate_mcp_sources)"
    )
    login.add_argument("--url", help="the server's URL, for a server not registered yet")
    login.add_argument("--scope", help="with --url: the scopes to ask for (space-separated)")
    login.add_argument("--no-browser", action="store_true", help="print the URL only; do not open a browser")
    login.add_argument(
        "--timeout",
        type=float,
        default=30,
        metavar="SECONDS",
        help="seconds the server has to answer (default: 30)",
    )
    logout = commands.add_parser("logout", help="forget a server's stored tokens and client registration")
    logout.add_argument("name", help="the server's name")
    return parser.parse_args(argv)


def auth_main(argv: list[str]) -> None:
    """Run ``ipybox auth ...``; exits with 1 and a message on stderr when it fails."""
    from ipybox.app.mcp_client import list_logins, login, logout, set_authorization_handler

    args = parse_auth_args(argv)
    if args.command == "list":
        logins = list_logins()
        if not logins:
            print("No stored OAuth logins.")
        for entry in logins:
            expiry = ""
            if entry.expires_at is not None:
                expiry = f", access token expires {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(entry.expires_at))}"
            refresh = ", refreshable" if entry.refreshable else ""
            print(f"{entry.server_name}\t{entry.url}\t{entry.state}{expiry}{refresh}")
        return
    if args.command == "logout":
        if logout(args.name):
            print(f"Forgot the OAuth login of MCP server {args.name!r}.")
        else:
            print(f"No stored OAuth login for MCP server {args.name!r}.")
        return
    try:
        params = _login_params(args)
        if not args.no_browser:
            set_authorization_handler(_open_in_browser)
        tools = asyncio.run(login(args.name, params, connect_timeout=args.timeout))
    except (IpyboxError, OSError) as exc:
        print(f"ipybox auth login: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"Logged in to MCP server {args.name!r}; it offers {tools} tool{'' if tools == 1 else 's'}.")


def _login_params(args: argparse.Namespace) -> dict[str, Any]:
    from ipybox.app.mcp_client import default_registry

    if args.url is not None:
        oauth: dict[str, Any] = {"scope": args.scope} if args.scope else {}
        return {"url": args.url, "oauth": oauth or True}
    params = default_registry().lookup(args.name)
    if params is None:
        raise IpyboxError(
            f"No MCP server named {args.name!r} is registered: give its URL with --url, or register it first."
        )
    return params


async def _open_in_browser(server_name: str, authorization_url: str) -> None:
    print(
        f"To authorize access to MCP server {server_name!r}, open this URL in a browser:\n  {authorization_url}",
        file=sys.stderr,
        flush=True,
    )
    await asyncio.to_thread(webbrowser.open, authorization_url)


def refuse_browser_step() -> None:
    """Make a server's first use fail with what to run, instead of waiting on a URL in the MCP
    server's stderr (which the person at the MCP client does not see)."""
    from ipybox.app.mcp_client import set_authorization_handler

    async def refuse(server_name: str, authorization_url: str) -> str | None:
        raise AuthorizationError(
            f"MCP server {server_name!r} needs an OAuth login first: in a terminal, run "
            f"`ipybox auth login {server_name} --url URL` (URL: the server's), then call again.",
            server_name,
        )

    set_authorization_handler(refuse)
