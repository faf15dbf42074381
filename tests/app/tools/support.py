"""Helpers shared by the tool execution tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psutil


def descendants() -> set[int]:
    """Pids of this process's living descendants, except the session-wide HTTP demo servers."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or "--transport" in child.cmdline():
                continue
        except psutil.Error:
            continue
        pids.add(child.pid)
    return pids


async def wait_until(predicate: Any, timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll a cheap condition under a deadline (for process-table checks, which have no event).

    The deadline is a backstop for a condition that never comes, not a measure of speed: a loaded
    machine may take seconds to reap a process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return bool(predicate())


def pid_alive(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return bool(process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
