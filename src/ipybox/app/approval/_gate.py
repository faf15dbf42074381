"""What the decision chain knows of one executor session: its policy rules, what the application
accepted for the rest of the session, and its audit trail (application side only).

`Gate.verdict` applies the rules (and the session's acceptances) to a call; `Gate.remember` keeps an
acceptance ``for the session``. The decision chain (`ipybox.app.approval._chain`) asks the gate,
asks the application when the verdict is ``ask``, and writes the trail. Nothing here is reachable
from the kernel: the kernel sends a request and sees only its answer.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mcp.types import ToolAnnotations

from ipybox.app.approval._audit import AuditTrail
from ipybox.app.approval._policy import Policy, Verdict, command_programs, is_shell

__all__ = ["Gate", "outcome_of"]

logger = logging.getLogger("ipybox.tool_exec.server")


class Gate:
    """The policy, what the application allowed for the session, and the audit trail of one session.

    Args:
        policy: The rules; ``None`` asks about everything (as without a policy).
        audit: The trail to write, or ``None`` for none.
        session: The session's id in the trail.
    """

    def __init__(self, policy: Policy | None, audit: AuditTrail | None, session: str) -> None:
        self.policy = policy
        self.audit = audit
        self.session = session
        self._tools: set[tuple[str, str]] = set()
        self._programs: set[str] = set()

    def verdict(
        self, server: str, tool: str, tool_args: dict[str, Any], annotations: ToolAnnotations | None
    ) -> Verdict:
        if is_shell(server, tool):
            policy = self.policy or Policy()
            return policy.decide_shell(tool, tool_args, self._programs)
        verdict = self.policy.decide(server, tool, annotations) if self.policy else Verdict("ask", "default")
        if verdict.decision == "ask" and (server, tool) in self._tools:
            return Verdict("allow", "session")
        return verdict

    def remember(self, server: str, tool: str, tool_args: dict[str, Any]) -> None:
        """Allow what was just accepted for the rest of the session (its ``ask`` turns into ``allow``)."""
        if is_shell(server, tool):
            programs = command_programs(tool, tool_args)
            if programs:
                self._programs.update(programs)
            else:
                logger.info("Not remembered for the session: a shell command whose programs cannot be read.")
        else:
            self._tools.add((server, tool))


def outcome_of(status: int | None, answer: bytes | None, success: str) -> tuple[str, str | None]:
    """A request's outcome and error message, from its HTTP status and answer."""
    if status is None:
        return "cancelled", "the caller went away"
    if status == 200:
        return success, None
    try:
        body = json.loads(answer or b"{}")["error"]
        return str(body["kind"]), str(body["message"])
    except (ValueError, KeyError, TypeError):
        return "failed", None
