"""What the ``ipybox`` command tells the person who started it: on stderr, since over stdio
stdout carries the MCP messages."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


def announce(message: str) -> None:
    """Write ``ipybox: <message>`` to stderr at once."""
    print(f"ipybox: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """Announce that `what` is starting, and when it is ready, with the time it took (nothing
    more if it fails: the failure is reported by whoever catches it)."""
    announce(f"starting {what} ...")
    started = time.monotonic()
    yield
    announce(f"{what} is ready ({time.monotonic() - started:.1f} s)")
