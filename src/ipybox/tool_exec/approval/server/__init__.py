"""The tool server's side of the approval channel: `ApprovalChannel`.

A public import path; the code lives in ``ipybox.app.approval._server``.
"""

from ipybox.app.approval import (
    ApprovalChannel,
    ApprovalClientDisconnected,
    NoApprovalClientError,
)

__all__ = [
    "ApprovalChannel",
    "ApprovalClientDisconnected",
    "NoApprovalClientError",
]
