"""Tool search over the generated ``mcptools/``: the query side (standard library only).

`generate_mcp_sources` describes every generated tool (its server, name, title, description,
parameter names and descriptions) and writes ``<root_dir>/_search_index.json``: for each word,
the tools it occurs in and the BM25 score it adds for each (ranked with ``bm25s`` in the
application), and the vectors that rank by meaning (`ipybox.kernel._meaning`). A query is split
into words the same way (`words`, one definition for both sides); the tools' BM25 scores for
those words are added up, which is how ``bm25s`` itself answers a query, the query's meaning is
compared with each tool's, and both rankings are fused. The kernel needs neither ``bm25s``,
``numpy`` nor the model for it.

The index sits beside the generated code, where kernel code may change it: it is a convenience
for the agent, not something the application trusts. The application's own reads of it (the MCP
server's ``search_tools``) go through its confined file module and treat it as untrusted data;
every value is checked, and one that is not what ipybox writes is a `ToolSearchError`.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipybox.errors import ToolSearchError
from ipybox.kernel._meaning import STOPWORDS, WORD, Dense, fuse, meaning_words, weak

__all__ = [
    "INDEX_FILE",
    "MAX_LIMIT",
    "MAX_QUERY_CHARS",
    "ToolMatch",
    "check_query",
    "rank",
    "search_tools",
    "words",
]

INDEX_FILE = "_search_index.json"
"""The index's file name in the root folder of the generated packages (``mcptools/``)."""
INDEX_VERSION = 2
MAX_QUERY_CHARS = 1000
"""The longest query accepted: a need described in a few sentences, not a document."""
MAX_LIMIT = 50
"""The most matches one search returns."""


def words(text: str) -> list[str]:
    """The words of `text` as the index and the queries see them.

    Split at case changes and punctuation, lower-cased, without common English words, and
    with plural and ``-ing``/``-ed`` endings removed (``listing files`` and ``list_file`` match).
    """
    found: list[str] = []
    for raw in WORD.findall(text):
        word = raw.lower()
        if word not in STOPWORDS:
            found.append(_stem(word))
    return found


