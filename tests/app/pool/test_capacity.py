"""How many sessions the machine's memory allows (app/pool/_capacity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

# private-ok: unit tests of the internal rule the MCP server and the pool size themselves by.
from ipybox.app.pool._capacity import MIB, available_memory, max_sessions_for_memory


def test_available_memory_is_read_from_meminfo_and_none_where_the_system_does_not_say(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       16384000 kB\nMemFree:         1000000 kB\nMemAvailable:    8192000 kB\n"
    )
    assert available_memory(meminfo) == 8192000 * 1024
    meminfo.write_text("MemTotal:       16384000 kB\n")
    assert available_memory(meminfo) is None
    assert available_memory(tmp_path / "missing") is None
    assert (available_memory() or 1) > 0


def test_the_cap_is_what_is_left_after_the_reserve_divided_by_the_cost_of_a_session() -> None:
    gib = 1024 * MIB
    # A quarter kept: 6 GiB left of 8, 24 sessions of 256 MiB.
    assert max_sessions_for_memory(256 * MIB, available_bytes=8 * gib) == 24
    # At least 512 MiB kept: 1.5 GiB left of 2.
    assert max_sessions_for_memory(256 * MIB, available_bytes=2 * gib) == 6
    assert max_sessions_for_memory(100 * MIB, available_bytes=2 * gib, reserve_bytes=0) == 20
    # Always room for one, and a fixed answer where memory cannot be read.
    assert max_sessions_for_memory(256 * MIB, available_bytes=100 * MIB) == 1
    assert max_sessions_for_memory(256 * MIB) >= 1
    with pytest.raises(ValueError, match="positive"):
        max_sessions_for_memory(0)
