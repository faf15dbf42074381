"""Word vectors for the tool search by meaning, from WordLlama's static embedding model.

WordLlama ships its model inside its wheel: a table of one vector per token of a Llama tokenizer
(32,000 tokens, 256 dimensions trained so that the first 64 or 128 still work alone) and the
tokenizer's file. A text's vector is the sum of its tokens' vectors, so a word's vector can be
computed once and a text's is the sum of its words'. That is what lets the kernel embed a query
with the standard library alone: the index carries a table of word vectors (every lower-case
English word the tokenizer knows whole, and every word of the tools' texts) and the tools'
vectors, and the kernel adds up the vectors of the query's words (`ipybox.kernel._search`).

Nothing is downloaded: the files are read from the installed package; without it (or without
numpy, tokenizers or safetensors) the index is built without vectors and the search ranks by
words alone. The model is loaded once per process, on the first index built.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipybox.kernel._meaning import DENSE_DIM, DENSE_DOC_WORDS, meaning_words

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

logger = logging.getLogger("ipybox.mcp_apigen")

_lock = threading.Lock()
_model: _Model | None = None
_unavailable = False


class _Model:
    """The tokenizer and the first `DENSE_DIM` dimensions of the token vectors."""

    def __init__(self, tokenizer: Any, table: npt.NDArray[np.float32]) -> None:
        self.tokenizer = tokenizer
        self.table = table
        self.cache: dict[str, npt.NDArray[np.float32]] = {}
        self.general = sorted(
            token[1:]
            for token in tokenizer.get_vocab()
            if token.startswith("\u2581")
            and len(token) > 3
            and token[1:].isascii()
            and token[1:].isalpha()
            and token[1:].islower()
        )

    def vectors(self, words: Sequence[str]) -> npt.NDArray[np.float32]:
        import numpy as np

        missing = [word for word in dict.fromkeys(words) if word not in self.cache]
        if missing:
            for word, encoding in zip(
                missing,
                self.tokenizer.encode_batch([" " + word for word in missing], add_special_tokens=False),
                strict=True,
            ):
                self.cache[word] = self.table[encoding.ids].sum(axis=0)
        if not words:
            return np.zeros((0, self.table.shape[1]), dtype=np.float32)
        return np.stack([self.cache[word] for word in words])


def _load() -> _Model | None:
    global _model, _unavailable
    with _lock:
        if _model is None and not _unavailable:
            try:
                import numpy as np
                from safetensors import safe_open
                from tokenizers import Tokenizer

                # Only its files are used: importing the package itself costs ~35 MB and 0.4 s.
                spec = importlib.util.find_spec("wordllama")
                if spec is None or not spec.submodule_search_locations:
                    raise ImportError("the package wordllama is not installed")
                folder = Path(next(iter(spec.submodule_search_locations)))
                tokenizer = Tokenizer.from_file(
                    str(folder / "tokenizers" / "l2_supercat_tokenizer_config.json")
                )
                with safe_open(
                    str(folder / "weights" / "l2_supercat_256.safetensors"), framework="np"
                ) as file:
                    table = np.asarray(file.get_tensor("embedding.weight")[:, :DENSE_DIM], dtype=np.float32)
                _model = _Model(tokenizer, table)
            except Exception as exc:  # an optional model that fails in any way leaves the words
                _unavailable = True
                logger.warning(
                    "The tool search ranks by words only: the embedding model is not usable (%s).", exc
                )
    return _model


def dense_section(texts: Sequence[str]) -> dict[str, Any] | None:
    """The vectors part of an index for tools described by `texts`, or ``None`` without the model.

    Returns:
        ``{"dim", "words", "tools"}``: each word's vector as ``[scale, base64 of signed bytes]``
        (its largest value at 127) and each tool's vector as base64 of signed bytes (its largest value at 127).
    """
    model = _load()
    if model is None:
        return None
    import numpy as np

    docs = [meaning_words(text)[:DENSE_DOC_WORDS] for text in texts]
    vocabulary = sorted(set(model.general).union(*docs))
    # Each word weighs by how rare it is among the tools (inverse document frequency), in the tools'
    # vectors and in queries alike: "list" or "get" says little about which tool is meant.
    frequency: dict[str, int] = {}
    for words in docs:
        for word in set(words):
            frequency[word] = frequency.get(word, 0) + 1
    weights = np.array([math.log((len(docs) + 1) / (frequency.get(word, 0) + 1)) + 1 for word in vocabulary])
    table = model.vectors(vocabulary) * weights[:, None].astype(np.float32)
    rows = {word: i for i, word in enumerate(vocabulary)}
    tools: list[str] = []
    for words in docs:
        vector = table[[rows[word] for word in words]].sum(axis=0) if words else np.zeros(DENSE_DIM)
        # Its largest value at 127 (the kernel divides by its length): the most of the byte's range.
        largest = float(np.abs(vector).max()) if words else 0.0
        tools.append(_pack(vector / largest * 127 if largest else vector))
    return {
        "dim": DENSE_DIM,
        "words": {word: _word(table[i]) for i, word in enumerate(vocabulary)},
        "tools": tools,
    }


def _word(vector: npt.NDArray[Any]) -> list[Any]:
    import numpy as np

    # Each word at its own scale: one scale for all would leave common words (low weights) a few
    # steps of the byte's range.
    scale = float(np.abs(vector).max()) / 127 if vector.size else 0.0
    return [scale, _pack(vector / scale if scale else vector)]


def _pack(vector: npt.NDArray[Any]) -> str:
    import numpy as np

    return base64.b64encode(np.clip(np.rint(vector), -127, 127).astype(np.int8).tobytes()).decode("ascii")
