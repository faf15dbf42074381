"""The executor: `CodeExecutor`, the one composition root of the application side.

Owns what an application holds: starting and stopping the parts below it in order, running cells
and streaming their output (``_cells``), snapshots of a kernel's namespace (``_snapshot``,
``_snapshots``), the cell results (``_results``) and the wiring of policy, gate and audit trail
into the tool server (``_oversight``).

May import (within ``ipybox.app``): ``pool``, ``kernels``, ``tools``, ``approval``, ``mcp_client``,
``sandbox``, ``_settings``, ``_tracing``.
"""

from ipybox.app.executor._executor import CodeExecutor
from ipybox.app.executor._results import CodeExecutionChunk, CodeExecutionResult
from ipybox.app.executor._snapshot import DEFAULT_MAX_SNAPSHOT_BYTES, SnapshotReport

__all__ = [
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "CodeExecutionChunk",
    "CodeExecutionResult",
    "CodeExecutor",
    "SnapshotReport",
]
