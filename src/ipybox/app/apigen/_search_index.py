"""Tool search: the index over every generated package of a root folder (``mcptools/``).

Each generated package gets a ``_search.json`` with one entry per tool: what a match shows
(import line, signature, start of the description), the words it is found by (server, tool
name and title, description, parameter names and descriptions; the name counts twice) and the
text its meaning is taken from (server, name, title, description, parameters). After every generation the
index of the whole root folder is built again from those files, ranked with BM25 by ``bm25s``,
given the vectors of `ipybox.app.apigen._embedding`, and written as ``_search_index.json``, which the
kernel's stdlib-only query side (`ipybox.kernel._search`) reads. Scores depend on the whole
corpus (a word common to all tools weighs little), so the index is rebuilt across all servers,
never per server.

The packages' folders are kernel-writable, so a catalogue is used only when the application
wrote it: each one starts with an HMAC of its content under a key kept in the trusted state
folder (beside the registry), which the kernel never sees when it is sandboxed. Kernel code that
plants or edits a catalogue gets it left out, without its words ever being parsed. What the
application's own catalogues hold is bounded too (words per tool, tools and words in all), and
every value is checked for shape before it reaches the index the kernel reads; nothing trusted
acts on them. The package just generated is read first, so nothing crowds it out.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipybox.app.apigen import _codegen, _embedding
from ipybox.app.apigen._codegen._names import _field_name
from ipybox.app.sandbox import Confined, ConfinedPathError
from ipybox.kernel._search import INDEX_FILE, INDEX_VERSION, words

if TYPE_CHECKING:
    from mcp.types import Tool

CATALOGUE_FILE = "_search.json"
KEY_FILE = "search-catalogues.key"
"""The key that signs catalogues, in the trusted state folder (beside the registry file)."""
_MAX_CATALOGUE_BYTES = 32 * 1024 * 1024
# All catalogues of a root folder together (about 2 KiB per tool: over 5,000 tools).
_MAX_CATALOGUES_BYTES = 16 * 1024 * 1024
# Words per tool (a long real description has a few hundred), and in all: each distinct word
# becomes a vocabulary entry, a posting and a vector, so these bound the index's size and build.
_MAX_TOOL_WORDS = 400
_MAX_WORDS = 1_500_000
_MAX_TOOLS = 10_000
_MAX_FIELD_CHARS = 8192
_ABOUT_CHARS = 1000
_DESCRIPTION_CHARS = 240
_SIGNATURE_FIELDS = 12
_DEPRECATED = re.compile(r"\bdeprecated\b", re.IGNORECASE)

logger = logging.getLogger("ipybox.mcp_apigen")


def catalogue_key(folder: Path) -> bytes:
    """This user's key for signing catalogues, made on first use (mode ``0600``) in `folder`.

    Raises:
        OSError: The key could not be read or made.
    """
    path = folder / KEY_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f".{KEY_FILE}.{secrets.token_hex(8)}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(secrets.token_bytes(32))
        try:
            os.link(staged, path)  # the first process to make a key wins; the others read it
        except FileExistsError:
            pass
    finally:
        staged.unlink()
    return path.read_bytes()


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode("ascii")


def catalogue(
    package: str, server_name: str, tools: Sequence[Tool], modules: Sequence[str], key: bytes
) -> str:
    """The ``_search.json`` of one generated package: its HMAC under `key`, a newline, its JSON.

    Args:
        package: The import path of the root folder (``mcptools``).
        server_name: The server's package name.
        tools: The tools that were generated.
        modules: Their module names, in the same order.
        key: The catalogue key (`catalogue_key`).
    """
    entries = [
        _entry(package, server_name, tool, module) for tool, module in zip(tools, modules, strict=True)
    ]
    body = json.dumps({"version": INDEX_VERSION, "tools": entries}, ensure_ascii=False)
    return f"{_mac(key, body.encode()).decode()}\n{body}"


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
    about = " ".join([server_name, tool.name, tool.title or "", description, *parts[5:]])
    return {
        "server": server_name,
        "tool": tool.name,
        "module": module,
        "import_line": f"from {package}.{server_name} import {module}",
        "signature": _signature(module, schema, properties, tool.output_schema is not None),
        "description": description[:_DESCRIPTION_CHARS]
        + ("..." if len(description) > _DESCRIPTION_CHARS else ""),
        "text": " ".join(words(" ".join(parts))[:_MAX_TOOL_WORDS]),
        "about": about[:_ABOUT_CHARS],
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
        shown = list(
            dict.fromkeys(
                _TYPES.get(k, "Any") if isinstance(k, str) and k != "null" else "None" for k in kinds
            )
        )
        default = prop.get("default")
        # An optional parameter without a default is None until given, as its Params field is.
        if name not in required and (default is None or len(repr(default)) > 20) and "None" not in shown:
            shown.append("None")
        shown.sort(key=lambda kind: kind == "None")
        field = (
            f"{name if _codegen.is_identifier(str(name)) else _field_name(str(name))}: {' | '.join(shown)}"
        )
        if name not in required:
            field += f" = {default!r}" if default is not None and len(repr(default)) <= 20 else " = None"
        fields.append(field)
    if len(fields) > _SIGNATURE_FIELDS:
        fields = [*fields[:_SIGNATURE_FIELDS], "..."]
    returns = f"{module}.Result" if structured else "str"
    return f"{module}.run({module}.Params({', '.join(fields)})) -> {returns}"


def build_index(entries: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """The search index of `entries` (the tools of every ``_search.json``): BM25 and vectors."""
    tools: list[dict[str, Any]] = [
        {key: value for key, value in entry.items() if key not in ("text", "about")} for entry in entries
    ]
    for tool, entry in zip(tools, entries, strict=True):
        if _DEPRECATED.search(entry["about"]):
            tool["deprecated"] = True
    postings: dict[str, list[list[Any]]] = {}
    index: dict[str, Any] = {"version": INDEX_VERSION, "tools": tools, "postings": postings}
    if not entries:
        return index
    # numpy comes with it: imported only when sources are generated, never in the kernel.
    import bm25s  # type: ignore[import-untyped]  # the package has no type hints

    # bm25s sets its own logger to DEBUG on import, which shows its progress lines at any level the
    # application chose: its records follow the application's levels like any library's.
    logging.getLogger("bm25s").setLevel(logging.NOTSET)
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
    dense = _embedding.dense_section([entry["about"] for entry in entries])
    if dense is not None:
        index["dense"] = dense
    return index


def update_index(base: Confined, root: Iterable[str], key: bytes, first: str | None = None) -> None:
    """Build the index of the root folder `root` (inside `base`) from its packages' catalogues.

    Only catalogues signed with `key` are used. The package `first` (the one just generated) is
    read first; the others follow while the catalogues read stay within `_MAX_CATALOGUES_BYTES`
    and their tools and words within `_MAX_TOOLS` and `_MAX_WORDS` together.

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
    budget, words_left = _MAX_CATALOGUES_BYTES, _MAX_WORDS
    for name in names:
        relative = "/".join((*root, name, CATALOGUE_FILE))
        found, size = _read_catalogue(base, relative, min(_MAX_CATALOGUE_BYTES, budget), key)
        count = sum(len(entry["text"].split()) for entry in found)
        if len(entries) + len(found) > _MAX_TOOLS or count > words_left:
            logger.warning(
                "The tool search leaves out %s: the catalogues before it fill the index (%d tools, %d words "
                "at most).",
                relative,
                _MAX_TOOLS,
                _MAX_WORDS,
            )
            found = []
        entries.extend(found)
        budget -= size
        words_left -= count if found else 0
    data = json.dumps(build_index(entries), ensure_ascii=False, separators=(",", ":"))
    try:
        # Whatever kernel code left under the index's name (a link, a folder) goes, unfollowed.
        base.remove_tree((*root, INDEX_FILE))
        base.write_atomic("/".join((*root, INDEX_FILE)), data)
    except ConfinedPathError as exc:
        logger.warning("The tool search index was not updated: %s", exc)


_FIELDS = ("server", "tool", "module", "import_line", "signature", "description", "text", "about")


def _read_catalogue(
    base: Confined, relative: str, max_bytes: int, key: bytes
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
        mac, _, body = raw.partition(b"\n")
        if not hmac.compare_digest(mac, _mac(key, body)):
            raise ValueError("no signature of this application (generate the server's sources again)")
        data = json.loads(body)
        if data.get("version") != INDEX_VERSION:
            raise ValueError("an unknown version")
        entries = data["tools"]
        if not isinstance(entries, list) or not all(_is_entry(entry) for entry in entries):
            raise ValueError("entries that are not tools")
    except ConfinedPathError as exc:
        if not exc.missing:  # a package without a catalogue is not news
            logger.warning("The tool search leaves out %s: %s", relative, exc)
        return [], 0
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        logger.warning("The tool search leaves out %s: it holds %s.", relative, str(exc)[:200])
        return [], len(raw)
    return [{key: entry[key] for key in _FIELDS} for entry in entries], len(raw)


def _is_entry(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and all(isinstance(entry.get(key), str) and len(entry[key]) <= _MAX_FIELD_CHARS for key in _FIELDS)
        and len(entry["text"].split()) <= _MAX_TOOL_WORDS
    )
