"""Where the tool server applies the policy and keeps the audit trail (application side only).

The decision chain (`ipybox.app.approval._chain`) holds one `Gate` per executor session; each
request (tool call or shell command) gets a `Ticket`: `Ticket.admit` decides it (policy, then what the application allowed
for the session, then the application's approval when the decision is ``ask``) and writes its
audit record before it runs; `Ticket.finish` adds the outcome. Nothing here is reachable from
the kernel: the kernel sends a request and sees only its answer.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mcp.types import ToolAnnotations

from ipybox.app.approval._audit import AuditTrail
from ipybox.app.approval._policy import Policy, Verdict, command_programs, is_shell
from ipybox.app.approval._server import Decider
from ipybox.errors import ToolCallOutcome

__all__ = ["Gate", "GateDenied", "Ticket"]

logger = logging.getLogger("ipybox.tool_exec.server")


@dataclass(frozen=True)
class Asked:
    """The application's answer to an ``ask``: accepted, and whether to allow the same for the session."""

    accepted: bool
    remember: bool = False
    abandoned: bool = False
    # Who decided, as the audit trail records it (an `ipybox.app.approval._server.Decider` value).
    by: str = Decider.APPLICATION


class GateDenied(Exception):
    """The gate refused the request: a policy rule (403, ``rejected``), or no audit record could be
    written (503, ``failed``: a call is not run without its record)."""

    def __init__(self, reason: str, status: int = 403, kind: ToolCallOutcome = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.kind = kind


# How a failed approval wait is recorded, by the outcome kind of the tool server's error.
_WHO = {"rejected": Decider.APPLICATION, "expired": "timeout", "failed": "abandoned"}


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

    def ticket(self, server: str, tool: str, tool_args: dict[str, Any]) -> Ticket:
        """A new request's ticket (nothing is decided or written yet)."""
        return Ticket(self, server, tool, tool_args)

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


class Ticket:
    """One request on its way through the gate; see `Gate`."""

    def __init__(self, gate: Gate, server: str, tool: str, tool_args: dict[str, Any]) -> None:
        self.gate = gate
        self.server = server
        self.tool = tool
        self.tool_args = tool_args
        self.record: int | None = None
        self.secrets: tuple[str, ...] = ()
        self._decided = False
        self._started = time.time()
        self._running = 0.0

    async def admit(
        self,
        *,
        annotations: ToolAnnotations | None,
        ask: Callable[[], Awaitable[Asked]] | None,
        secrets: Iterable[str] = (),
    ) -> str:
        """Decide the request and write its record; returns who allowed it once it may run.

        Args:
            annotations: The tool's MCP annotations from its server's tool list.
            ask: Asks the application and returns its answer (raising the tool server's error
                when it rejects, expires or is gone); ``None`` when the application asked for no
                approval of these calls (an ``ask`` then runs unasked).
            secrets: Values to keep out of the record.

        Returns:
            Who allowed it, as the record names them.

        Raises:
            GateDenied: A rule refused it.
        """
        self.secrets = tuple(secrets)
        verdict = self.gate.verdict(self.server, self.tool, self.tool_args, annotations)
        by = verdict.by if verdict.by in {"default", "session"} or verdict.by.startswith("rule") else "policy"
        if verdict.decision == "deny":
            self._write("denied", f"{by} ({verdict.by})" if by == "policy" else by, "rejected")
            where = f" ({verdict.origin})" if verdict.origin else ""
            raise GateDenied(
                f"was refused by policy {verdict.by}{where}"
                if verdict.by != "default"
                else "was refused by the policy's default decision"
            )
        if verdict.decision == "ask":
            if ask is None:
                by = "unasked"
            else:
                try:
                    answer = await ask()
                except BaseException as exc:
                    kind = getattr(exc, "kind", "failed")
                    by = getattr(exc, "by", None) or _WHO.get(kind, "abandoned")
                    self._write("denied", by, kind if kind in _WHO else "failed")
                    raise
                if not answer.accepted:  # pragma: no cover - ask raises on a rejection
                    self._write("denied", "abandoned" if answer.abandoned else answer.by, "rejected")
                    raise GateDenied("was rejected by the application")
                by = answer.by
                if answer.remember:
                    self.gate.remember(self.server, self.tool, self.tool_args)
        self._write("allowed", by, "running")
        self._running = time.perf_counter()
        return by

    def finish(self, status: int | None, answer: bytes | None, outcome: str = "ok") -> None:
        """Add the outcome: the HTTP status and answer of the request (``None``: it was cancelled);
        `outcome` names a success."""
        audit = self.gate.audit
        if audit is None:
            return
        if self.record is None and not self._decided:
            # Failed before a decision (an unknown server or tool, bad arguments): recorded too.
            try:
                self._write("none", "-", "running")
            except GateDenied as exc:
                logger.warning("Could not write the audit record of %s.%s: %s", self.server, self.tool, exc)
        if self.record is None:
            return
        outcome, error = _outcome(status, answer, outcome)
        for secret in self.secrets:
            if error and secret:
                error = error.replace(secret, "***")
        duration = (time.perf_counter() - self._running) * 1000 if self._running else 0.0
        try:
            audit.end(
                self.record,
                outcome=outcome,
                duration_ms=round(duration, 3),
                result_size=len(answer) if answer is not None else None,
                error=error,
            )
        except Exception:  # the call's answer matters more than its record
            logger.exception("Could not add the outcome of %s.%s to the audit trail.", self.server, self.tool)

    def _write(self, decision: str, decided_by: str, outcome: str) -> None:
        audit = self.gate.audit
        if audit is None or self._decided:
            return
        self._decided = True
        try:
            self.record = audit.begin(
                session=self.gate.session,
                server=self.server,
                tool=self.tool,
                arguments=self.tool_args,
                decision=decision,
                decided_by=decided_by,
                secrets=self.secrets,
                outcome=outcome,
                started=self._started,
            )
        except (sqlite3.Error, OSError) as exc:
            raise GateDenied(
                f"was refused: its audit record could not be written to {audit.path} ({exc}), and no call runs without one",
                503,
                "failed",
            ) from exc


def _outcome(status: int | None, answer: bytes | None, success: str) -> tuple[str, str | None]:
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
