"""How many sessions (or pooled kernels) the machine's memory allows.

One rule, used by the MCP server for its default ``--max-sessions`` and by the kernel pool for
its size: take the memory the kernel says is available for new work (``MemAvailable`` in
``/proc/meminfo``: free memory plus the caches it can drop), keep a reserve of it for the rest of
the machine, and divide what is left by what one session costs. The MCP server reads the figure
once, when it starts; the pool reads it each time it would start a kernel ahead of need.
"""

from __future__ import annotations

from pathlib import Path

MIB = 1024 * 1024

SESSION_BYTES = 256 * MIB
"""What one MCP session is budgeted. Measured with psutil as the PSS of the server's process tree
(``ipybox --transport streamable-http``, not sandboxed, on a 2-core Linux machine): an idle
session, its gateway and kernel, takes about 77 MB; importing numpy and holding a 32 MB array
added 37 MB. 256 MiB, about three idle sessions, leaves room for ordinary data work; a session
that loads more takes more, which the reserve absorbs for a few of them."""

MIN_RESERVE_BYTES = 512 * MIB
"""The least memory left to everything else (the server, the system, other programs)."""

RESERVE_FRACTION = 0.25
"""The share of available memory left to everything else, when it is more than `MIN_RESERVE_BYTES`."""

POOLED_KERNEL_BYTES = 128 * MIB
"""What one ready kernel of a `KernelPool` is budgeted: an idle pooled kernel measured 36 MB PSS
unsandboxed and 62 MB sandboxed (its srt and helpers included, benchmarks/pool.txt); the rest is
room for the first imports of the session that takes it."""

_MEMINFO = Path("/proc/meminfo")


def available_memory(meminfo: Path = _MEMINFO) -> int | None:
    """The memory available for new work, in bytes (``MemAvailable``), or `None` where the
    system does not say (not Linux, or a kernel older than 3.14)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            amount, _, unit = value.strip().partition(" ")
            if amount.isdigit():
                return int(amount) * (1024 if unit.strip().lower() == "kb" else 1)
    return None


def max_sessions_for_memory(
    per_session_bytes: int = SESSION_BYTES,
    *,
    available_bytes: int | None = None,
    reserve_bytes: int | None = None,
    unknown: int = 32,
) -> int:
    """How many sessions of `per_session_bytes` each the available memory holds; at least 1.

    ``(available - reserve) // per_session_bytes``, where `available` is `available_bytes` or,
    if not given, ``MemAvailable`` read now, and `reserve` is `reserve_bytes` or, if not given,
    a quarter of the available memory but at least 512 MiB. With 8 GiB available and the default
    256 MiB per session, that is 24 sessions; with 2 GiB, 6.

    Args:
        per_session_bytes: What one session (or pooled kernel) costs.
        available_bytes: The available memory; read from ``/proc/meminfo`` if `None`.
        reserve_bytes: Memory kept for everything else.
        unknown: The answer where the available memory cannot be read (not Linux).

    Raises:
        ValueError: If `per_session_bytes` is not positive.
    """
    if per_session_bytes <= 0:
        raise ValueError(f"per_session_bytes must be a positive number of bytes, not {per_session_bytes}.")
    available = available_memory() if available_bytes is None else available_bytes
    if available is None:
        return unknown
    reserve = (
        max(MIN_RESERVE_BYTES, int(available * RESERVE_FRACTION)) if reserve_bytes is None else reserve_bytes
    )
    return max(1, (available - reserve) // per_session_bytes)


def memory_allows(needed_bytes: int, *, available_bytes: int | None = None) -> bool:
    """Whether `needed_bytes` more fit in the available memory (read now if `available_bytes` is
    `None`) after the same reserve as `max_sessions_for_memory` keeps; `True` where the system
    does not say."""
    available = available_memory() if available_bytes is None else available_bytes
    if available is None:
        return True
    return available - max(MIN_RESERVE_BYTES, int(available * RESERVE_FRACTION)) >= needed_bytes
