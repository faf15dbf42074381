"""Inner tool calls approved by the person at the MCP client (``ipybox --approve-tool-calls``).

Each tool call (and shell command) a cell makes that needs approval becomes an elicitation
request to the MCP client: the server, tool and arguments, to accept or decline. How the server
asks depends on the protocol version the client negotiated:

- handshake era (up to 2025-11-25): an ``elicitation/create`` request sent over the session while
  the ``tools/call`` of the cell waits;
- 2026-07-28: the ``tools/call`` answers with an `InputRequiredResult` carrying the elicitation
  requests and an opaque state; the client retries the call with the answers and that state, and
  the cell (still running in the kernel, waiting) goes on.

Decisions keep the rules of `ApprovalRequest`: each request is decided once, and an answer that
arrives after the tool server's approval timeout (or after the cell is gone) is refused: the
call does not run.

At most `MAX_OPEN_QUESTIONS` questions of a session are open at the client at once; the others
wait their turn in the order the cell made the calls (a flood of gathered calls is put to the
person a few at a time, not all at once). A call whose turn does not come within the approval
timeout is not asked: it expires on the tool server, as an unanswered one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ipybox.app.approval import ApprovalRequest, Decider, decide_for, shown_name
from ipybox.app.executor import CodeExecutionChunk, CodeExecutionResult
from ipybox.app.kernels import KeptText
from ipybox.errors import ApprovalError, CodeExecutionError
from ipybox.mcp_server._question import MAX_CALL_CHARS, question

logger = logging.getLogger(__name__)

_ELICITATION = types.ClientCapabilities(elicitation=types.ElicitationCapability())
# Accept or decline is the answer: the form asks for nothing more.
_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
_KEY_PREFIX = "ipybox-approval-"

MAX_OPEN_QUESTIONS = 4
"""How many questions of one session are open at the client at once; the others wait their turn."""

Arrived = tuple[float, ApprovalRequest]
"""An approval request and when it reached the MCP server (`anyio.current_time`)."""

NO_ELICITATION = (
    "This ipybox server runs with --approve-tool-calls: every tool call and shell command a cell makes "
    "is put to you through MCP elicitation, and your MCP client does not support elicitation (it did "
    "not declare the `elicitation` capability), so no cell can run. Use a client that supports "
    "elicitation, or start ipybox without --approve-tool-calls."
)

NOT_WAITING = (
    "No cell is waiting for these answers: they were given already, or the cell they were asked for has "
    "ended. Run the cell again."
)


def can_ask(ctx: ServerRequestContext[Any]) -> bool:
    """Whether the client declared it can answer elicitation requests."""
    return ctx.session.check_client_capability(_ELICITATION)


def modern(ctx: ServerRequestContext[Any]) -> bool:
    """Whether the request came on a 2026-07-28 (or later) connection: input is asked for by
    `InputRequiredResult`, not by a request over the session."""
    return ctx.session.protocol_version in MODERN_PROTOCOL_VERSIONS


async def decide(request: ApprovalRequest, result: types.ElicitResult | None) -> None:
    """Accept `request` if the person accepted, else reject it (the trail and the cell's error say the
    person decided, or the application when no answer came); a decision that comes too late (the request expired or the cell is gone) is
    refused by `ApprovalRequest` and only logged here."""
    accepted = result is not None and result.action == "accept"
    # No answer at all (the client failed or left, a retry without it) is nobody's decline but ours.
    await _decide(request, accepted, Decider.PERSON if result is not None else Decider.APPLICATION)


async def _decide(request: ApprovalRequest, accepted: bool, by: str) -> None:
    try:
        await decide_for(request, accepted, by)
    except ApprovalError as exc:
        logger.warning(
            "The decision on %s.%s was not taken: %s",
            shown_name(request.server_name[:200]),
            shown_name(request.tool_name[:200]),
            type(exc).__name__,
        )


async def asked(request: ApprovalRequest) -> str | None:
    """The question about `request` (built off the event loop), or ``None`` when it is too large to
    ask: then it is rejected here, and the trail says so."""
    text = await question(request)
    if text is None:
        logger.warning(
            "Rejected a call of %s.%s without asking: over %d characters as text.",
            shown_name(request.server_name[:200]),
            shown_name(request.tool_name[:200]),
            MAX_CALL_CHARS,
        )
        await _decide(request, False, Decider.TOO_LARGE)
    return text


@dataclass
class Cell:
    """One cell's execution, consumed by a task of its own so that it can outlive the request that
    asks for approval (2026-07-28) and go on while a request over the session is pending."""

    stream: AsyncGenerator[Any, None]
    output: KeptText
    # Each request with the time it arrived (`anyio.current_time`), from which its turn is bounded.
    approvals: asyncio.Queue[Arrived] = field(default_factory=asyncio.Queue)
    # 2026-07-28: requests not asked yet, beyond the questions open at the client.
    backlog: list[Arrived] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: CodeExecutionResult | None = None
    failure: str | None = None
    error: Exception | None = None
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._consume(), name="ipybox-cell")

    async def _consume(self) -> None:
        try:
            async with contextlib.aclosing(self.stream) as items:
                async for item in items:
                    if isinstance(item, CodeExecutionChunk):
                        self.output.append(item.text)
                    elif isinstance(item, CodeExecutionResult):
                        self.result = item
                    elif isinstance(item, ApprovalRequest):
                        self.approvals.put_nowait((anyio.current_time(), item))
        except CodeExecutionError as exc:
            self.failure = exc.traceback or str(exc)
        except TimeoutError as exc:
            self.failure = f"[Timed out: {exc}]"
        except Exception as exc:  # the executor's own failure: raised to the request that reads it
            self.error = exc
        finally:
            self.done.set()

    async def next_requests(self, *, wait: bool = True) -> list[Arrived]:
        """Wait until the cell ends (then ``[]``) or asks for approval (the requests waiting);
        without `wait`, only the requests waiting now."""
        waiting: list[Arrived] = []
        if wait and self.approvals.empty() and not self.done.is_set():
            getter = asyncio.ensure_future(self.approvals.get())
            ended = asyncio.ensure_future(self.done.wait())
            try:
                await asyncio.wait({getter, ended}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in (getter, ended):
                    waiter.cancel()
                await asyncio.gather(getter, ended, return_exceptions=True)
            if not getter.cancelled():
                waiting.append(getter.result())
        while not self.approvals.empty():
            waiting.append(self.approvals.get_nowait())
        return waiting

    async def cancel(self) -> None:
        """Stop the cell (the executor interrupts the kernel and refuses calls still waiting)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({self.task})


