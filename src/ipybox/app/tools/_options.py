"""The tool server's option objects: related settings grouped, as httpx groups ``Limits`` and ``Timeout``.

Application side only. `ToolServer` takes `Limits` and `Access`, `CallSpans` for tracing (and a `KernelConfinement` for where
the kernels write and how their shell commands run); the flat keywords it took before
(``max_result_size=``, ``token=``, ``kernel_writable=``, ...) still work and are gathered into these
by `gather`.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypedDict, TypeVar

from ipybox._infra import BearerToken
from ipybox.app._settings import DEFAULT_MAX_RESULT_SIZE
from ipybox.app.approval import ApprovalSpans
from ipybox.app.sandbox import KernelConfinement, ShellRunner

__all__ = [
    "DEFAULT_MAX_INFLIGHT_SIZE",
    "DEFAULT_MAX_REQUEST_SIZE",
    "DEFAULT_MAX_RESULT_SIZE",
    "Access",
    "CallSpans",
    "FlatOptions",
    "Limits",
    "gather",
]

_T = TypeVar("_T")

DEFAULT_MAX_REQUEST_SIZE = 32 * 1024 * 1024
"""The default `max_request_size` of `ToolServer`: bytes one request body may have (32 MiB)."""
DEFAULT_MAX_INFLIGHT_SIZE = 128 * 1024 * 1024
"""The default `max_inflight_size` of `ToolServer`: bytes all calls in flight may hold (128 MiB)."""


class CallSpans(ApprovalSpans, Protocol):
    """Makes spans of tool calls, approval waits and MCP server starts (`ipybox.app._tracing.Tracing`
    is one; typed here so that OpenTelemetry is imported only when tracing is on)."""

    async def tool_call(
        self, server_name: str, tool_name: str, call: Awaitable[tuple[int, bytes]]
    ) -> tuple[int, bytes]: ...

    async def server_start(self, server_name: str, start: Awaitable[_T]) -> _T: ...


@dataclass(frozen=True)
class Limits:
    """What the tool server holds of its calls, in bytes.

    Args:
        max_result_size: One tool result as the JSON answer to the kernel (binary content counts as
            its base64); a larger result fails that call alone with an error naming the limit.
        max_request_size: One request body (a tool call with its arguments); a larger call fails
            alone with an error naming the limit. The body is read only after the token was
            checked, and must arrive within 60 s.
        max_inflight_size: Request bodies and answers of all calls in flight together (each counted
            by its size on the wire). A request waits for room before its body is read (up to 60 s,
            then it fails with an error naming the limit); an answer that does not fit when its
            result arrives fails that call alone. One call is counted at most this size, so a call
            of any size up to the limits is run when it is alone.

    Raises:
        ValueError: A size is not a positive number of bytes.
    """

    max_result_size: int = DEFAULT_MAX_RESULT_SIZE
    max_request_size: int = DEFAULT_MAX_REQUEST_SIZE
    max_inflight_size: int = DEFAULT_MAX_INFLIGHT_SIZE

    def __post_init__(self) -> None:
        for name in ("max_result_size", "max_request_size", "max_inflight_size"):
            size = getattr(self, name)
            if size <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, not {size!r}.")


@dataclass(frozen=True)
class Access:
    """Who may use the tool server.

    Args:
        token: Bearer token required by ``/run``, ``/approve``, ``/shell`` and ``/reset``; generated
            when ``None`` (none in the open mode).
        approval_secret: Bearer secret required to connect to ``/approval``; generated when ``None``
            (none in the open mode).
        trust_all_clients: The open mode, only where every client is trusted: anybody who can reach
            the port may run tools (no token or approval secret unless given), and a ``/run``
            request may carry the ``server_params`` of the MCP server to start.
    """

    token: str | None = None
    approval_secret: str | None = None
    trust_all_clients: bool = False

    def secured(self) -> Access:
        """These settings with the token and approval secret generated where the secured mode needs them."""
        if self.trust_all_clients:
            return self
        return Access(
            token=self.token if self.token is not None else secrets.token_urlsafe(32),
            approval_secret=(
                self.approval_secret if self.approval_secret is not None else secrets.token_urlsafe(32)
            ),
        )

    def bearers(self) -> tuple[BearerToken | None, BearerToken | None]:
        """The checks of the token and of the approval secret (``None``: none needed)."""
        return (
            BearerToken(self.token) if self.token is not None else None,
            BearerToken(self.approval_secret) if self.approval_secret is not None else None,
        )


class FlatOptions(TypedDict, total=False):
    """The keywords `ToolServer` took one by one before they were grouped (each still works)."""

    token: str | None
    approval_secret: str | None
    trust_all_clients: bool
    max_result_size: int
    max_request_size: int
    max_inflight_size: int
    kernel_writable: tuple[Path, ...]
    shell_runner: ShellRunner | None


_GROUPS = {
    "limits": ("max_result_size", "max_request_size", "max_inflight_size"),
    "access": ("token", "approval_secret", "trust_all_clients"),
    "confinement": ("kernel_writable", "shell_runner"),
}


def gather(
    limits: Limits | None, access: Access | None, confinement: KernelConfinement | None, flat: FlatOptions
) -> tuple[Limits, Access, KernelConfinement]:
    """The option objects, from those given and the flat keywords of before.

    Raises:
        TypeError: A flat keyword was given with the option object that holds it, or is unknown.
    """
    given = {"limits": limits, "access": access, "confinement": confinement}
    known = {name for names in _GROUPS.values() for name in names}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise TypeError(f"ToolServer() got unexpected keyword argument(s): {', '.join(unknown)}.")
    for group, names in _GROUPS.items():
        clash = [name for name in names if name in flat]
        if clash and given[group] is not None:
            raise TypeError(
                f"ToolServer() got {', '.join(clash)} and {group}=; give each setting once (inside {group}=)."
            )
    if limits is None:
        limits = Limits(
            max_result_size=flat.get("max_result_size", DEFAULT_MAX_RESULT_SIZE),
            max_request_size=flat.get("max_request_size", DEFAULT_MAX_REQUEST_SIZE),
            max_inflight_size=flat.get("max_inflight_size", DEFAULT_MAX_INFLIGHT_SIZE),
        )
    if access is None:
        access = Access(
            token=flat.get("token"),
            approval_secret=flat.get("approval_secret"),
            trust_all_clients=flat.get("trust_all_clients", False),
        )
    if confinement is None:
        confinement = KernelConfinement(
            writable=flat.get("kernel_writable", ()), shell_runner=flat.get("shell_runner")
        )
    return limits, access, confinement
