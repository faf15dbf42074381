"""Exceptions raised by ipybox.

Every error derives from one root, so ``except IpyboxError`` catches anything ipybox
raises on purpose. This module is public: import any of these names from ``ipybox.errors``.
Some are also re-exported where the API reference puts them (``ExecutionError`` in
``ipybox.kernel_mgr.client``, ``ToolRunnerError`` in ``ipybox.tool_exec.client``, ``CodeExecutionError``
in ``ipybox``)::

    IpyboxError
    ├── GatewayError              the kernel gateway could not start or was stopped
    │   └── SandboxUnavailableError   sandboxing was asked for but cannot be provided
    ├── KernelConnectionError     no kernel could be created or reached
    │   └── KernelStartTimeoutError   a kernel did not start within its time (a remote gateway's)
    ├── ExecutionError            code raised in the kernel (ename, evalue, traceback)
    │   ├── KernelDiedError       the kernel process died while running code
    │   └── CodeExecutionError    raised by CodeExecutor (also for rejected tool calls)
    ├── ServerParamsError         MCP server parameters are malformed or name a missing ${VAR}
    ├── PolicyError               policy rules (objects or a policy file) are malformed
    ├── MCPServerError            an MCP server could not be started or failed a call
    │   └── AuthorizationError    an OAuth login is missing, revoked or expired, or failed
    ├── ToolServerError           the tool server could not start serving
    ├── ToolRunnerError           a tool call was rejected, expired or failed
    ├── ShellEscapeRequiredError  cell code started a process where ``!`` is required
    ├── ApprovalError             approval could not be asked for or answered
    │   ├── NoApprovalClientError       approval is required but no client is connected
    │   ├── ApprovalClientDisconnected  the client left before deciding
    │   ├── ApprovalConnectionError     an ApprovalClient cannot reach or lost the tool server
    │   └── ApprovalDecisionError       a decision was not taken (already decided, or expired)
    ├── ApiGenerationError        a typed API could not be generated for an MCP server
    ├── SnapshotError             a kernel snapshot could not be saved or loaded
    └── ToolSearchError           a tool search got bad input or found no usable index

``GatewayError``, ``KernelConnectionError`` and ``ToolServerError`` are also ``RuntimeError`` and
``ServerParamsError``, ``ToolSearchError``, ``PolicyError`` and ``SnapshotError`` are also ``ValueError``, the approval errors are ``RuntimeError``
(``ApprovalConnectionError`` is ``ConnectionError``), as the API reference documents.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ApiGenerationError",
    "ApprovalClientDisconnected",
    "ApprovalConnectionError",
    "ApprovalDecisionError",
    "ApprovalError",
    "AuthorizationError",
    "CodeExecutionError",
    "ExecutionError",
    "GatewayError",
    "IpyboxError",
    "KernelConnectionError",
    "KernelDiedError",
    "KernelStartTimeoutError",
    "MCPServerError",
    "NoApprovalClientError",
    "PolicyError",
    "SandboxUnavailableError",
    "ServerParamsError",
    "ShellEscapeRequiredError",
    "SnapshotError",
    "ToolCallOutcome",
    "ToolRunnerError",
    "ToolSearchError",
    "ToolServerError",
]


class IpyboxError(Exception):
    """Root of every exception ipybox raises on purpose."""


class GatewayError(IpyboxError, RuntimeError):
    """The Jupyter Kernel Gateway could not be started, or is not running."""


class SandboxUnavailableError(GatewayError):
    """Sandboxing was requested but cannot be provided on this machine or version."""


class KernelConnectionError(IpyboxError, RuntimeError):
    """A kernel could not be created on the gateway, or its channels could not be reached."""


class KernelStartTimeoutError(KernelConnectionError):
    """A kernel did not start, connect and get set up within ``kernel_start_timeout`` seconds.

    A gateway on a cluster may take long to start a kernel (a pod being scheduled, an image being
    pulled): raise the timeout, or check the gateway's kernels.
    """


class ExecutionError(IpyboxError):
    """Code executed in an IPython kernel raised an exception.

    Attributes:
        ename: The exception's class name, e.g. ``"ZeroDivisionError"``.
        evalue: The exception's message.
        traceback: The kernel's traceback as plain text (no ANSI colour codes).
    """

    def __init__(self, message: str, ename: str = "", evalue: str = "", traceback: str = "") -> None:
        super().__init__(message)
        self.ename = ename
        self.evalue = evalue
        self.traceback = traceback


class KernelDiedError(ExecutionError):
    """The kernel process died while code was running; call ``reset()`` to get a fresh one."""


class CodeExecutionError(ExecutionError):
    """Code executed by ``CodeExecutor`` failed, including rejected or failed tool calls."""


class ServerParamsError(IpyboxError, ValueError):
    """MCP server parameters are malformed, or name an environment variable that is not set."""


class PolicyError(IpyboxError, ValueError):
    """Policy rules are malformed: an unknown key, decision or annotation, or a bad glob.

    For a policy file the message names the file and the line.
    """


class MCPServerError(IpyboxError):
    """An MCP server could not be started, did not answer in time, or failed a tool call.

    Attributes:
        server_name: The application's name for the MCP server.
        tool_name: The tool being called, if any.
    """

    def __init__(self, message: str, server_name: str = "", tool_name: str | None = None) -> None:
        super().__init__(message)
        self.server_name = server_name
        self.tool_name = tool_name


class AuthorizationError(MCPServerError):
    """An OAuth-protected MCP server could not be used: its login is missing, was revoked or
    expired beyond refresh, or the authorization failed (a refused or forged callback, metadata
    of another origin, a token for another resource). The message says what to run, typically
    ``ipybox auth login NAME``; it never holds a token."""


class ToolServerError(IpyboxError, RuntimeError):
    """The tool server's HTTP server stopped before it was ready (the message says why)."""


