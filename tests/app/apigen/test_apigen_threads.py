"""Packages generated in several threads at once, as the MCP server's sessions register servers
together (found by benchmarks/soak_sessions.py: one registration of twenty failed)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

# private: the generator itself, many threads at once, without servers to start
from ipybox.app.apigen._generate import render_sources
from tests.app.apigen.apigen_support import tool


class _Cycle:
    """Garbage with a finalizer: a collection that frees it runs Python code, where threads switch."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        sum(range(20))


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.mark.usefixtures("frequent_switches")
def test_sources_render_in_many_threads_at_once() -> None:
    schema = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "What to look for.\nOn two lines."},
            "limit": {"type": "integer", "default": 10},
            "filters": {
                "type": "object",
                "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
            },
        },
        "required": ["query"],
    }
    tools = [tool(f"search_{i}", schema, description=f"Search, variant {i}.\nMore text.") for i in range(4)]
    expected = render_sources("pkg", tools)
    errors: list[BaseException] = []

    def render() -> None:
        for _ in range(60):
            try:
                assert render_sources("pkg", tools) == expected
            except BaseException as exc:  # collected for the assertion below, with its kind
                errors.append(exc)
                return
            for _ in range(20):
                _Cycle()

    threads = [threading.Thread(target=render) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
