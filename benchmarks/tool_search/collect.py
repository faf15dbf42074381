"""Build ``catalogue.json``: the tool lists of real published MCP servers, as they list them.

Each server is installed from its registry into a throwaway folder and started as a stdio MCP
server; its tools come from ``tools/list`` through ipybox's MCP client (the MCP SDK's). Servers
that need an account get a placeholder credential: they list their tools without calling out.

    mkdir -p /tmp/cat/npm && cd /tmp/cat/npm && npm init -y && npm install --ignore-scripts <the NPM packages below>
    for p in <the PyPI packages below>; do uv venv /tmp/cat/py/$p && uv pip install --python /tmp/cat/py/$p/bin/python $p; done
    uv run --frozen python benchmarks/tool_search/collect.py /tmp/cat/npm /tmp/cat/py

(each PyPI server in an environment of its own: they pin different versions of ``mcp``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from ipybox.app.mcp_client._session import list_tools

HERE = Path(__file__).parent

# (server name, npm package, bin script in the package, extra args, env)
NPM: list[tuple[str, str, str, list[str], dict[str, str]]] = [
    ("filesystem", "@modelcontextprotocol/server-filesystem", "dist/index.js", ["/tmp"], {}),
    ("memory", "@modelcontextprotocol/server-memory", "dist/index.js", [], {}),
    ("everything", "@modelcontextprotocol/server-everything", "dist/index.js", ["stdio"], {}),
    (
        "github",
        "@modelcontextprotocol/server-github",
        "dist/index.js",
        [],
        {"GITHUB_PERSONAL_ACCESS_TOKEN": "x"},
    ),
    (
        "gitlab",
        "@modelcontextprotocol/server-gitlab",
        "dist/index.js",
        [],
        {"GITLAB_PERSONAL_ACCESS_TOKEN": "x"},
    ),
    (
        "google_maps",
        "@modelcontextprotocol/server-google-maps",
        "dist/index.js",
        [],
        {"GOOGLE_MAPS_API_KEY": "x"},
    ),
    ("postgres", "@modelcontextprotocol/server-postgres", "dist/index.js", ["postgresql://localhost/db"], {}),
    (
        "brave_search",
        "@modelcontextprotocol/server-brave-search",
        "dist/index.js",
        [],
        {"BRAVE_API_KEY": "x"},
    ),
    (
        "slack",
        "@modelcontextprotocol/server-slack",
        "dist/index.js",
        [],
        {"SLACK_BOT_TOKEN": "x", "SLACK_TEAM_ID": "T0"},
    ),
    ("puppeteer", "@modelcontextprotocol/server-puppeteer", "dist/index.js", [], {}),
    ("sequential_thinking", "@modelcontextprotocol/server-sequential-thinking", "dist/index.js", [], {}),
    ("playwright", "@playwright/mcp", "cli.js", [], {}),
    ("chrome_devtools", "chrome-devtools-mcp", "build/src/bin/chrome-devtools-mcp.js", [], {}),
    ("notion", "@notionhq/notion-mcp-server", "bin/cli.mjs", [], {"NOTION_TOKEN": "x"}),
    ("mongodb", "mongodb-mcp-server", "dist/esm/index.js", [], {}),
    ("firecrawl", "firecrawl-mcp", "dist/index.js", [], {"FIRECRAWL_API_KEY": "fc-x"}),
    ("kubernetes", "mcp-server-kubernetes", "dist/index.js", [], {}),
    ("context7", "@upstash/context7-mcp", "dist/index.js", [], {}),
    ("desktop_commander", "@wonderwhy-er/desktop-commander", "dist/index.js", [], {}),
]
# (server name, PyPI package, console script, args, env)
PYPI: list[tuple[str, str, str, list[str], dict[str, str]]] = [
    ("time", "mcp-server-time", "mcp-server-time", [], {}),
    ("fetch", "mcp-server-fetch", "mcp-server-fetch", [], {}),
    ("git", "mcp-server-git", "mcp-server-git", [], {}),
    ("obsidian", "mcp-obsidian", "mcp-obsidian", [], {"OBSIDIAN_API_KEY": "x"}),
]


def _version_npm(root: Path, package: str) -> str:
    return str(json.loads((root / "node_modules" / package / "package.json").read_text())["version"])


def _version_pypi(venv: Path, package: str) -> str:
    for meta in (venv / "lib").glob(
        f"python*/site-packages/{package.replace('-', '_')}-*.dist-info/METADATA"
    ):
        for line in meta.read_text().splitlines():
            if line.startswith("Version: "):
                return line.removeprefix("Version: ")
    return "?"


async def _collect(name: str, source: str, params: dict[str, Any]) -> dict[str, Any] | None:
    try:
        tools = await list_tools(name, params, connect_timeout=60)
    except Exception as exc:  # a server that does not list is reported and left out
        print(f"{name}: not listed: {exc}", file=sys.stderr)
        return None
    print(f"{name}: {len(tools)} tools ({source})", file=sys.stderr)
    return {
        "server": name,
        "source": source,
        "tools": [
            {"name": t.name, "title": t.title, "description": t.description, "inputSchema": t.input_schema}
            for t in tools
        ],
    }


async def main(npm_root: Path, venvs: Path) -> None:
    servers: list[dict[str, Any]] = []
    for name, package, script, args, env in NPM:
        source = f"npm {package}@{_version_npm(npm_root, package)}"
        bin_path = npm_root / "node_modules" / package / script
        params = {"command": "node", "args": [str(bin_path), *args], "env": env}
        if (found := await _collect(name, source, params)) is not None:
            servers.append(found)
    for name, package, script, args, env in PYPI:
        source = f"PyPI {package}=={_version_pypi(venvs / package, package)}"
        params = {"command": str(venvs / package / "bin" / script), "args": args, "env": env}
        if (found := await _collect(name, source, params)) is not None:
            servers.append(found)
    servers = [server for server in servers if server["tools"]]
    total = sum(len(server["tools"]) for server in servers)
    print(f"{total} tools across {len(servers)} servers", file=sys.stderr)
    (HERE / "catalogue.json").write_text(
        json.dumps({"servers": servers}, indent=1, ensure_ascii=False) + "\n"
    )


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
