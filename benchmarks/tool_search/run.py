"""Tool search: recall and latency on real MCP servers' tools (``catalogue.json``, ``queries.json``).

Every tool of the catalogue goes through the code ``generate_mcp_sources`` runs (its
``_search.json`` entry, then the BM25 index of all of them), and every query through the
kernel's ``search_tools``, reading the index file as a kernel does. A query is found at k when
one of the tools that fit it is among the first k matches; recall@k is the share of queries found.

    uv run --frozen python benchmarks/tool_search/run.py                      # ipybox's search
    uv run --frozen --with rank-bm25 python benchmarks/tool_search/run.py --compare   # and the alternatives
    uv run --frozen python benchmarks/tool_search/run.py --mcp   # and the MCP server's search_tools round trip
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mcp.types import Tool

from ipybox.app import _codegen
from ipybox.app._search_index import build_index, catalogue
from ipybox.kernel._search import INDEX_FILE, search_tools, words

HERE = Path(__file__).parent
Ranker = Callable[[str, int], list[str]]


def load() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    servers = json.loads((HERE / "catalogue.json").read_text())["servers"]
    queries = json.loads((HERE / "queries.json").read_text())["queries"]
    return servers, queries


def entries(servers: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    found: list[dict[str, str]] = []
    for server in servers:
        tools = [Tool.model_validate(tool) for tool in server["tools"]]
        modules = _codegen.module_names([tool.name for tool in tools])
        text = catalogue("mcptools", server["server"], tools, modules, b"benchmark")
        found += json.loads(text.partition("\n")[2])["tools"]
    return found


def evaluate(name: str, ranker: Ranker, queries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    report: dict[str, Any] = {"ranker": name}
    misses: list[str] = []
    for split in ("dev", "test", "all"):
        chosen = [q for q in queries if split in ("all", q["split"])]
        at1 = at5 = 0
        for query in chosen:
            ranked = ranker(query["query"], 5)
            at1 += bool(set(ranked[:1]) & set(query["fits"]))
            hit5 = bool(set(ranked[:5]) & set(query["fits"]))
            at5 += hit5
            if split == "all" and not hit5:
                misses.append(
                    f"  [{query['split']}] {query['query']!r}: got {ranked[:3]}, fits {query['fits']}"
                )
        report[split] = {
            "queries": len(chosen),
            "recall@1": round(at1 / len(chosen), 3),
            "recall@5": round(at5 / len(chosen), 3),
        }
    report["misses"] = misses
    return report


def latency(ranker: Ranker, queries: Sequence[dict[str, Any]], rounds: int = 20) -> dict[str, float]:
    times: list[float] = []
    for _ in range(rounds):
        for query in queries:
            start = time.perf_counter()
            ranker(query["query"], 5)
            times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {
        "median_ms": round(statistics.median(times), 3),
        "p95_ms": round(times[int(len(times) * 0.95)], 3),
        "max_ms": round(times[-1], 3),
    }


def ipybox_ranker(root: Path) -> Ranker:
    return lambda query, k: [f"{m.server}.{m.tool}" for m in search_tools(query, k, root=root)]


def alternatives(docs: Sequence[dict[str, str]], servers: Sequence[dict[str, Any]]) -> dict[str, Ranker]:
    """Other ways to rank the same tools, for comparison."""
    import bm25s
    import numpy as np

    keys = [f"{d['server']}.{d['tool']}" for d in docs]
    found: dict[str, Ranker] = {}
    raw = [
        " ".join([s["server"], t["name"], t.get("description") or ""]) for s in servers for t in s["tools"]
    ]
    plain = bm25s.BM25()
    plain.index(bm25s.tokenize(raw, stopwords="en", show_progress=False), show_progress=False)

    def bm25s_plain(query: str, k: int) -> list[str]:
        ids, _ = plain.retrieve(
            bm25s.tokenize([query], stopwords="en", show_progress=False), k=k, show_progress=False
        )
        return [keys[i] for i in ids[0]]

    found["bm25s, its own tokenizer, server + name + description"] = bm25s_plain
    try:
        from rank_bm25 import BM25Okapi
    except ImportError:
        print("(rank-bm25 not installed: run with `uv run --frozen --with rank-bm25`)", file=sys.stderr)
    else:
        okapi = BM25Okapi([d["text"].split() for d in docs])

        def rank_bm25(query: str, k: int) -> list[str]:
            scores = okapi.get_scores(words(query))
            return [keys[i] for i in np.argsort(-scores)[:k]]

        found["rank-bm25 BM25Okapi, ipybox's document text"] = rank_bm25
    return found


async def mcp_latency(
    index: dict[str, Any], queries: Sequence[dict[str, Any]], rounds: int = 5
) -> dict[str, float]:
    """The MCP server's ``search_tools`` through the MCP SDK's client (stdio), index already in place."""
    from mcp.client import Client
    from mcp.client.stdio import StdioServerParameters

    with tempfile.TemporaryDirectory() as folder:
        workspace = Path(folder) / "workspace"
        (workspace / "mcptools").mkdir(parents=True)
        (workspace / "mcptools" / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":")))
        for server in {tool["server"] for tool in index["tools"]}:
            (workspace / "mcptools" / server).mkdir()
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "ipybox", "--workspace", str(workspace)],
            env={**os.environ, "IPYBOX_STATE_DIR": str(Path(folder) / "state")},
        )
        async with Client(params) as client:
            times: list[float] = []
            for _ in range(rounds):
                for query in queries:
                    start = time.perf_counter()
                    result = await client.call_tool("search_tools", {"query": query["query"]})
                    times.append((time.perf_counter() - start) * 1000)
                    assert not result.is_error
    times.sort()
    return {
        "median_ms": round(statistics.median(times), 3),
        "p95_ms": round(times[int(len(times) * 0.95)], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", action="store_true", help="also measure other rankers")
    parser.add_argument("--mcp", action="store_true", help="also time the MCP server's search_tools")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    servers, queries = load()
    docs = entries(servers)
    start = time.perf_counter()
    index = build_index(docs)
    build_ms = (time.perf_counter() - start) * 1000
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":")))
        for server in servers:
            (root / server["server"]).mkdir()
        start = time.perf_counter()
        search_tools("warm up", 5, root=root)
        first_ms = (time.perf_counter() - start) * 1000
        rankers = {"ipybox search_tools (bm25s index, stdlib query)": ipybox_ranker(root)}
        if args.compare:
            rankers |= alternatives(docs, servers)
        results = []
        for name, ranker in rankers.items():
            report = evaluate(name, ranker, queries)
            report["latency"] = latency(ranker, queries)
            results.append(report)
        size = (root / INDEX_FILE).stat().st_size
    mcp = asyncio.run(mcp_latency(index, queries)) if args.mcp else None
    figures = {
        "tools": len(docs),
        "servers": len(servers),
        "queries": len(queries),
        "index_build_ms": round(build_ms, 1),
        "index_bytes": size,
        "first_search_ms (reads and parses the index)": round(first_ms, 2),
        "results": results,
        "mcp_search_tools_round_trip": mcp,
    }
    print(
        f"{len(docs)} tools across {len(servers)} servers, {len(queries)} queries; index built in {build_ms:.0f} ms, "
        f"{size / 1024:.0f} KiB, first search {first_ms:.1f} ms"
    )
    for report in results:
        print(f"\n{report['ranker']}")
        for split in ("dev", "test", "all"):
            r = report[split]
            print(
                f"  {split:4} ({r['queries']:3} queries): recall@1 {r['recall@1']:.3f}  recall@5 {r['recall@5']:.3f}"
            )
        lat = report["latency"]
        print(
            f"  latency per search: median {lat['median_ms']} ms, p95 {lat['p95_ms']} ms, max {lat['max_ms']} ms"
        )
        print("  missed at 5:" if report["misses"] else "  missed at 5: none")
        print("\n".join(report["misses"]))
    if mcp is not None:
        print(
            f"\nMCP search_tools round trip (stdio, SDK client): median {mcp['median_ms']} ms, p95 {mcp['p95_ms']} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
