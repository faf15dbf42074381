"""The tool server's side of tool call approval: a JSON-RPC 2.0 channel over one WebSocket.

For every tool call the channel sends ``{"jsonrpc": "2.0", "id": N, "method": "approve",
"params": {"server_name", "tool_name", "tool_args"}}`` to the connected approval client and
waits for ``{"jsonrpc": "2.0", "id": N, "result": true | false}`` (optionally with
``"remember": true``, accepted for the rest of the session, or ``"abandoned": true``, rejected
because nobody was left to decide, and ``"by"``: who decided, one of `Decider`'s values, for the
audit trail and the caller's error; the application when it is left out). Each request id is decided
at most once, and every decision is answered with ``{"jsonrpc": "2.0", "method": "decided",
"params": {"id": N, "taken": true | false}}``: ``false`` for an unknown, already decided or
expired id, whose decision changes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ipybox._infra import DIRECT_TEXT
from ipybox.errors import ApprovalClientDisconnected, NoApprovalClientError

__all__ = ["ApprovalChannel", "ApprovalClientDisconnected", "Decider", "NoApprovalClientError"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec.approval.server")

# WebSocket close code for refused connections (RFC 6455 "policy violation").
POLICY_VIOLATION = 1008
# The notice that answers each decision, for a request id (an int) and whether it was taken.
_DECIDED = '{"jsonrpc":"2.0","method":"decided","params":{"id":%d,"taken":%s}}'


class Decider:
    """Who decided on an approval request, as the approval client says it (``"by"``).

    Each value is also what the audit trail's ``decided_by`` column shows for it.
    """

    APPLICATION: Final = "application"
    """The application's own approval callback (the SDK's `stream` consumer, `execute`)."""
    PERSON: Final = "person at MCP client"
    """The person at the MCP client, asked by ``ipybox --approve-tool-calls``."""
    HIDDEN_CELL: Final = "hidden cell"
    """Nobody: the call came while a cell the application ran on its own was running, and is refused."""
    TOO_LARGE: Final = "too large to ask"
    """Nobody: the call is too large to be shown to the person whole enough to decide, and is refused."""


_DecidedBy = Literal["application", "person at MCP client", "hidden cell", "too large to ask"]


class _Decision(BaseModel):
    """An approval client's answer to one request (validated at the WebSocket boundary)."""

    model_config = ConfigDict(extra="ignore")

    jsonrpc: Literal["2.0"]
    id: StrictInt
    result: StrictBool
    # Accepted for the rest of the session (`ApprovalRequest.accept(remember=True)`).
    remember: StrictBool = False
    # Rejected because nobody was left to decide (the stream that would have shown it ended).
    abandoned: StrictBool = False
    by: _DecidedBy = Decider.APPLICATION


