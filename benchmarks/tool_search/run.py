"""Tool search: recall and latency on real MCP servers' tools (``catalogue.json``, ``queries.json``).

Every tool of the catalogue goes through the code ``generate_mcp_sources`` runs (its
``_search.json`` entry, then the index of all of them: BM25 and word vectors), and every query
through the kernel's ``search_tools``, reading the index file as a kernel does. A query is found
at k when one of the tools that fit it is among the first k matches; recall@k is the share of
queries found, MRR the mean of 1 / the first fitting tool's place (0 past 10). Needs that no tool
fits (``nofit.json``) count as answered right when the search returns nothing.

    uv run --frozen python benchmarks/tool_search/run.py                      # ipybox's search
    uv run --frozen python benchmarks/tool_search/run.py --heldout            # on the held-out set too
    uv run --frozen python benchmarks/tool_search/run.py --kernel --scale     # fresh kernel; 3,000 tools
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

from ipybox.app.apigen import _codegen
from ipybox.app.apigen._search_index import build_index, catalogue
from ipybox.kernel._search import INDEX_FILE, search_tools, words

HERE = Path(__file__).parent
Ranker = Callable[[str, int], list[str]]


def load() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    servers = json.loads((HERE / "catalogue.json").read_text())["servers"]
    queries = json.loads((HERE / "queries.json").read_text())["queries"]
    nofit = json.loads((HERE / "nofit.json").read_text())["queries"]
    return servers, queries + [{**need, "fits": []} for need in nofit]


def load_heldout() -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The held-out catalogue and its labelled needs (``None`` while the needs are not written)."""
    folder = HERE / "heldout"
    catalogue = json.loads((folder / "catalogue.json").read_text())
    servers = [{"server": name, "tools": server["tools"]} for name, server in catalogue.items()]
    needs = folder / "needs.json"
    if not needs.exists():
        return None
    return servers, [
        {"query": need["need"], "fits": need["relevant"], "split": split}
        for split, written in json.loads(needs.read_text()).items()
        for need in written
    ]


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
        chosen = [q for q in queries if split in ("all", q["split"]) and q["fits"]]
        nofit = [q for q in queries if split in ("all", q["split"]) and not q["fits"]]
        at1 = at5 = 0
        mrr = 0.0
        for query in chosen:
            ranked = ranker(query["query"], 10)
            at1 += bool(set(ranked[:1]) & set(query["fits"]))
            hit5 = bool(set(ranked[:5]) & set(query["fits"]))
            at5 += hit5
            mrr += next((1 / place for place, key in enumerate(ranked, 1) if key in query["fits"]), 0.0)
            if split == "all" and not hit5:
                misses.append(
                    f"  [{query['split']}] {query['query']!r}: got {ranked[:3]}, fits {query['fits']}"
                )
        empty = sum(not ranker(query["query"], 5) for query in nofit)
        report[split] = {
            "queries": len(chosen),
            "recall@1": round(at1 / max(len(chosen), 1), 3),
            "recall@5": round(at5 / max(len(chosen), 1), 3),
            "mrr": round(mrr / max(len(chosen), 1), 3),
            "nofit_needs": len(nofit),
            "nofit_answered_empty": empty,
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


def words_only(docs: Sequence[dict[str, str]], servers: Sequence[dict[str, Any]], folder: Path) -> Ranker:
    """ipybox's search on an index without vectors: what an application without the model builds."""
    index = build_index(docs)
    index.pop("dense", None)
    root = folder / "words-only"
    root.mkdir()
    (root / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":")))
    for server in servers:
        (root / server["server"]).mkdir()
    return ipybox_ranker(root)


def measure(
    servers: Sequence[dict[str, Any]], queries: Sequence[dict[str, Any]], compare: bool
) -> dict[str, Any]:
    """The figures of one catalogue and its needs."""
    docs = entries(servers)
    start = time.perf_counter()
    index = build_index(docs)
    build_ms = (time.perf_counter() - start) * 1000
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "mcptools"
        root.mkdir()
        (root / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":")))
        for server in servers:
            (root / server["server"]).mkdir()
        start = time.perf_counter()
        search_tools("warm up", 5, root=root)
        first_ms = (time.perf_counter() - start) * 1000
        rankers = {
            "ipybox search_tools (BM25 + WordLlama word vectors, fused; stdlib query)": ipybox_ranker(root),
            "ipybox search_tools, words only (an index built without the model)": words_only(
                docs, servers, Path(folder)
            ),
        }
        if compare:
            rankers |= alternatives(docs, servers)
        results = []
        for name, ranker in rankers.items():
            report = evaluate(name, ranker, queries)
            report["latency"] = latency(ranker, queries)
            results.append(report)
        size = (root / INDEX_FILE).stat().st_size
    return {
        "tools": len(docs),
        "servers": len(servers),
        "queries": len(queries),
        "index_build_ms": round(build_ms, 1),
        "index_bytes": size,
        "first_search_ms (reads and parses the index, in this process)": round(first_ms, 2),
        "results": results,
        "index": index,
    }


