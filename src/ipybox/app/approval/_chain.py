"""The one decision chain: whether a call may run, for every kind of call (application side only).

Every call that code in a kernel makes the trusted side run, or asks it about, is decided here:
a tool call over ``POST /run`` or the kernel's stdin channel (with a policy gate or without one),
a shell command the kernel runs itself once allowed (``POST /approve``, an ask-only call on the
stdin channel) and one the tool server runs for a walled kernel (``POST /shell``). The person at an
MCP client (``ipybox --approve-tool-calls``, their questions built by ``ipybox.mcp_server``) answers
through the application's approval client, so their answer reaches the chain as the application's.

`DecisionChain.begin` opens a call's `Decision`; `Decision.permit` applies the policy rules and what
the session remembers (the session's `Gate`), asks the application over the `ApprovalChannel` when the rules
say ``ask`` (under the channel's timeout, in a tracing span when tracing is on), writes the audit
record, and returns a `Permit`, or raises `Refused`. `Decision.finish` adds the outcome to the record.

The code that runs a call takes a `Permit`, and only this module can make one: the structural form
of "only the chain can say yes" (the same place pydantic-ai's ``ApprovalRequiredToolset`` takes, in
front of ``call_tool``). A test over the source holds it.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Awaitable, Iterable
from typing import Any, Final, Protocol

from mcp.types import ToolAnnotations

from ipybox.app.approval._gate import Gate, outcome_of
from ipybox.app.approval._server import (
    ApprovalChannel,
    ApprovalClientDisconnected,
    Decider,
    NoApprovalClientError,
)
from ipybox.errors import ToolCallOutcome

__all__ = ["ApprovalSpans", "Decision", "DecisionChain", "Permit", "Refused"]

logger = logging.getLogger("ipybox.tool_exec.server")

# How a rejection reads to the caller, by who decided (`Decider`).
_REJECTED_BY_APP = "was rejected by the application."
_REJECTED = {
    Decider.APPLICATION: _REJECTED_BY_APP,
    Decider.PERSON: "was rejected by the person at the MCP client.",
    Decider.HIDDEN_CELL: (
        "was rejected: it was made while a cell the application runs on its own was running (the refresh "
        "after register_mcp_server or install_package); nobody approves or is asked about a call then, "
        "so it does not run. Make the call from a cell of your own."
    ),
    Decider.TOO_LARGE: (
        "was rejected without asking: its arguments are too large to show to the person who approves "
        "calls. Pass less data per call (write large data to a file and pass its path)."
    ),
}


class ApprovalSpans(Protocol):
    """Makes a span of each wait for a decision (`ipybox.app._tracing.Tracing` is one)."""

    async def approval(
        self, server_name: str, tool_name: str, decision: Awaitable[tuple[bool, bool, bool, str]]
    ) -> tuple[bool, bool, bool, str]: ...


# How a failed question is recorded, by the outcome kind of its error.
_WHO = {"rejected": Decider.APPLICATION, "expired": "timeout", "failed": "abandoned"}

# Only `Decision.permit` holds this, so only it can make a `Permit`.
_MINT: Final = object()


class Refused(Exception):
    """The chain did not allow a call: its HTTP status, outcome kind and message for the caller.

    Also what the code around a call raises for a call that fails before or after its decision.
    """

    def __init__(self, status: int, kind: ToolCallOutcome, message: str, by: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        # Who decided, for the audit trail, where the kind does not say it (an abandoned request).
        self.by = by


class Permit:
    """A call the chain allowed; the code that runs a call (a tool, a shell command) requires one.

    Made only by `Decision.permit`; making one elsewhere raises ``TypeError``.
    """

    __slots__ = ("by", "server_name", "tool_name")

    def __init__(self, mint: object, server_name: str, tool_name: str, by: str) -> None:
        if mint is not _MINT:
            raise TypeError("Only the decision chain (DecisionChain) makes a Permit.")
        self.server_name = server_name
        self.tool_name = tool_name
        self.by = by


class DecisionChain:
    """Decides whether calls may run: policy rules, session memory, the application, timeouts, audit.

    Args:
        channel: Where the application (or the person, through it) is asked; its ``approval_timeout``
            bounds each question.
        gate: The policy, what the session accepted to remember, and the audit trail of the
            executor's session; ``None``: every call is asked about (when asking is on) and none is
            recorded or remembered.
        tracing: Makes a span of each approval wait; ``None``: no spans.
    """

    def __init__(
        self, channel: ApprovalChannel, gate: Gate | None = None, tracing: ApprovalSpans | None = None
    ) -> None:
        self._channel = channel
        self._gate = gate
        self._tracing = tracing

    @property
    def checks_calls(self) -> bool:
        """Whether a decision reads the tool's annotations (a gate is there): the caller lists the tool."""
        return self._gate is not None

    def begin(self, server_name: str, tool_name: str, tool_args: dict[str, Any], label: str) -> Decision:
        """Open a call's decision (nothing is decided or written yet).

        Args:
            server_name: The server (``ipybox`` for a shell command).
            tool_name: The tool (``shell`` or ``shell_magic`` for a shell command).
            tool_args: The arguments, as the application would be shown them.
            label: How messages name the call (``"Tool call s.t"``, ``"ipybox.shell"``).
        """
        return Decision(self, self._gate, server_name, tool_name, tool_args, label)

    async def _ask(self, server_name: str, tool_name: str, tool_args: dict[str, Any]) -> tuple[bool, str]:
        """Put the call to the application; whether it accepted for the rest of the session, and who decided.

        Raises:
            Refused: Rejected, expired, or nobody there to ask.
        """
        call = f"{server_name}.{tool_name}"
        try:
            decision = self._channel.ask(server_name, tool_name, tool_args)
            if self._tracing is not None:
                decision = self._tracing.approval(server_name, tool_name, decision)
            accepted, remember, abandoned, by = await decision
        except NoApprovalClientError:
            raise Refused(
                503,
                "failed",
                f"Tool call {call} failed: it needs approval, but the application's approval client is not "
                "connected to the tool server; connect an ApprovalClient before running code that calls tools.",
            ) from None
        except ApprovalClientDisconnected:
            raise Refused(
                503, "failed", f"Tool call {call} failed: the approval client disconnected before it decided."
            ) from None
        except TimeoutError:
            raise Refused(
                504,
                "expired",
                f"Tool call {call} expired: the application made no approval decision within "
                f"{self._channel.approval_timeout:g} s.",
            ) from None
        if abandoned:
            raise Refused(
                403,
                "rejected",
                f"Tool call {call} was rejected: the application's stream ended before anybody decided.",
                by="abandoned",
            )
        if not accepted:
            raise Refused(403, "rejected", f"Tool call {call} {_REJECTED.get(by, _REJECTED_BY_APP)}", by=by)
        return remember, by


