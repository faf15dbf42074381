"""The application's side of the approval channel: `ApprovalClient`, `ApprovalRequest`.

A public import path; the code lives in ``ipybox.app.approval._client``.
"""

from ipybox.app.approval import (
    ApprovalCallback,
    ApprovalClient,
    ApprovalRequest,
)

__all__ = [
    "ApprovalCallback",
    "ApprovalClient",
    "ApprovalRequest",
]
