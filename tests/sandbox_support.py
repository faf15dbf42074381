"""Whether the sandbox can run here: tests that need it skip with the reason, or fail on CI."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipybox import ApprovalRequest, CodeExecutionError, CodeExecutionResult, CodeExecutor
from ipybox.app import (
    sandbox as _sandbox,
)  # private: where srt is found, to skip with the reason when it is not
from ipybox.errors import SandboxUnavailableError


def sandbox_missing() -> str | None:
    """Why ``sandbox=True`` cannot start on this machine, or ``None`` if it can."""
    try:
        _sandbox.find_srt()
    except SandboxUnavailableError as exc:
        return str(exc)
    return None


def require_sandbox() -> None:
    """Skip the calling test when the sandbox's tools are missing; on CI (``CI`` set), fail instead.

    CI installs them (``scripts/setup.sh`` as root), so a skip there would hide a broken set-up.
    """
    reason = sandbox_missing()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the sandbox tests, but: {reason}")
    pytest.skip(f"the sandbox cannot run here: {reason}")


def sandboxed_workdir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A module's working folder for sandboxed executors, with ``IPYBOX_STATE_DIR`` pointing at a
    registry of its own while the module runs (for a module-scoped fixture: ``yield from``)."""
    require_sandbox()
    path = tmp_path_factory.mktemp(name)
    saved = os.environ.get("IPYBOX_STATE_DIR")
    os.environ["IPYBOX_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("IPYBOX_STATE_DIR", None)
        else:
            os.environ["IPYBOX_STATE_DIR"] = saved


async def attack(ex: CodeExecutor, code: str) -> tuple[list[dict[str, object]], str]:
    """Run `code`, rejecting whatever is asked; what was asked and the cell's output or error."""
    asked: list[dict[str, object]] = []
    text = ""
    try:
        async for item in ex.stream(code, timeout=60):
            if isinstance(item, ApprovalRequest):
                asked.append(item.tool_args)
                await item.reject()
            elif isinstance(item, CodeExecutionResult):
                text = item.text or ""
    except CodeExecutionError as exc:
        text = str(exc)
    return asked, text


def numbered_folders(root: Path) -> Callable[[], Path]:
    """A pool's `new_folder`: a new folder ``s0``, ``s1``, ... in `root` at each call."""
    names = iter(range(1_000_000))

    def new_folder() -> Path:
        folder = root / f"s{next(names)}"
        folder.mkdir()
        return folder

    return new_folder
