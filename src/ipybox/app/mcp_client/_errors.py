"""How an MCP session's failures are worded: the MCP SDK's and the transports' exceptions described.

Application side only. :class:`ipybox.app.mcp_client._session.MCPSession` builds its `MCPServerError` messages
with these: what a request was about (a tool or the tool listing), an exception (groups
included) as text, the MCP error inside a group, the hint given when a message was refused for
its size (by ipybox's bounded transports or by httpx2's SSE event limit), and the error of a
request whose connection broke or was closed under it.
"""

from __future__ import annotations

import httpx2
from mcp.shared.exceptions import MCPError

from ipybox.app.mcp_client._transport import _AnswerTooLarge
from ipybox.errors import MCPServerError

_SIZE_HINT = " (one MCP message may have up to the tool server's max_result_size plus 1 MiB)"


def _size_hint(exc: BaseException) -> str:
    """`_SIZE_HINT` if the connection ended because an event was refused for its size, else nothing.

    Refused by `_BoundedStream` (an `_AnswerTooLarge` with ``refused``), or by httpx2 inside the
    SDK's SSE transport, whose event stream has an event size limit of its own (1 MiB): once
    the stream is open (its content type checked), that limit is the one ``SSEError`` httpx2
    raises.
    """
    if isinstance(exc, BaseExceptionGroup):
        return _SIZE_HINT if any(_size_hint(inner) for inner in exc.exceptions) else ""
    if isinstance(exc, _AnswerTooLarge):
        return _SIZE_HINT if exc.refused is not None else ""
    return _SIZE_HINT if isinstance(exc, httpx2.SSEError) else ""


def _what(tool_name: str) -> str:
    return f"tool {tool_name!r}" if tool_name else "the tool listing"


def _find_mcp_error(exc: BaseException) -> MCPError | None:
    if isinstance(exc, MCPError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_mcp_error(inner)
            if found is not None:
                return found
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.message
    return str(exc) or type(exc).__name__


def _gone_error(
    server_name: str, tool_name: str, broken: bool, end_error: BaseException | None, restart_hint: str
) -> MCPServerError:
    """Why a request failed with the connection: it broke (with the reason, if known) or was closed."""
    if broken and end_error is not None:
        message = (
            f"The connection to MCP server {server_name!r} failed while {_what(tool_name)} was running: "
            f"{_describe(end_error)}{_size_hint(end_error)}; {restart_hint}."
        )
    elif broken:
        message = (
            f"MCP server {server_name!r} went away while {_what(tool_name)} was running (it crashed, "
            f"exited or closed the connection); {restart_hint}."
        )
    else:
        message = (
            f"The session to MCP server {server_name!r} was closed (reset or stop) while "
            f"{_what(tool_name)} was running."
        )
    return MCPServerError(message, server_name, tool_name or None)
