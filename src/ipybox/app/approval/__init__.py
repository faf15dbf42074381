"""Approval: whether a call may run, and the record of what ran.

Owns the policy (``_policy``) and the reading of shell commands it rests on (``_shellparse``,
``_shellproof``), the gate a call waits at (``_gate``: the rules, what the session remembers, the
record), the one decision chain every kind of call goes through and that alone makes the permit a
call runs with (``_chain``), the approval channel's two ends (``_server``: `ApprovalChannel`,
``_client``: `ApprovalClient`, `ApprovalRequest`) and the audit trail (``_audit``).

May import (within ``ipybox.app``): ``_state``.
"""

from ipybox.app.approval._audit import AuditRecord, AuditTrail, default_audit_path
from ipybox.app.approval._chain import ApprovalSpans, Decision, DecisionChain, Permit, Refused
from ipybox.app.approval._client import (
    ApprovalCallback,
    ApprovalClient,
    ApprovalRequest,
    abandon,
    decide_for,
    shown_name,
)
from ipybox.app.approval._gate import Gate
from ipybox.app.approval._policy import Policy, Rule, Verdict, is_shell, load_policy, read_shell
from ipybox.app.approval._server import (
    POLICY_VIOLATION,
    ApprovalChannel,
    ApprovalClientDisconnected,
    Decider,
    NoApprovalClientError,
)

__all__ = [
    "POLICY_VIOLATION",
    "ApprovalCallback",
    "ApprovalChannel",
    "ApprovalClient",
    "ApprovalClientDisconnected",
    "ApprovalRequest",
    "ApprovalSpans",
    "AuditRecord",
    "AuditTrail",
    "Decider",
    "Decision",
    "DecisionChain",
    "Gate",
    "NoApprovalClientError",
    "Permit",
    "Policy",
    "Refused",
    "Rule",
    "Verdict",
    "abandon",
    "decide_for",
    "default_audit_path",
    "is_shell",
    "load_policy",
    "read_shell",
    "shown_name",
]