class ApprovalChannel:
    """Sends approval requests to one connected approval client and waits for its decisions.

    With ``approval_required=False`` every request is granted at once. Otherwise each request
    is sent to the connected client, and many requests may wait for their decisions at the
    same time. Only one client can be connected: a second connection is refused while the
    first is open, so it cannot take over.

    Args:
        approval_required: Whether tool calls need a decision by the application.
        approval_timeout: Seconds to wait for a decision before the request expires.
    """

    def __init__(self, approval_required: bool = False, approval_timeout: float = 60) -> None:
        self.approval_required = approval_required
        self.approval_timeout = approval_timeout
        self._websocket: WebSocket | None = None
        # Writes a message to the connected client at once, when its connection has the short cut.
        self._write: Callable[[str], bool] | None = None
        self._pending: dict[int, asyncio.Future[_Decision]] = {}
        self._ids = itertools.count(1)
        self._closed = asyncio.Event()
        self._closed.set()

    @property
    def open(self) -> bool:
        """Whether an approval client is connected."""
        return self._websocket is not None

    async def connect(self, websocket: WebSocket) -> None:
        """Accept an approval client's WebSocket and read its decisions until it disconnects.

        A connection made while another client is connected is closed without being accepted.

        Args:
            websocket: The client's WebSocket, not yet accepted.
        """
        if self._websocket is not None:
            logger.warning("Refused a second approval client: one is already connected.")
            await websocket.close(code=POLICY_VIOLATION, reason="another approval client is connected")
            return
        # Claimed before the first await, so two simultaneous connections cannot both get in.
        self._websocket = websocket
        self._closed.clear()
        # Served by the tool server's own WebSocket protocol, decisions are taken as they arrive
        # (`_answer`); the loop below takes those that were queued and notices the disconnect.
        direct = websocket.scope.get("extensions", {}).get(DIRECT_TEXT)
        try:
            await websocket.accept()
            if direct is not None:
                self._write = direct(self._answer)
            while True:
                notice = self._answer(await websocket.receive_text())
                if notice is not None:
                    await websocket.send_text(notice)
        except WebSocketDisconnect:
            pass
        finally:
            if direct is not None:
                direct(None)
            self._release(websocket)

    async def disconnect(self) -> None:
        """Close the client's WebSocket and fail every request still waiting for a decision."""
        websocket = self._websocket
        if websocket is None:
            return
        self._release(websocket)
        if websocket.application_state == WebSocketState.CONNECTED:
            try:
                await websocket.close()
            except (RuntimeError, OSError):
                pass  # already closing from the client's side

    async def join(self, timeout: float = 5) -> None:
        """Wait until no approval client is connected.

        Args:
            timeout: Seconds to wait at most.

        Raises:
            TimeoutError: A client is still connected after ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            await self._closed.wait()

    async def request(self, server_name: str, tool_name: str, tool_args: dict[str, Any]) -> bool:
        """Ask the application to approve a tool call.

        Args:
            server_name: The MCP server the tool belongs to.
            tool_name: The tool to call.
            tool_args: The arguments it would be called with.

        Returns:
            ``True`` if accepted (always, when approval is not required), ``False`` if rejected.

        Raises:
            NoApprovalClientError: Approval is required but no client is connected
                (a ``RuntimeError``).
            ApprovalClientDisconnected: The client disconnected before deciding (a ``RuntimeError``).
            TimeoutError: No decision arrived within ``approval_timeout`` seconds.
        """
        return (await self.ask(server_name, tool_name, tool_args))[0]

    async def ask(
        self, server_name: str, tool_name: str, tool_args: dict[str, Any]
    ) -> tuple[bool, bool, bool, str]:
        """`request`, answering also whether the client accepted for the rest of the session
        (``remember``), whether it rejected because nobody was left to decide (``abandoned``) and
        who decided (a `Decider` value).

        Returns:
            ``(accepted, remember, abandoned, by)``.

        Raises:
            NoApprovalClientError: As `request`.
            ApprovalClientDisconnected: As `request`.
            TimeoutError: As `request`.
        """
        if not self.approval_required:
            return True, False, False, Decider.APPLICATION
        websocket = self._websocket
        if websocket is None:
            raise NoApprovalClientError("The approval client is not connected to the tool server.")
        request_id = next(self._ids)
        decision: asyncio.Future[_Decision] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = decision
        message = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": request_id,
                "method": "approve",
                "params": {"server_name": server_name, "tool_name": tool_name, "tool_args": tool_args},
            }
        )
        try:
            async with asyncio.timeout(self.approval_timeout):
                # No lock around the send: uvicorn writes each WebSocket message whole, so
                # concurrent requests cannot interleave their frames.
                try:
                    write = self._write
                    if write is None or not write(message):
                        await websocket.send_text(message)
                except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                    raise ApprovalClientDisconnected(
                        "The approval client disconnected before it could be asked."
                    ) from exc
                answer = await decision
                return answer.result, answer.result and answer.remember, answer.abandoned, answer.by
        except TimeoutError:
            raise TimeoutError(f"No approval decision within {self.approval_timeout:g} s.") from None
        finally:
            self._pending.pop(request_id, None)

    def _answer(self, text: str) -> str | None:
        """Take a decision; the notice that answers it, or ``None`` for a malformed message."""
        decided = self._decide(text)
        if decided is None:
            return None
        request_id, taken = decided
        return _DECIDED % (request_id, "true" if taken else "false")

    def _decide(self, text: str) -> tuple[int, bool] | None:
        """Take a decision; the request id and whether it was taken, or ``None`` if malformed."""
        try:
            answer = _Decision.model_validate_json(text)
        except ValidationError:
            logger.warning("Ignored a malformed message from the approval client.")
            return None
        decision = self._pending.pop(answer.id, None)
        if decision is None or decision.done():
            logger.info(
                "Ignored a decision for request %d: it expired, was withdrawn or was decided.", answer.id
            )
            return answer.id, False
        decision.set_result(answer)
        return answer.id, True

    def _release(self, websocket: WebSocket) -> None:
        if self._websocket is not websocket:
            return
        self._websocket = None
        self._write = None
        pending, self._pending = self._pending, {}
        for decision in pending.values():
            if not decision.done():
                decision.set_exception(
                    ApprovalClientDisconnected("The approval client disconnected before it decided.")
                )
        self._closed.set()
