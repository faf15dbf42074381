"""What `CodeExecutor` gives back from a cell: its result, and the chunks of output while it runs.

Application side only; public as ``ipybox.CodeExecutionResult`` and ``ipybox.CodeExecutionChunk``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CodeExecutionChunk", "CodeExecutionResult"]


@dataclass(frozen=True)
class CodeExecutionResult:
    """The result of code that ran to completion.

    Attributes:
        text: The complete output text, or ``None`` if the code printed nothing.
        images: Paths of the PNG images the code displayed.
    """

    text: str | None
    images: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class CodeExecutionChunk:
    """A piece of output, yielded by `CodeExecutor.stream` with ``chunks=True``.

    Attributes:
        text: The output text of this chunk.
    """

    text: str
