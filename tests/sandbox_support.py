"""Whether the sandbox can run here: tests that need it skip with the reason, or fail on CI."""

from __future__ import annotations

import os

import pytest

from ipybox.app import _sandbox  # private: where srt is found, to skip with the reason when it is not
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
