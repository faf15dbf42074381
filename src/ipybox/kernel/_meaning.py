"""The tool search by meaning, on the query side (standard library only).

The index holds, besides the BM25 postings, a ``dense`` section built by the application from
WordLlama's static embeddings (`ipybox.app.apigen._embedding`): one vector per word (every lower-case
English word the model's tokenizer knows whole, and every word of the tools' texts) and one unit
vector per tool, each as base64 of signed bytes. A query's vector is the sum of its words'
vectors, exactly as the model would embed it, and a tool's closeness is the cosine of the two;
words outside the table add nothing. No numpy and no model are needed here.

Both rankings are merged by reciprocal rank fusion: each tool gets ``1 / (K + rank)`` from each
ranking it is in (the constants were chosen on the development halves of the benchmark and the held-out set).
"""

from __future__ import annotations

import base64
import binascii
import heapq
import math
import re
from array import array
from collections.abc import Mapping, Sequence
from operator import mul
from typing import Any

__all__ = ["DENSE_DIM", "DENSE_DOC_WORDS", "STOPWORDS", "WORD", "Dense", "fuse", "meaning_words", "weak"]

DENSE_DIM = 128
"""How many of the model's dimensions the index keeps (its first ones carry most of the meaning)."""
DENSE_DOC_WORDS = 40
"""How many words of a tool's name, title and description make its vector."""
_RRF_K = 20
_MEANING_WEIGHT = 0.5
_CANDIDATES = 50
# A deprecated tool counts two places further down in each ranking: it drops below a replacement
# that ranks about as well (a replacement says much the same), not below tools that fit less.
_DEPRECATED = 2
# A search whose best tool is both further than this from the query in meaning (cosine) and
# scores less than this for its words (BM25) answers nothing: "book a flight" finds no three
# unrelated tools. Chosen on the development halves of the benchmark and the held-out set.
WEAK_COSINE = 0.35
WEAK_WORDS = 3.0

_SUFFIXES = ("s", "es", "d", "ed", "ing", "ly", "er", "r")
_PLUS_128 = bytes(value ^ 0x80 for value in range(256))
# Words split at case changes and at anything that is not a letter or digit: `getFileInfo`,
# `get_file_info` and "get file info" are the same three words.
WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
STOPWORDS = frozenset(
    "a about above after again all also an and any are as at be been before being below between both "
    "but by can could did do does doing each either else etc for from further had has have having "
    "here how however i if in into is it its itself just let may me might more most must my no nor "
    "not of off on once one only or other our out over own per please same shall should so some such "
    "than that the their them then there these they this those through to too under until up upon us "
    "use used using via want was we were what when where whether which while who whom why will with "
    "within without would you your".split()
)


def meaning_words(text: str) -> list[str]:
    """The lower-case words of `text` whose vectors make its meaning (common English words left out)."""
    return [word for word in (raw.lower() for raw in WORD.findall(text)) if word not in STOPWORDS]


