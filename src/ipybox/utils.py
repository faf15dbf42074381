"""Small helpers shared by applications and ipybox itself."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def arun(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a blocking callable in a worker thread and await its result.

    Use it from async code for calls that would otherwise block the event loop, such as
    ``input()`` when asking a person to approve a tool call.

    Args:
        func: The blocking callable.
        *args: Positional arguments for ``func``.
        **kwargs: Keyword arguments for ``func``.

    Returns:
        What ``func`` returns.

    Raises:
        Exception: Whatever ``func`` raises is re-raised unchanged.
    """
    return await asyncio.to_thread(functools.partial(func, *args, **kwargs))
