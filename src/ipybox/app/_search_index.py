"""Tool search: the index over every generated package of a root folder (``mcptools/``).

Each generated package gets a ``_search.json`` with one entry per tool: what a match shows
(import line, signature, start of the description) and the words it is found by (server, tool
name and title, description, parameter names and descriptions; the name counts twice). After
every generation the index of the whole root folder is built again from those files, ranked
with BM25 by ``bm25s``, and written as ``_search_index.json``, which the kernel's stdlib-only
query side (`ipybox.kernel._search`) reads. Scores depend on the whole corpus (a word common to
all tools weighs little), so the index is rebuilt across all servers, never per server.

The other packages' ``_search.json`` files are kernel-writable data: they are read through the
confined file module, capped in size (each, and all together: kernel code that plants many
packages cannot make a generation read without bound), checked for shape, and only ever written
back into the index the kernel reads; nothing trusted acts on them. A file that does not pass is
skipped. The package just generated is read first, so planted ones never crowd it out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ipybox.app import _codegen, _confined
from ipybox.app._codegen._names import _field_name
from ipybox.kernel._search import INDEX_FILE, INDEX_VERSION, words

if TYPE_CHECKING:
    from mcp.types import Tool

CATALOGUE_FILE = "_search.json"
_MAX_CATALOGUE_BYTES = 32 * 1024 * 1024
# All catalogues of a root folder together (about 1 KiB per tool: over 10,000 tools), as much as the
# MCP server's search reads of the index built from them.
_MAX_CATALOGUES_BYTES = 16 * 1024 * 1024
_DESCRIPTION_CHARS = 240
_SIGNATURE_FIELDS = 12

logger = logging.getLogger("ipybox.mcp_apigen")


def catalogue(package: str, server_name: str, tools: Sequence[Tool], modules: Sequence[str]) -> str:
    """The ``_search.json`` of one generated package.

    Args:
        package: The import path of the root folder (``mcptools``).
        server_name: The server's package name.
        tools: The tools that were generated.
        modules: Their module names, in the same order.
    """
    entries = [
        _entry(package, server_name, tool, module) for tool, module in zip(tools, modules, strict=True)
    ]
    return json.dumps({"version": INDEX_VERSION, "tools": entries}, ensure_ascii=False)


def _entry(package: str, server_name: str, tool: Tool, module: str) -> dict[str, str]:
    schema = tool.input_schema if isinstance(tool.input_schema, Mapping) else {}
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    description = " ".join((tool.description or "").split())
    parts = [server_name, tool.name, tool.name, tool.title or "", tool.description or ""]
    for name, prop in properties.items():
        parts.append(str(name))
        if isinstance(prop, Mapping) and isinstance(prop.get("description"), str):
            parts.append(prop["description"])
    return {
        "server": server_name,
        "tool": tool.name,
        "module": module,
        "import_line": f"from {package}.{server_name} import {module}",
        "signature": _signature(module, schema, properties, tool.output_schema is not None),
        "description": description[:_DESCRIPTION_CHARS]
        + ("..." if len(description) > _DESCRIPTION_CHARS else ""),
        "text": " ".join(words(" ".join(parts))),
    }


_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
}


def _signature(
    module: str, schema: Mapping[str, Any], properties: Mapping[str, Any], structured: bool
) -> str:
    required = schema.get("required")
    required = set(required) if isinstance(required, list) else set()
    fields: list[str] = []
    for name in sorted(properties, key=lambda key: key not in required):
        prop = properties[name] if isinstance(properties[name], Mapping) else {}
        kind = prop.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        shown = " | ".join(_TYPES.get(k, "Any") if isinstance(k, str) else "Any" for k in kinds)
        field = f"{name if _codegen.is_identifier(str(name)) else _field_name(str(name))}: {shown}"
        if name not in required:
            default = prop.get("default")
            field += f" = {default!r}" if default is not None and len(repr(default)) <= 20 else " = None"
        fields.append(field)
    if len(fields) > _SIGNATURE_FIELDS:
        fields = [*fields[:_SIGNATURE_FIELDS], "..."]
    returns = f"{module}.Result" if structured else "str"
    return f"{module}.run({module}.Params({', '.join(fields)})) -> {returns}"


def build_index(entries: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """The search index of `entries` (the tools of every ``_search.json``), ranked with BM25."""
    tools = [{key: value for key, value in entry.items() if key != "text"} for entry in entries]
    postings: dict[str, list[list[Any]]] = {}
    if entries:
        # numpy comes with it: imported only when sources are generated, never in the kernel.
        import bm25s  # type: ignore[import-untyped]  # the package has no type hints

        retriever = bm25s.BM25()
        retriever.index([entry["text"].split() or [""] for entry in entries], show_progress=False)
        scores = retriever.scores
        data, indices, indptr = (
            scores["data"].astype("float64").round(4).tolist(),
            scores["indices"].tolist(),
            scores["indptr"].tolist(),
        )
        for word, column in retriever.vocab_dict.items():
            # The empty word bm25s adds for empty documents may have no column of its own.
            if not word or column + 1 >= len(indptr):
                continue
            start, end = indptr[column], indptr[column + 1]
            if start < end:
                postings[word] = [indices[start:end], data[start:end]]
    return {"version": INDEX_VERSION, "tools": tools, "postings": postings}


def update_index(base: _confined.Confined, root: Iterable[str], first: str | None = None) -> None:
    """Build the index of the root folder `root` (inside `base`) from its packages' catalogues.

    The package `first` (the one just generated) is read first; the others follow while the
    catalogues read stay within `_MAX_CATALOGUES_BYTES` together.

    Kernel code that keeps the index's name taken (a link put back between its removal and the
    write) only gets a logged warning: the generated package stays as written.

    Raises:
        ConfinedPathError: The root folder is a link.
        OSError: The index could not be written.
    """
    root = tuple(root)
    entries: list[Mapping[str, str]] = []
    names = [name for name in base.listdir(root) if _codegen.is_identifier(name)]
    if first in names:
        names.remove(first)
        names.insert(0, first)
    budget = _MAX_CATALOGUES_BYTES
    for name in names:
        found, size = _read_catalogue(
            base, "/".join((*root, name, CATALOGUE_FILE)), min(_MAX_CATALOGUE_BYTES, budget)
        )
        entries.extend(found)
        budget -= size
    data = json.dumps(build_index(entries), ensure_ascii=False, separators=(",", ":"))
    try:
        # Whatever kernel code left under the index's name (a link, a folder) goes, unfollowed.
        base.remove_tree((*root, INDEX_FILE))
        base.write_atomic("/".join((*root, INDEX_FILE)), data)
    except _confined.ConfinedPathError as exc:
        logger.warning("The tool search index was not updated: %s", exc)


_FIELDS = ("server", "tool", "module", "import_line", "signature", "description", "text")


def _read_catalogue(
    base: _confined.Confined, relative: str, max_bytes: int
) -> tuple[list[Mapping[str, str]], int]:
    """The entries of one catalogue and the bytes read; none for a file that does not pass."""
    if max_bytes <= 0:
        logger.warning(
            "The tool search leaves out %s: the catalogues read before it fill the budget.", relative
        )
        return [], 0
    raw = b""
    try:
        raw = base.read_bytes(relative, max_bytes)
        data = json.loads(raw)
        if data.get("version") != INDEX_VERSION:
            raise ValueError("an unknown version")
        entries = data["tools"]
        if not isinstance(entries, list) or not all(
            isinstance(entry, dict) and all(isinstance(entry.get(key), str) for key in _FIELDS)
            for entry in entries
        ):
            raise ValueError("entries that are not tools")
    except _confined.ConfinedPathError as exc:
        if not exc.missing:  # a package without a catalogue is not news
            logger.warning("The tool search leaves out %s: %s", relative, exc)
        return [], 0
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        logger.warning("The tool search leaves out %s: it holds %s.", relative, str(exc)[:200])
        return [], len(raw)
    return [{key: entry[key] for key in _FIELDS} for entry in entries], len(raw)