class Dense:
    """The ``dense`` section of an index, decoded once (the tools' vectors) and checked.

    Raises:
        ValueError: The section is not one ipybox wrote (wrong types, sizes or encodings).
    """

    def __init__(self, section: Mapping[str, Any], tools: int) -> None:
        dim, words, vectors = section["dim"], section["words"], section["tools"]
        if type(dim) is not int or dim != DENSE_DIM:
            raise ValueError("a vector size this ipybox does not write")
        if not isinstance(words, Mapping) or not isinstance(vectors, list) or len(vectors) != tools:
            raise ValueError("vectors that do not match the tools")
        self.words: Mapping[str, Any] = words
        self.count = tools
        # Python's big integers as a vector unit: column `d` of all tools' vectors packed into one
        # integer, 64 bits a tool, each value moved by 128 to be positive. A query then costs one
        # multiply-add per dimension over all tools at once, plus a correction per tool: a few
        # hundred machine words moved instead of a Python loop over every tool and dimension.
        flat = b"".join(self._decode(vector).tobytes() for vector in vectors)
        # XOR 0x80 turns a signed byte into the same value plus 128, for all of a column at once.
        self.columns = [
            int.from_bytes(
                array("I", memoryview(flat[d::DENSE_DIM].translate(_PLUS_128))).tobytes(), "little"
            )
            for d in range(DENSE_DIM)
        ]
        rows = [array("b", flat[i : i + DENSE_DIM]) for i in range(0, len(flat), DENSE_DIM)]
        self.sums = [sum(row) for row in rows]
        self.lengths = [math.sqrt(sum(map(mul, row, row))) or 1.0 for row in rows]

    @staticmethod
    def _decode(text: object) -> array[int]:
        if not isinstance(text, str):
            raise ValueError("a vector that is not text")
        try:
            raw = base64.b64decode(text, validate=True)
        except binascii.Error as exc:
            raise ValueError("a vector that is not base64") from exc
        if len(raw) != DENSE_DIM:
            raise ValueError("a vector of the wrong size")
        return array("b", raw)

    def _entries(self, word: str) -> list[Any]:
        """The table's entries that make up `word`: itself, else its stem, else two known parts.

        The table holds the words the model knows whole and the tools' words; a query's other
        words are mostly inflections ("payments", "expires") and compounds ("newsletter").
        """
        entry = self.words.get(word)
        if entry is not None:
            return [entry]
        if len(word) < 5 or not word.isalpha():
            return []
        for suffix in _SUFFIXES:
            if word.endswith(suffix) and (entry := self.words.get(word[: -len(suffix)])) is not None:
                return [entry]
        for cut in range(len(word) - 3, 2, -1):
            head, tail = self.words.get(word[:cut]), self.words.get(word[cut:])
            if head is not None and tail is not None:
                return [head, tail]
        return []

    def closeness(self, words: Sequence[str], allowed: Sequence[bool] | None) -> dict[int, float]:
        """The cosine of the query made of `words` with the closest allowed tools (all when ``None``).

        Empty when no word of the query has a vector.
        """
        query = [0.0] * DENSE_DIM
        for word in words:
            for entry in self._entries(word):
                scale, encoded = entry
                if type(scale) not in (int, float) or not 0 <= scale < 1e6:
                    raise ValueError("a word's scale that is not a number ipybox writes")
                query = [
                    total + scale * value for total, value in zip(query, self._decode(encoded), strict=True)
                ]
        norm = math.sqrt(sum(value * value for value in query))
        if not norm or not self.count:
            return {}
        # The query's values moved to 0..4095 (its direction barely changes): each tool's field,
        # sum(q' * (t + 128)), then stays below 128 * 4095 * 255 < 2**32.
        low, high = min(query), max(query)
        step = (high - low) / 4095 or 1.0
        moved = [round((value - low) / step) for value in query]
        packed = 0
        for value, column in zip(moved, self.columns, strict=True):
            if value:
                packed += value * column
        fields = array("I", packed.to_bytes(4 * self.count, "little"))
        # field - 128 * sum(q') = sum(q' * t) ~ (q - low) . t / step, so q . t ~ that * step + low * sum(t).
        shift = 128 * sum(moved)
        closeness = [
            ((field - shift) * step + low * total) / (norm * length)
            for field, total, length in zip(fields, self.sums, self.lengths, strict=True)
        ]
        docs = range(self.count) if allowed is None else [doc for doc in range(self.count) if allowed[doc]]
        return {doc: closeness[doc] for doc in heapq.nlargest(_CANDIDATES, docs, key=closeness.__getitem__)}


def fuse(
    lexical: Mapping[int, float], closeness: Mapping[int, float], deprecated: Sequence[bool]
) -> dict[int, float]:
    """Each tool's reciprocal-rank-fusion score from the word ranking and the meaning ranking."""
    fused: dict[int, float] = {}
    for scores, weight in ((lexical, 1.0), (closeness, _MEANING_WEIGHT)):
        ranked = heapq.nsmallest(_CANDIDATES, scores, key=lambda doc: (-scores[doc], doc))
        for place, doc in enumerate(ranked):
            place += _DEPRECATED if deprecated[doc] else 0
            fused[doc] = fused.get(doc, 0.0) + weight / (_RRF_K + place)
    return fused


def weak(lexical: Mapping[int, float], closeness: Mapping[int, float], best: int) -> bool:
    """Whether the best tool fits the query too little to be shown (never without vectors to tell)."""
    return bool(closeness) and lexical.get(best, 0.0) < WEAK_WORDS and closeness.get(best, 0.0) < WEAK_COSINE
