"""Build the held-out ``catalogue.json`` and ``servers.json``: real published MCP servers' tools.

None of these servers is in ``../catalogue.json``. Each is installed from its registry into a
throwaway folder and started as a stdio MCP server with the MCP SDK's client; its tools are what
it answers to ``tools/list``. Servers that need an account get placeholder credentials: they list
their tools without calling out (no network but the registries is reachable here anyway).

    mkdir -p /tmp/heldout/npm && cd /tmp/heldout/npm && npm init -y
    npm install --ignore-scripts <each NPM package below>@<its version in README.md>
    for p in <each PyPI package below>; do
        uv venv --python <3.11, or 3.12 for mcp-server-spotify> /tmp/heldout/py/$p
        uv pip install --python /tmp/heldout/py/$p/bin/python $p==<its version in README.md>
    done
    echo '{"installed": {"client_id": "x", "client_secret": "x", "redirect_uris": []}}' \
        > /tmp/heldout/gcp-oauth.keys.json
    uv run --frozen python benchmarks/tool_search/heldout/collect.py /tmp/heldout/npm /tmp/heldout/py

(each PyPI server in an environment of its own: they pin different versions of ``mcp``).
Naming servers after the two folders lists only those and writes nothing (a trial run).

The one-line purpose is the package's own registry description (npm ``description``, PyPI
``Summary``); a package that has none gets the opening of its README, recorded in ``PURPOSE``.
"""

from __future__ import annotations

import email
import json
import sys
from pathlib import Path
from typing import Any

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import PaginatedRequestParams

HERE = Path(__file__).parent
LIST_TIMEOUT = 90

# (server name, npm package, bin script in the package, args, env)
NPM: list[tuple[str, str, str, list[str], dict[str, str]]] = [
    ("asana", "@roychri/mcp-server-asana", "dist/index.js", [], {"ASANA_ACCESS_TOKEN": "x"}),
    (
        "stripe",
        "@stripe/mcp",  # 0.2.5: the last version that serves its tools itself (0.3 relays to a remote)
        "dist/index.js",
        ["--tools=all", "--api-key=sk_test_x"],
        {},
    ),
    ("hubspot", "@hubspot/mcp-server", "dist/index.js", [], {"PRIVATE_APP_ACCESS_TOKEN": "x"}),
    ("airtable", "airtable-mcp-server", "dist/main.js", [], {"AIRTABLE_API_KEY": "x"}),
    ("tavily", "tavily-mcp", "build/index.js", [], {"TAVILY_API_KEY": "tvly-x"}),
    ("mapbox", "@mapbox/mcp-server", "dist/index.js", [], {"MAPBOX_ACCESS_TOKEN": "pk.x"}),
    ("sentry", "@sentry/mcp-server", "dist/index.js", ["--access-token=x"], {}),
    ("circleci", "@circleci/mcp-server-circleci", "dist/index.js", [], {"CIRCLECI_TOKEN": "x"}),
    ("figma", "figma-developer-mcp", "dist/bin.js", ["--stdio"], {"FIGMA_API_KEY": "x"}),
    (
        "google_calendar",
        "@cocal/google-calendar-mcp",
        "build/index.js",
        [],
        {"GOOGLE_OAUTH_CREDENTIALS": "/tmp/heldout/gcp-oauth.keys.json"},
    ),
    ("discord", "mcp-discord", "build/index.js", [], {"DISCORD_TOKEN": "x"}),
    ("resend", "resend-mcp", "dist/index.js", [], {"RESEND_API_KEY": "re_x"}),
]
# (server name, PyPI package, console script, args, env)
PYPI: list[tuple[str, str, str, list[str], dict[str, str]]] = [
    (
        "atlassian",
        "mcp-atlassian",
        "mcp-atlassian",
        [],
        {
            "JIRA_URL": "https://example.atlassian.net",
            "JIRA_USERNAME": "user@example.com",
            "JIRA_API_TOKEN": "x",
            "CONFLUENCE_URL": "https://example.atlassian.net/wiki",
            "CONFLUENCE_USERNAME": "user@example.com",
            "CONFLUENCE_API_TOKEN": "x",
            "TOOLSETS": "all",
        },
    ),
    (
        "spotify",
        "mcp-server-spotify",
        "mcp-server-spotify",
        [],
        {"SPOTIFY_CLIENT_ID": "x", "SPOTIFY_CLIENT_SECRET": "x"},
    ),
    ("redis", "redis-mcp-server", "redis-mcp-server", [], {"REDIS_HOST": "127.0.0.1"}),
    ("email", "mcp-email-server", "mcp-email-server", ["stdio"], {}),
]
# Packages whose registry entry has no description: the opening of the README that their
# registry page (or, for Sentry, whose package ships no README, its repository) shows.
PURPOSE: dict[str, str] = {
    "@sentry/mcp-server": "Sentry's MCP service is primarily designed for human-in-the-loop coding agents.",
    "resend-mcp": (
        "An MCP server for the Resend platform. Send and receive emails, manage contacts, broadcasts,"
        " domains, and more — directly from any MCP client like Claude Desktop, Cursor, or Claude Code."
    ),
}
PURPOSE_MAX = 200  # a longer description is cut to its first sentence


