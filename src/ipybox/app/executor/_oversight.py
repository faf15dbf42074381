"""What the application keeps over an executor's tool calls: policy rules, audit trail, trace spans.

Application side only: the kernel can neither read nor change any of it. `CodeExecutor` makes one
`Oversight`; each session it opens has a `Gate` (`ipybox.app.approval._gate`: the rules, what the
session remembers, the trail), which `CodeExecutor` gives the new tool server with the tracing when
it makes it (its decision chain applies them); the spans come from `ipybox.app._tracing` (imported
only when tracing is on).
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ipybox.app.approval import AuditTrail, Gate, Policy
from ipybox.errors import PolicyError

if TYPE_CHECKING:
    from ipybox.app._tracing import Tracing

__all__ = ["Oversight"]


class Oversight:
    """The policy, the audit trail and the tracing of one executor, across its sessions.

    Args:
        policy: The rules (`ipybox.policy.Policy`), or ``None``.
        audit: ``False``, ``True`` (the user's trail) or the path of a trail.
        tracing: ``False``, ``True`` (OpenTelemetry's global tracer provider) or a tracer provider.
    """

    def __init__(self, policy: Policy | None, audit: bool | Path, tracing: Any) -> None:
        self.tracing: Tracing | None = None
        if tracing is not False:
            from ipybox.app._tracing import Tracing

            self.tracing = Tracing(None if tracing is True else tracing)
        self._audit = audit
        self._trail: AuditTrail | None = None
        # The open session's gate (``None`` between sessions), handed to its tool server.
        self.gate: Gate | None = None
        self._policy: Policy | None = None
        self.policy = policy
        # The id of the current session (each open() begins one) in the audit trail.
        self.session_id = ""

    @property
    def policy(self) -> Policy | None:
        """The rules; setting them applies at once to the later calls of the open session."""
        return self._policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        if policy is not None and not isinstance(policy, Policy):
            raise PolicyError(f"policy must be an ipybox.policy.Policy, not {type(policy).__name__}.")
        self._policy = policy
        if self.gate is not None:
            self.gate.policy = policy

    def open(self) -> Path | None:
        """Begin a session: open the trail and make the session's `gate`; the trail's folder (for the
        sandbox to hide), if any.

        Raises:
            RuntimeError: The trail cannot be opened (the message says what to do).
        """
        self.session_id = uuid.uuid4().hex[:12]
        # Always a gate, also without rules or a trail: it keeps what the application accepted
        # for the session (``accept(remember=True)``), and without rules it asks about everything.
        self.gate = Gate(self._policy, None, self.session_id)
        if self._audit is False:
            return None
        trail = AuditTrail(None if self._audit is True else Path(self._audit))
        try:
            trail.open()
        except (OSError, sqlite3.Error) as exc:
            raise RuntimeError(
                f"The audit trail {trail.path} could not be opened: {exc}; fix its folder's permissions, "
                "or pass another path (audit=Path(...))."
            ) from exc
        self._trail = trail
        self.gate = Gate(self._policy, trail, self.session_id)
        return trail.path.parent

    def close(self) -> None:
        """End the session: forget its gate and close the trail."""
        self.gate = None
        trail, self._trail = self._trail, None
        if trail is not None:
            trail.close()

    def start_cell(self, code: str) -> Any:
        """A span for a cell (``None`` without tracing); end it with `end_cell`."""
        return self.tracing.start_cell(code) if self.tracing is not None else None

    def end_cell(self, span: Any, error: BaseException | None) -> None:
        if span is not None and self.tracing is not None:
            self.tracing.end_cell(span, error)
