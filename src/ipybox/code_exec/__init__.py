"""The code executor: `CodeExecutor`, its results and chunks.

A public import path; the code lives in ``ipybox.app.executor._executor``.
"""

from ipybox.app.executor._executor import (
    CodeExecutionChunk,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
)

__all__ = [
    "CodeExecutionChunk",
    "CodeExecutionError",
    "CodeExecutionResult",
    "CodeExecutor",
]
