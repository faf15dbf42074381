"""The application's side of the approval channel: `ApprovalClient`, `ApprovalRequest`.

A public import path; the code lives in ``ipybox.app._approval_client``.
"""

from ipybox.app._approval_client import (
    ApprovalCallback,
    ApprovalClient,
    ApprovalRequest,
)

__all__ = [
    "ApprovalCallback",
    "ApprovalClient",
    "ApprovalRequest",
]