class Decision:
    """One call on its way through the chain (made by `DecisionChain.begin`), and its audit record."""

    def __init__(
        self,
        chain: DecisionChain,
        gate: Gate | None,
        server_name: str,
        tool_name: str,
        tool_args: dict[str, Any],
        label: str,
    ) -> None:
        self._chain = chain
        self._gate = gate
        self.server_name = server_name
        self.tool_name = tool_name
        self.tool_args = tool_args
        self.label = label
        self._record: int | None = None
        self._secrets: tuple[str, ...] = ()
        self._decided = False
        self._started = time.time()
        self._running = 0.0

    async def permit(
        self,
        *,
        ask: bool,
        annotations: ToolAnnotations | None = None,
        secrets: Iterable[str] = (),
    ) -> Permit:
        """Decide the call and write its record; the permit to run it.

        The rules first (and what the session accepted), then, for ``ask``, the application; a
        call decided ``ask`` while asking is off runs unasked, recorded as such.

        Args:
            ask: Whether a call the rules do not decide is put to the application.
            annotations: The tool's MCP annotations, which policy rules may match.
            secrets: Values kept out of the audit record.

        Raises:
            Refused: A rule denied it, the application rejected it or did not decide in time, nobody
                was there to ask, or its audit record could not be written.
        """
        gate = self._gate
        if gate is None:
            by = (
                (await self._chain._ask(self.server_name, self.tool_name, self.tool_args))[1]
                if ask
                else "unasked"
            )
            return Permit(_MINT, self.server_name, self.tool_name, by)
        self._secrets = tuple(secrets)
        verdict = gate.verdict(self.server_name, self.tool_name, self.tool_args, annotations)
        by = verdict.by if verdict.by in {"default", "session"} or verdict.by.startswith("rule") else "policy"
        if verdict.decision == "deny":
            self._write("denied", f"{by} ({verdict.by})" if by == "policy" else by, "rejected")
            where = f" ({verdict.origin})" if verdict.origin else ""
            reason = (
                f"was refused by policy {verdict.by}{where}"
                if verdict.by != "default"
                else "was refused by the policy's default decision"
            )
            raise Refused(403, "rejected", f"{self.label} {reason}.")
        if verdict.decision == "ask":
            by = await self._asked(gate) if ask else "unasked"
        self._write("allowed", by, "running")
        self._running = time.perf_counter()
        return Permit(_MINT, self.server_name, self.tool_name, by)

    async def _asked(self, gate: Gate) -> str:
        """Who accepted the call once the application was asked; a refusal is recorded, then raised."""
        try:
            remember, by = await self._chain._ask(self.server_name, self.tool_name, self.tool_args)
        except BaseException as exc:
            kind = getattr(exc, "kind", "failed")
            who = getattr(exc, "by", None) or _WHO.get(kind, "abandoned")
            self._write("denied", who, kind if kind in _WHO else "failed")
            raise
        if remember:
            gate.remember(self.server_name, self.tool_name, self.tool_args)
        return by

    def finish(self, status: int | None, answer: bytes | None, outcome: str = "ok") -> None:
        """Add the outcome to the record: the HTTP status and answer (``None``: cancelled); `outcome`
        names a success. A call that failed before its decision is recorded too."""
        audit = self._gate.audit if self._gate is not None else None
        if audit is None:
            return
        if self._record is None and not self._decided:
            # Failed before a decision (an unknown server or tool, bad arguments): recorded too.
            try:
                self._write("none", "-", "running")
            except Refused as exc:
                logger.warning("Could not write the audit record of %s: %s", self.label, exc)
        if self._record is None:
            return
        kind, error = outcome_of(status, answer, outcome)
        for secret in self._secrets:
            if error and secret:
                error = error.replace(secret, "***")
        duration = (time.perf_counter() - self._running) * 1000 if self._running else 0.0
        try:
            audit.end(
                self._record,
                outcome=kind,
                duration_ms=round(duration, 3),
                result_size=len(answer) if answer is not None else None,
                error=error,
            )
        except Exception:  # the call's answer matters more than its record
            logger.exception("Could not add the outcome of %s to the audit trail.", self.label)

    def _write(self, decision: str, decided_by: str, outcome: str) -> None:
        gate = self._gate
        if gate is None or gate.audit is None or self._decided:
            return
        self._decided = True
        try:
            self._record = gate.audit.begin(
                session=gate.session,
                server=self.server_name,
                tool=self.tool_name,
                arguments=self.tool_args,
                decision=decision,
                decided_by=decided_by,
                secrets=self._secrets,
                outcome=outcome,
                started=self._started,
            )
        except (sqlite3.Error, OSError) as exc:
            raise Refused(
                503,
                "failed",
                f"{self.label} was refused: its audit record could not be written to {gate.audit.path} ({exc}), "
                "and no call runs without one.",
            ) from exc