def _one_line(description: str) -> str:
    text = " ".join(description.split())
    if len(text) > PURPOSE_MAX and ". " in text:
        text = text[: text.index(". ") + 1]
    return text


def _npm_meta(root: Path, package: str) -> tuple[str, str]:
    meta = json.loads((root / "node_modules" / package / "package.json").read_text())
    return str(meta["version"]), str(meta.get("description") or "")


def _pypi_meta(venv: Path, package: str) -> tuple[str, str]:
    name = package.replace("-", "_").lower()
    for path in (venv / "lib").glob("python*/site-packages/*.dist-info/METADATA"):
        if path.parent.name.lower().startswith(f"{name}-"):
            meta = email.message_from_string(path.read_text())
            return str(meta["Version"]), str(meta["Summary"] or "")
    raise FileNotFoundError(f"{package} is not installed in {venv}")


async def _list_tools(params: StdioServerParameters) -> list[dict[str, Any]]:
    with anyio.fail_after(LIST_TIMEOUT):
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools, cursor = [], None
            while True:
                page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor))
                tools += page.tools
                if not (cursor := page.next_cursor):
                    break
    return [{"name": t.name, "description": t.description, "inputSchema": t.input_schema} for t in tools]


async def _collect(
    name: str, registry: str, package: str, meta: tuple[str, str], params: StdioServerParameters
) -> dict[str, Any] | None:
    version, description = meta
    try:
        tools = await _list_tools(params)
    except Exception as exc:  # a server that does not list is reported and left out
        print(f"{name}: not listed: {exc!r}", file=sys.stderr)
        return None
    print(f"{name}: {len(tools)} tools ({registry} {package} {version})", file=sys.stderr)
    purpose = PURPOSE.get(package) or _one_line(description)
    return {"package": package, "registry": registry, "version": version, "purpose": purpose, "tools": tools}


async def main(npm_root: Path, venvs: Path, only: set[str]) -> None:
    servers: dict[str, dict[str, Any]] = {}
    for name, package, script, args, env in NPM:
        if only and name not in only:
            continue
        bin_path = npm_root / "node_modules" / package / script
        params = StdioServerParameters(command="node", args=[str(bin_path), *args], env=env)
        if found := await _collect(name, "npm", package, _npm_meta(npm_root, package), params):
            servers[name] = found
    for name, package, script, args, env in PYPI:
        if only and name not in only:
            continue
        venv = venvs / package
        # a fixed hash seed: mcp-atlassian builds a schema default from a set
        env = {"PYTHONHASHSEED": "0", **env}
        params = StdioServerParameters(command=str(venv / "bin" / script), args=args, env=env)
        if found := await _collect(name, "PyPI", package, _pypi_meta(venv, package), params):
            servers[name] = found
    servers = {name: server for name, server in servers.items() if server["tools"]}
    total = sum(len(server["tools"]) for server in servers.values())
    print(f"{total} tools across {len(servers)} servers", file=sys.stderr)
    if only:  # a trial run writes nothing
        return
    (HERE / "catalogue.json").write_text(json.dumps(servers, indent=1, ensure_ascii=False) + "\n")
    index = [{"server": name, "purpose": server["purpose"]} for name, server in servers.items()]
    (HERE / "servers.json").write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), Path(sys.argv[2]), set(sys.argv[3:]))