def _stem(word: str) -> str:
    """A light English stemmer: plurals, ``-ing`` and ``-ed``, then a final ``e``."""
    if len(word) <= 3 or word.isdigit():
        return word
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith("sses"):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    for suffix in ("ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            # running -> runn -> run, but filling -> fill
            if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "aeiouslz":
                word = word[:-1]
            break
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


@dataclass(frozen=True)
class ToolMatch:
    """One tool found by `search_tools`.

    Attributes:
        server: The MCP server's package name (``github``).
        tool: The tool's name on the MCP server (``create_issue``).
        module: The generated module's name.
        import_line: The line that imports the module (``from mcptools.github import create_issue``).
        signature: How it is called, with the fields of its ``Params``.
        description: The start of the tool's description.
        score: How well it fits, fused from the word and the meaning rankings (higher is
            better; comparable within one search only).
    """

    server: str
    tool: str
    module: str
    import_line: str
    signature: str
    description: str
    score: float

    def __str__(self) -> str:
        # Three lines whatever the names hold: control characters (a newline, a terminal
        # escape) in a server's tool name or description are shown escaped.
        name, description, import_line, signature = (
            _printable(text)
            for text in (f"{self.server}.{self.tool}", self.description, self.import_line, self.signature)
        )
        return f"{name}: {description}\n    {import_line}\n    {signature}"


def _printable(text: str) -> str:
    return text if text.isprintable() else repr(text)[1:-1]


def check_query(query: object, limit: object) -> tuple[str, int]:
    """`query` and `limit` checked, as a search takes them.

    Raises:
        ToolSearchError: The query is not a non-empty string of at most `MAX_QUERY_CHARS`
            characters, or `limit` is not a whole number from 1 to `MAX_LIMIT`.
    """
    if not isinstance(query, str) or not query.strip():
        raise ToolSearchError(
            f"The query must be a non-empty string describing what the tool should do, not {query!r}; "
            "e.g. 'create an issue in a repository'."
        )
    if len(query) > MAX_QUERY_CHARS:
        raise ToolSearchError(
            f"The query has {len(query)} characters; describe the need in at most {MAX_QUERY_CHARS}."
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ToolSearchError(f"limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}.")
    return query, limit


def rank(
    index: Mapping[str, Any], query: str, limit: int = 5, *, present: Container[str] | None = None
) -> list[ToolMatch]:
    """The `limit` best tools of a parsed `index` for `query`, best first.

    Args:
        index: The parsed content of an index file.
        query: What the tool should do, in words.
        limit: How many matches at most.
        present: The servers whose package is still there (all when ``None``): a package
            deleted since the index was built is left out.

    Raises:
        ToolSearchError: The query or limit is invalid (see `check_query`), or `index` is not an
            index this version of ipybox wrote.
    """
    query, limit = check_query(query, limit)
    try:
        prepared = _prepare(index)
        allowed = [server in present for server in prepared.servers] if present is not None else None
        lexical = prepared.lexical(words(query), allowed)
        closeness = prepared.dense.closeness(meaning_words(query), allowed) if prepared.dense else {}
        fused = fuse(lexical, closeness, prepared.deprecated)
        best = heapq.nlargest(limit, fused.items(), key=lambda item: (item[1], -item[0]))
        if not best or weak(lexical, closeness, best[0][0]):
            return []
        return [_match(prepared.tools[doc], score) for doc, score in best]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ToolSearchError(
            f"The tool search index is not one this ipybox wrote ({type(exc).__name__}): generate the "
            "sources of an MCP server again to rebuild it."
        ) from None


class _Prepared:
    """What a search needs of a parsed index, checked once: a value ipybox does not write raises.

    The postings of a word are checked the first time a query uses the word.
    """

    def __init__(self, index: Mapping[str, Any]) -> None:
        if index.get("version") != INDEX_VERSION:
            raise ValueError("unknown version")
        self.tools: list[Any] = index["tools"]
        self.postings: Mapping[str, Any] = index["postings"]
        if not isinstance(self.tools, list) or not isinstance(self.postings, Mapping):
            raise ValueError("tools or postings of the wrong type")
        self.servers = [tool["server"] for tool in self.tools]
        if not all(isinstance(server, str) for server in self.servers):
            raise TypeError("a tool entry is not made of strings")
        self.deprecated = [tool.get("deprecated") is True for tool in self.tools]
        section = index.get("dense")
        if section is not None and not isinstance(section, Mapping):
            raise ValueError("vectors that are not a mapping")
        self.dense = Dense(section, len(self.tools)) if section is not None else None
        self.checked: set[str] = set()

    def lexical(self, query: list[str], allowed: Sequence[bool] | None) -> dict[int, float]:
        """Each allowed tool's BM25 score for the query's words (only tools with a score)."""
        scores: dict[int, float] = {}
        count = len(self.tools)
        for word in query:
            entry = self.postings.get(word)
            if entry is None:
                continue
            docs, values = entry
            if word not in self.checked:
                # bool is an int, a 400-digit int overflows a float, NaN or infinity would rank anywhere.
                for doc, score in zip(docs, values, strict=True):
                    if type(doc) is not int or not 0 <= doc < count or type(score) not in (int, float):
                        raise ValueError("a posting that is not a tool and a score")
                    if not math.isfinite(score):
                        raise ValueError("a score that is not a finite number")
                self.checked.add(word)
            for doc, score in zip(docs, values, strict=True):
                scores[doc] = scores.get(doc, 0.0) + score
        if allowed is not None:
            return {doc: score for doc, score in scores.items() if score > 0 and allowed[doc]}
        return {doc: score for doc, score in scores.items() if score > 0}


# The last index prepared: checking it and decoding its vectors costs more than a search.
_prepared: list[tuple[Mapping[str, Any], _Prepared]] = []


def _prepare(index: Mapping[str, Any]) -> _Prepared:
    if _prepared and _prepared[0][0] is index:
        return _prepared[0][1]
    prepared = _Prepared(index)
    _prepared[:] = [(index, prepared)]
    return prepared


def _match(tool: Mapping[str, Any], score: float) -> ToolMatch:
    values = {name: tool[name] for name in _FIELDS}
    if not all(isinstance(value, str) for value in values.values()):
        raise TypeError("a tool entry is not made of strings")
    return ToolMatch(**values, score=round(score, 6))


_FIELDS = ("server", "tool", "module", "import_line", "signature", "description")


_cache: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def search_tools(query: str, limit: int = 5, root: str | os.PathLike[str] = "mcptools") -> list[ToolMatch]:
    """Find the generated tools that fit a need, best first.

    Searches the servers, names, descriptions and parameters of every tool generated in
    `root` (by `generate_mcp_sources` or the MCP server's ``register_mcp_server``). Each match
    has the line that imports the tool and how it is called, so only the modules you use need
    reading; ``print(match)`` shows all of it.

    Args:
        query: What the tool should do, in words ("create an issue in a repository").
        limit: How many matches at most, from 1 to 50.
        root: The folder of the generated packages (the working directory's ``mcptools``).

    Returns:
        Up to `limit` matches, best first; ``[]`` when no tool fits: none shares a word with
        the query and none comes close to it in meaning.

    Raises:
        ToolSearchError: The query or limit is invalid, or `root` has no index (no sources were
            generated there yet) or a damaged one.
    """
    query, limit = check_query(query, limit)
    path = Path(root) / INDEX_FILE
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            key = (info.st_ino, info.st_mtime_ns, info.st_size)
            cached = _cache.get(str(path))
            if cached is not None and cached[0] == key:
                index = cached[1]
            else:
                index = json.loads(file.read())
                _cache.clear()
                _cache[str(path)] = (key, index)
    except FileNotFoundError:
        raise ToolSearchError(
            f"There is no tool search index in {str(root)!r}: generate the sources of an MCP server there "
            "first (generate_mcp_sources, or the register_mcp_server tool); each generation updates it."
        ) from None
    except (OSError, ValueError) as exc:
        raise ToolSearchError(
            f"The tool search index {str(path)!r} cannot be read ({exc}): generate the sources of an MCP "
            "server again to rebuild it."
        ) from None
    if not isinstance(index, dict):
        raise ToolSearchError(
            f"The tool search index {str(path)!r} is damaged: generate the sources of an MCP server again."
        )
    try:
        present = {entry.name for entry in os.scandir(root) if entry.is_dir()}
    except OSError:
        present = set()
    return rank(index, query, limit, present=present)