def scale(
    servers: Sequence[dict[str, Any]], queries: Sequence[dict[str, Any]], copies: int
) -> dict[str, Any]:
    """Index size, build time and latency for `copies` copies of the catalogue under other names."""
    many = [
        {**server, "server": f"{server['server']}_{copy}"} for copy in range(copies) for server in servers
    ]
    docs = entries(many)
    start = time.perf_counter()
    index = build_index(docs)
    build_ms = (time.perf_counter() - start) * 1000
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":")))
        for server in many:
            (root / server["server"]).mkdir()
        start = time.perf_counter()
        search_tools("warm up", 5, root=root)
        first_ms = (time.perf_counter() - start) * 1000
        timing = latency(ipybox_ranker(root), queries, rounds=3)
        size = (root / INDEX_FILE).stat().st_size
    return {
        "tools": len(docs),
        "index_build_ms": round(build_ms, 1),
        "index_bytes": size,
        "first_search_ms": round(first_ms, 1),
        "latency": timing,
    }


_KERNEL_CELL = """
import time
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
before = rss_mb()
start = time.perf_counter()
from ipybox.tool_exec.search import search_tools
found = search_tools('create an issue in a repository')
first_ms = (time.perf_counter() - start) * 1000
after = rss_mb()
times = []
for _ in range(50):
    start = time.perf_counter()
    search_tools('post a message to the team channel')
    times.append((time.perf_counter() - start) * 1000)
times.sort()
print(round(first_ms, 1), round(after - before, 1), round(times[25], 3), len(found))
"""


async def kernel_figures(index: dict[str, Any], servers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first search in a fresh kernel (import included) and what it adds to the kernel's memory."""
    from ipybox import CodeExecutor

    with tempfile.TemporaryDirectory() as folder:
        workspace = Path(folder)
        root = workspace / "mcptools"
        root.mkdir()
        (root / INDEX_FILE).write_text(json.dumps(index, separators=(",", ":")))
        for server in servers:
            (root / server["server"]).mkdir()
        runs = []
        for _ in range(3):
            async with CodeExecutor(working_dir=workspace) as executor:
                result = await executor.execute(_KERNEL_CELL)
            assert result.text is not None
            first, grown, median, found = result.text.split()
            runs.append((float(first), float(grown), float(median), int(found)))
    return {
        "first_search_ms_in_a_fresh_kernel (3 kernels)": [run[0] for run in runs],
        "kernel_rss_growth_mb": [run[1] for run in runs],
        "median_search_ms_in_the_kernel": [run[2] for run in runs],
    }


def show(title: str, figures: dict[str, Any]) -> None:
    print(
        f"\n== {title}: {figures['tools']} tools across {figures['servers']} servers, {figures['queries']} needs; "
        f"index built in {figures['index_build_ms']:.0f} ms, {figures['index_bytes'] / 1024:.0f} KiB"
    )
    for report in figures["results"]:
        print(f"\n{report['ranker']}")
        for split in ("dev", "test", "all"):
            r = report[split]
            print(
                f"  {split:4} ({r['queries']:3} needs): recall@1 {r['recall@1']:.3f}  recall@5 {r['recall@5']:.3f}  "
                f"MRR {r['mrr']:.3f}   no-fit needs answered empty: {r['nofit_answered_empty']}/{r['nofit_needs']}"
            )
        lat = report["latency"]
        print(
            f"  latency per search: median {lat['median_ms']} ms, p95 {lat['p95_ms']} ms, max {lat['max_ms']} ms"
        )
        print("  missed at 5:" if report["misses"] else "  missed at 5: none")
        print("\n".join(report["misses"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", action="store_true", help="also measure other rankers")
    parser.add_argument("--heldout", action="store_true", help="also measure the held-out set")
    parser.add_argument("--kernel", action="store_true", help="first search and memory in a fresh kernel")
    parser.add_argument("--scale", action="store_true", help="index size and build time for 3,000 tools")
    parser.add_argument("--mcp", action="store_true", help="also time the MCP server's search_tools")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args()
    servers, queries = load()
    figures: dict[str, Any] = {"benchmark": measure(servers, queries, args.compare)}
    show("benchmark (catalogue.json, queries.json, nofit.json)", figures["benchmark"])
    index = figures["benchmark"].pop("index")
    if args.heldout:
        heldout = load_heldout()
        if heldout is None:
            print("\n(held-out needs not written yet: heldout/needs.json is missing)")
        else:
            figures["heldout"] = measure(*heldout, args.compare)
            figures["heldout"].pop("index")
            show("held-out (heldout/catalogue.json, heldout/needs.json)", figures["heldout"])
    if args.scale:
        figures["scale"] = [scale(servers, queries, copies) for copies in (1, 10)]
        for row in figures["scale"]:
            print(
                f"\n{row['tools']} tools: index built in {row['index_build_ms']:.0f} ms, {row['index_bytes'] / 2**20:.1f} MiB, "
                f"first search {row['first_search_ms']} ms, median {row['latency']['median_ms']} ms, "
                f"p95 {row['latency']['p95_ms']} ms"
            )
    if args.kernel:
        figures["kernel"] = asyncio.run(kernel_figures(index, servers))
        print(f"\nfresh kernels: {figures['kernel']}")
    if args.mcp:
        figures["mcp_search_tools_round_trip"] = mcp = asyncio.run(mcp_latency(index, queries))
        print(
            f"\nMCP search_tools round trip (stdio, SDK client): median {mcp['median_ms']} ms, p95 {mcp['p95_ms']} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
