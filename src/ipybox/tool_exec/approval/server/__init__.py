"""The tool server's side of the approval channel: `ApprovalChannel`.

A public import path; the code lives in ``ipybox.app._approval_server``.
"""

from ipybox.app._approval_server import (
    ApprovalChannel,
    ApprovalClientDisconnected,
    NoApprovalClientError,
)

__all__ = [
    "ApprovalChannel",
    "ApprovalClientDisconnected",
    "NoApprovalClientError",
]
