"""What the framework integrations share: the version check, the approval callback, and running a
cell with the application deciding its tool calls. Application side only; no framework is imported.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Protocol

import anyio
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ipybox.app.approval import ApprovalRequest
from ipybox.app.executor import CodeExecutionChunk, CodeExecutionResult, CodeExecutor
from ipybox.app.kernels import KeptText
from ipybox.errors import CodeExecutionError

__all__ = [
    "Approve",
    "CellOutcome",
    "FrameworkVersionError",
    "check_version",
    "refuse_options_for_a_given_executor",
    "run_cell",
]


class FrameworkVersionError(ImportError):
    """The installed framework's version is outside the range an ipybox integration supports.

    Attributes:
        distribution: The framework's distribution name, e.g. ``"smolagents"``.
        installed: Its installed version.
        supported: The supported range, e.g. ``">=1.24,<2"``.
    """

    def __init__(self, distribution: str, installed: str, supported: str, extra: str) -> None:
        super().__init__(
            f"ipybox's {extra} integration supports {distribution}{supported}, but {distribution} "
            f"{installed} is installed. Install a supported version: pip install 'ipybox[{extra}]'."
        )
        self.distribution = distribution
        self.installed = installed
        self.supported = supported


def refuse_options_for_a_given_executor(
    owner: str, executor: object, policy: object, sandbox: bool, working_dir: object
) -> None:
    """Refuse executor options given together with an executor (they apply only to one `owner` makes).

    Raises:
        ValueError: Naming what to do instead.
    """
    if executor is not None and (policy is not None or sandbox or working_dir is not None):
        raise ValueError(
            f"{owner} got an executor together with policy, sandbox or working_dir, which only "
            "apply to an executor it makes: pass them to your CodeExecutor instead."
        )


def check_version(distribution: str, supported: str, extra: str) -> None:
    """Refuse an installed `distribution` outside `supported` (a PEP 440 range), naming the range.

    Raises:
        FrameworkVersionError: The installed version is outside the range.
        ImportError: The framework is not installed (the message names the extra to install).
    """
    try:
        installed = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"ipybox's {extra} integration needs {distribution}{supported}, which is not installed: "
            f"pip install 'ipybox[{extra}]'."
        ) from None
    if Version(installed) not in SpecifierSet(supported):
        raise FrameworkVersionError(distribution, installed, supported, extra)


class Approve(Protocol):
    """Decides one tool call (or shell command) that code in a cell makes, while the cell waits.

    Return ``True`` to run the call, ``False`` to reject it (the call raises in the cell, which
    carries on or fails as its code decides). A callback may be ``async`` or plain; a plain one
    runs in a worker thread, so it may block (ask a person at a terminal).
    """

    def __call__(self, request: ApprovalRequest, /) -> bool | Awaitable[bool]: ...


async def decide(request: ApprovalRequest, approve: Approve | None) -> None:
    """Accept or reject `request` as `approve` says (accept when there is no callback)."""
    if approve is None:
        await request.accept()
        return
    try:
        if inspect.iscoroutinefunction(approve) or inspect.iscoroutinefunction(type(approve).__call__):
            verdict = approve(request)
        else:
            # A plain function may block (ask a person at a terminal): not on the event loop.
            verdict = await anyio.to_thread.run_sync(approve, request)
        if inspect.isawaitable(verdict):
            verdict = await verdict
    except BaseException:
        # A callback that fails decides nothing: the call is refused and the failure raised.
        with contextlib.suppress(Exception):  # broad: the request may be decided or gone already
            await request.reject()
        raise
    if verdict is True:
        await request.accept()
    else:
        await request.reject()


@dataclass(frozen=True)
class CellOutcome:
    """What a cell did, for a model: its output (head and tail when long), images, and error.

    Attributes:
        text: The output, with a note where the middle was dropped.
        images: PNG files the cell displayed.
        error: The traceback (or timeout message) when the cell failed, else ``None``.
        ename: The exception's class name when it failed (``"TimeoutError"`` for a timeout).
        evalue: The exception's message when it failed.
    """

    text: str
    images: list[Path] = field(default_factory=list)
    error: str | None = None
    ename: str | None = None
    evalue: str | None = None

    def for_model(self) -> str:
        """The output and error as one text, ``(no output)`` when there is neither."""
        parts = [part for part in (self.text.rstrip("\n"), self.error) if part]
        return "\n".join(parts) if parts else "(no output)"


async def run_cell(
    executor: CodeExecutor, code: str, approve: Approve | None, timeout: float, max_output_chars: int
) -> CellOutcome:
    """Run `code`, handing each tool call to `approve`; output kept to `max_output_chars`."""
    output = KeptText(max_output_chars)
    result: CodeExecutionResult | None = None
    try:
        async with contextlib.aclosing(executor.stream(code, timeout=timeout, chunks=True)) as items:
            async for item in items:
                if isinstance(item, CodeExecutionChunk):
                    output.append(item.text)
                elif isinstance(item, ApprovalRequest):
                    await decide(item, approve)
                else:
                    result = item
    except CodeExecutionError as exc:
        error = exc.traceback or str(exc)
        return CellOutcome(output.text(), error=error, ename=exc.ename or "Error", evalue=exc.evalue)
    except TimeoutError:
        error = (
            f"TimeoutError: the cell ran longer than {timeout:g} s and was interrupted; the kernel keeps "
            "its state. Split the work into shorter cells or give a longer timeout."
        )
        return CellOutcome(output.text(), error=error, ename="TimeoutError", evalue=error)
    assert result is not None  # a stream that ends without raising ends with its result
    return CellOutcome(output.text(), images=list(result.images))