class ClientApproval:
    """The approvals of one MCP session, asked of the person at its client.

    Args:
        timeout: The tool server's approval timeout (seconds): a request not asked within it from
            its arrival has expired there, and is not asked.
    """

    def __init__(self, timeout: float = 60) -> None:
        self._timeout = timeout
        # Handshake era: the questions open over the session (FIFO: calls are asked in order).
        self._open = anyio.Semaphore(MAX_OPEN_QUESTIONS)
        # 2026-07-28: cells waiting for a client's answers, by the state handed to the client
        # (random and used once: replaying an answer, or guessing another's state, finds nothing).
        self._waiting: dict[str, tuple[Cell, dict[str, ApprovalRequest]]] = {}
        self._forgetting: set[asyncio.Task[None]] = set()

    async def run(self, ctx: ServerRequestContext[Any], cell: Cell) -> types.InputRequiredResult | None:
        """Drive a started cell until it ends (``None``: its outcome is on `cell`) or, on a
        2026-07-28 connection, until it needs answers (the result to send to the client)."""
        if modern(ctx):
            return await self._until_asked(cell)
        async with anyio.create_task_group() as tasks:
            try:
                while requests := await cell.next_requests():
                    for arrived, request in requests:
                        tasks.start_soon(self._ask_over_session, ctx, request, arrived + self._timeout)
            except BaseException:
                await cell.cancel()
                raise
            tasks.cancel_scope.cancel()
        return None

    async def resume(
        self, params: types.CallToolRequestParams
    ) -> tuple[Cell | None, types.InputRequiredResult | None]:
        """Go on with the cell a 2026-07-28 retry names: decide its requests from the client's
        answers, then drive it like `run`. ``(None, None)`` for a state that names no waiting cell."""
        entry = self._waiting.pop(params.request_state or "", None)
        if entry is None:
            return None, None
        cell, asked = entry
        answers = params.input_responses or {}
        for key, request in asked.items():
            answer = answers.get(key)
            await decide(request, answer if isinstance(answer, types.ElicitResult) else None)
        return cell, await self._until_asked(cell)

    async def _until_asked(self, cell: Cell) -> types.InputRequiredResult | None:
        try:
            while True:
                # Requests still in the backlog are asked now, with any that came meanwhile.
                fresh = await cell.next_requests(wait=not cell.backlog)
                if not (cell.backlog or fresh):
                    return None  # the cell ended
                now = anyio.current_time()
                waiting = [
                    (at, request) for at, request in [*cell.backlog, *fresh] if now < at + self._timeout
                ]
                cell.backlog = waiting[MAX_OPEN_QUESTIONS:]
                questions: dict[ApprovalRequest, str] = {}
                for _, request in waiting[:MAX_OPEN_QUESTIONS]:
                    # A call too large to ask is rejected (`asked`), and the cell goes on.
                    if (text := await asked(request)) is not None:
                        questions[request] = text
                if questions:
                    break
        except BaseException:
            await cell.cancel()
            raise
        asked_now = {f"{_KEY_PREFIX}{index}": request for index, request in enumerate(questions)}
        state = secrets.token_urlsafe(32)
        self._waiting[state] = (cell, asked_now)
        # A client that never comes back: the requests expire on the tool server, the cell ends,
        # and its entry goes.
        forget = asyncio.create_task(self._forget_when_done(state, cell))
        self._forgetting.add(forget)
        forget.add_done_callback(self._forgetting.discard)
        return types.InputRequiredResult(
            input_requests={
                key: types.ElicitRequest(
                    params=types.ElicitRequestFormParams(message=questions[request], requested_schema=_SCHEMA)
                )
                for key, request in asked_now.items()
            },
            request_state=state,
        )

    async def _forget_when_done(self, state: str, cell: Cell) -> None:
        await cell.done.wait()
        entry = self._waiting.get(state)
        if entry is not None and entry[0] is cell:
            # Ended without the client coming back: keep the entry only briefly, for a retry.
            await asyncio.sleep(_KEEP_ENDED)
            self._waiting.pop(state, None)

    async def _ask_over_session(
        self, ctx: ServerRequestContext[Any], request: ApprovalRequest, expires: float
    ) -> None:
        """Ask when a question slot is free; a request that expires first (waiting its turn, or
        asked and unanswered) frees its slot and is left to expire on the tool server."""
        result: types.ElicitResult | None = None
        with anyio.move_on_at(expires) as turn:
            if self._open.value == 0:
                logger.debug("A call waits its turn: %d questions are open.", MAX_OPEN_QUESTIONS)
            async with self._open:
                # Built in its turn: a flood of large calls has only a few questions built at once.
                text = await asked(request)
                if text is None:
                    return
                try:
                    result = await ctx.session.elicit_form(text, _SCHEMA, related_request_id=ctx.request_id)
                except Exception as exc:
                    # The client answered with an error, or went away: nobody accepted the call.
                    logger.warning("Asking the MCP client about a call failed: %s", exc)
        if turn.cancelled_caught:
            return
        await decide(request, result)


_KEEP_ENDED = 60.0
