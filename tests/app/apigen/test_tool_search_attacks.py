"""Attacks on the tool search index: what kernel code writes into ``mcptools/`` against the trusted
side that builds the index (``generate_mcp_sources``) and the readers that rank it.

The hostile files are written by code running in a real kernel; the generation whose memory is
measured runs in a process of its own, so that its peak is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from ipybox import CodeExecutor, generate_mcp_sources

# Private: the index file that hostile code damages, the MCP server's search (the trusted side's
# reader) called without an MCP round trip, and the helpers of the tool search's own tests.
from ipybox.kernel._search import INDEX_FILE
from ipybox.mcp_server import _search
from tests.app.apigen.test_tool_search import FORECAST, ISSUES, _found, _params

# What a kernel runs to plant a catalogue of 1.85 million distinct words (15.5 MB) beside the
# generated packages, copied in form from one the application wrote.
_PLANT = """
import json, os
real = open('mcptools/work/_search.json').read()
head, data = real[: real.index('{')], json.loads(real[real.index('{') :])
entry = dict(data['tools'][0], server='planted', tool='PLANTED')
entry['text'] = ' '.join(f'w{i}' for i in range(1_850_000))
data['tools'] = [entry]
os.makedirs('mcptools/planted', exist_ok=True)
with open('mcptools/planted/_search.json', 'w') as file:
    file.write(head + json.dumps(data))
print(os.path.getsize('mcptools/planted/_search.json'))
"""

# The generation, in a child process that reports its peak memory (kB) and what the index holds.
_GENERATE = """
import asyncio, json, sys, tracemalloc
from ipybox import generate_mcp_sources
root, params = sys.argv[1], json.loads(sys.argv[2])
tracemalloc.start()
asyncio.run(generate_mcp_sources('work', params, root))
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
index = json.load(open(root + '/_search_index.json'))
print(json.dumps({'peak_kb': peak // 1024,
                  'planted': any(tool['tool'] == 'PLANTED' for tool in index['tools'])}))
"""


def _generate(root: Path, params: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _GENERATE, str(root), json.dumps(params)],
        capture_output=True,
        text=True,
        timeout=110,
    )


@pytest.mark.slow  # a 15.5 MB catalogue written by a kernel, and a generation in a process of its own
async def test_a_catalogue_a_kernel_planted_neither_reaches_the_index_nor_costs_the_generation_memory(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "workspace"
    root = workspace / "mcptools"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), root)
    async with CodeExecutor(working_dir=workspace) as executor:
        planted = await executor.execute(_PLANT)
    assert planted.text is not None and int(planted.text) > 15_000_000
    child = await anyio.to_thread.run_sync(_generate, root, _params(tmp_path, "work", [ISSUES, FORECAST]))
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["planted"] is False
    # What the generation allocates in Python (tracemalloc: the same figure whatever else the
    # machine runs, unlike the process's resident memory, which native libraries' threads and
    # arenas move by hundreds of MB): about 66 MB with the planted file read and refused; its words
    # turned into a vocabulary and postings took over 1 GB before catalogues had to be signed.
    assert report["peak_kb"] < 150_000, report
    assert "planted/_search.json" in child.stderr
    assert _found("weather forecast for a city", root, limit=1) == ["work.get-forecast"]


async def test_a_damaged_index_is_refused_with_the_search_error_in_the_kernel_and_by_the_mcp_server(
    tmp_path: Path,
) -> None:
    """Kernel code rewrites the index with values no generation writes: a score of 400 digits, one
    that is not a number, a tool entry with a wrong field, a posting that names no tool. Each search,
    in the kernel and by the trusted side, answers with ToolSearchError, never another exception."""
    workspace = tmp_path / "workspace"
    root = workspace / "mcptools"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES, FORECAST]), root)
    index = json.loads((root / INDEX_FILE).read_text())
    word, (docs, _scores) = next(iter(index["postings"].items()))
    damaged: list[str] = []
    for scores in ([int("9" * 400)] * len(docs), ["1e400"] * len(docs), [float("nan")] * len(docs)):
        damaged.append(json.dumps(index | {"postings": {word: [docs, scores]}}))
    damaged.append(json.dumps(index | {"postings": {word: [[10**6], [1.0]]}}))
    damaged.append(json.dumps(index | {"tools": [{**index["tools"][0], "signature": 7}]}))
    code = (
        "import json\n"
        "from ipybox.tool_exec.search import search_tools, ToolSearchError\n"
        f"for text in {damaged!r}:\n"
        f"    open('mcptools/{INDEX_FILE}', 'w').write(text)\n"
        "    try:\n"
        f"        search_tools({word!r})\n"
        "    except ToolSearchError as exc:\n"
        "        print('refused:', str(exc)[:60])\n"
        "    except Exception as exc:\n"
        "        print('raised', type(exc).__name__, exc)\n"
        "    else:\n"
        "        print('answered')\n"
    )
    async with CodeExecutor(working_dir=workspace) as executor:
        result = await executor.execute(code)
    assert result.text is not None
    lines = result.text.splitlines()
    assert len(lines) == len(damaged) and all(line.startswith("refused:") for line in lines), lines
    for text in damaged:
        (root / INDEX_FILE).write_text(text)
        try:
            _search.search(workspace, "mcptools", word, 5)
        except Exception as exc:
            assert type(exc).__name__ == "ToolSearchError", repr(exc)
        else:
            raise AssertionError(f"the MCP server's search answered from a damaged index: {text[:200]}")
