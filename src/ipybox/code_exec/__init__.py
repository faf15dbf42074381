"""The code executor: `CodeExecutor`, its results and chunks.

A public import path; the code lives in ``ipybox.app.executor``.
"""

from ipybox.app.executor import (
    CodeExecutionChunk,
    CodeExecutionResult,
    CodeExecutor,
)
from ipybox.errors import CodeExecutionError

__all__ = [
    "CodeExecutionChunk",
    "CodeExecutionError",
    "CodeExecutionResult",
    "CodeExecutor",
]