ToolCallOutcome = Literal["rejected", "expired", "failed"]
"""How a tool call ended without a result (the type of ``ToolRunnerError.kind``)."""


class ToolRunnerError(IpyboxError):
    """A tool call through the tool server did not produce a result.

    Attributes:
        kind: ``"rejected"`` (the application said no), ``"expired"`` (no decision within
            the approval timeout) or ``"failed"`` (no approval client, MCP server error,
            tool server unreachable, ...).
        server_name: The MCP server the call was for.
        tool_name: The tool that was called.
    """

    def __init__(
        self, message: str, kind: ToolCallOutcome = "failed", server_name: str = "", tool_name: str = ""
    ) -> None:
        super().__init__(message)
        self.kind: ToolCallOutcome = kind
        self.server_name = server_name
        self.tool_name = tool_name


class ApprovalError(IpyboxError, RuntimeError):
    """Approval for a tool call could not be asked for or answered."""


class NoApprovalClientError(ApprovalError):
    """Approval is required but no approval client is connected."""


class ApprovalClientDisconnected(ApprovalError):
    """The approval client disconnected before it decided a request."""


class ApprovalConnectionError(ApprovalError, ConnectionError):
    """An approval client could not reach the tool server, was refused, or lost the connection."""


class ApprovalDecisionError(ApprovalError):
    """An ``accept()`` or ``reject()`` that did not take effect: the request was already decided,
    or it was no longer waiting (it expired, or the call was withdrawn); the message says which."""


class ApiGenerationError(IpyboxError):
    """A typed Python API could not be generated for an MCP server."""


class SnapshotError(IpyboxError, ValueError):
    """A snapshot could not be saved or loaded: missing, cut short, not a snapshot, too large, of
    another Python, or refused by the kernel (the message says which, and what to do)."""


class ShellEscapeRequiredError(IpyboxError, RuntimeError):
    """Kernel code started a process directly where the executor requires IPython's ``!`` escape."""


class ToolSearchError(IpyboxError, ValueError):
    """A tool search was given an empty or too long query or a limit out of range, or the folder
    searched has no index of generated tools (or a damaged one); the message says what to do."""
