"""Tool calls that arrive on a kernel's stdin channel, run through the tool server's ``/run`` path.

The application side of ``ipybox.kernel._stdin`` (the protocol is ``ipybox._wire.StdinChannel``).
`StdinToolCalls` is the `StdinHandler` a `KernelClient` hands each ``input_request`` whose prompt
starts with ``PROMPT_PREFIX``. Every request is written by code in the kernel, which is hostile: it
is parsed strictly (exactly its fields, a size cap, a cap on calls in flight), it carries no approval,
token or identity (the kernel a request came from is the connection it arrived on, which the kernel
client names), and each call in it goes through `ToolServer.run_call`, the same function that serves
``POST /run``: registry lookup, policy and audit, approval, tracing, the call and the size limits. An
ask-only call (a shell command the kernel runs itself, once allowed) goes through
`ToolServer.approve_only`, the function that serves ``POST /approve``, and runs nothing here.

ipykernel has one request in flight per kernel, so a request starts all its calls at once and is
answered with the results that are ready; with none ready, it is held until one is, or for
`poll_window` seconds at most, so that calls the kernel queued meanwhile go out in the next request.
A result is sent with every answer until the kernel acknowledges it, and a reply names the request
it answers (ipykernel hands a late reply to whichever request waits; the kernel drops one that is
not to its own and sends its calls again, which are not run twice); when the kernel's execution
ends, results nobody took are dropped (a call that is still running runs to its end, never twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from ipybox._wire import ASK_ONLY_RULE, MAX_MESSAGE_CHARS, PROMPT_PREFIX, StdinChannel, asks_about_shell
from ipybox.app.tools._calls import _RunRequest
from ipybox.app.tools._http import _Charge, _error, _summarise
from ipybox.app.tools._server import ToolServer

__all__ = ["MAX_CALLS_IN_FLIGHT", "StdinToolCalls"]

logger = logging.getLogger("ipybox.tool_exec.server")

MAX_CALLS_IN_FLIGHT = 256
"""Calls of one kernel running or holding a result at once; a request that would go over is refused."""
_POLL_WINDOW = 0.02


class _Call(BaseModel):
    """One call in a request (`ipybox._wire.CALL_FIELDS`)."""

    model_config = ConfigDict(extra="forbid")

    id: StrictInt
    server_name: StrictStr = Field(min_length=1)
    tool_name: StrictStr = Field(min_length=1)
    tool_args: dict[str, Any]
    content: StrictBool = False
    ask_only: StrictBool = False

    @model_validator(mode="after")
    def _asks_for_shell(self) -> _Call:
        # An ask-only call stands for ``POST /approve``, which a kernel sends for its shell commands.
        if self.ask_only and (not asks_about_shell(self.server_name, self.tool_name) or self.content):
            raise ValueError(ASK_ONLY_RULE)
        return self


class _Request(BaseModel):
    """A request (`ipybox._wire.REQUEST_FIELDS`)."""

    model_config = ConfigDict(extra="forbid")

    calls: list[_Call] = Field(max_length=MAX_CALLS_IN_FLIGHT)
    ack: list[StrictInt] = Field(max_length=MAX_CALLS_IN_FLIGHT)
    seq: StrictInt | None = None


def parse_request(prompt: str) -> _Request:
    """The request in a prompt that code in the kernel wrote, checked strictly.

    Raises:
        ValueError: The request is too large, not JSON, or has other fields (or types) than it may.
    """
    body = prompt.removeprefix(PROMPT_PREFIX)
    if len(body) > MAX_MESSAGE_CHARS:
        raise ValueError(
            f"The tool call request is over {MAX_MESSAGE_CHARS} characters; pass large data as a file."
        )
    try:
        return _Request.model_validate_json(body)
    except ValidationError as exc:
        raise ValueError(f"The tool call request is malformed: {_summarise(exc)}") from None


@dataclass
class _Result:
    status: int
    answer: bytes
    charge: _Charge


@dataclass
class _KernelCalls:
    """One kernel's calls: those running, and the results not yet acknowledged."""

    running: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    results: dict[int, _Result] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Which execution the calls belong to; a call of an ended one keeps no result.
    epoch: int = 0

    def take_acks(self, ids: list[int]) -> None:
        for call_id in ids:
            result = self.results.pop(call_id, None)
            if result is not None:
                result.charge.release()

    def end(self) -> None:
        self.epoch += 1
        for result in self.results.values():
            result.charge.release()
        self.results.clear()
        self.running.clear()  # they run to their end; their results are dropped
        self.changed.set()


class StdinToolCalls:
    """Answers the tool call requests of kernels on their stdin channel (a `StdinHandler`).

    Args:
        server: The tool server whose run path (registry, policy, approval, limits) each call takes.
        poll_window: Seconds a request is held at most while calls run and none has a result.
    """

    def __init__(self, server: ToolServer, poll_window: float = _POLL_WINDOW) -> None:
        self.server = server
        self.poll_window = poll_window
        self._kernels: dict[str, _KernelCalls] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Each kernel's calls still running, those of ended executions too (they run to their
        # end): the cap on calls in flight counts them all, so ending cells does not reset it.
        self._live: dict[str, int] = {}

    async def input_request(self, kernel_id: str, prompt: str) -> str:
        """The reply to one request from the kernel `kernel_id` (known from its connection)."""
        kernel = self._kernels.get(kernel_id)
        if kernel is None:
            kernel = self._kernels[kernel_id] = _KernelCalls()
        try:
            request = parse_request(prompt)
        except ValueError as exc:
            return _refusal(str(exc), [], _seq_of(prompt))
        kernel.take_acks(request.ack)
        ids = [call.id for call in request.calls]
        if len(set(ids)) != len(ids):
            return _refusal(
                "The tool call request repeats a call's id; none of its calls ran.", ids, request.seq
            )
        # A call in flight already was sent again (the kernel dropped a late reply): it runs once.
        new = [
            call for call in request.calls if call.id not in kernel.running and call.id not in kernel.results
        ]
        live = self._live.get(kernel_id, 0)
        in_flight = live + len(kernel.results)
        if in_flight + len(new) > MAX_CALLS_IN_FLIGHT:
            return _refusal(
                f"The kernel has {in_flight} tool calls in flight, and at most {MAX_CALLS_IN_FLIGHT} "
                "may be; none of the request's calls ran. Make fewer calls at once.",
                ids,
                request.seq,
            )
        for call in new:
            task = asyncio.create_task(self._run(kernel_id, kernel, call, kernel.epoch))
            kernel.running[call.id] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._live[kernel_id] = live + len(new)
        return await self._reply(kernel, request.seq)

    def _finished(self, kernel_id: str) -> None:
        """One of the kernel's calls no longer runs. Called in the same step that keeps its result:
        a done callback would run a loop turn later, and a request read in that turn would count
        the call twice (running and kept)."""
        live = self._live.get(kernel_id, 0) - 1
        if live > 0:
            self._live[kernel_id] = live
        else:
            self._live.pop(kernel_id, None)

    def execution_ended(self, kernel_id: str) -> None:
        """The kernel's execution ended: results nobody took are dropped, a held request is answered."""
        kernel = self._kernels.pop(kernel_id, None)
        if kernel is not None:
            kernel.end()

    async def aclose(self) -> None:
        """Cancel every call still running and forget every kernel's calls."""
        for kernel in self._kernels.values():
            kernel.end()
        self._kernels.clear()
        self._live.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, kernel_id: str, kernel: _KernelCalls, call: _Call, epoch: int) -> None:
        charge = _Charge(self.server.inflight)
        try:
            body = _RunRequest(
                server_name=call.server_name,
                tool_name=call.tool_name,
                tool_args=call.tool_args,
                content=call.content,
            )
            status, answer = await self._answer(body, charge, call.ask_only)
        finally:
            self._finished(kernel_id)
            if kernel.running.pop(call.id, None) is None or kernel.epoch != epoch:
                charge.release()
        if kernel.epoch != epoch:
            return
        kernel.results[call.id] = _Result(status, answer, charge)
        kernel.changed.set()

    async def _answer(self, body: _RunRequest, charge: _Charge, ask_only: bool) -> tuple[int, bytes]:
        server = self.server
        try:
            # Counted as /run counts a request: its arguments' size, waiting for room.
            await charge.take(len(json.dumps(body.tool_args)))
            if ask_only:
                # Only asks, as POST /approve does (the same gate, audit, tracing and approval).
                status, answer = await server.approve_only(body)
            else:
                status, answer = await server.run_call(body, charge)
        except TimeoutError:
            return _error(
                503,
                "failed",
                f"Tool call {body.server_name}.{body.tool_name} was not run: it waited for room in the tool "
                "server's limit for the requests and answers of all calls in flight; make fewer large calls at once.",
            )
        except Exception as exc:  # broad: the call's own failure, answered to it alone
            logger.exception(
                "Tool call %s.%s over the stdin channel failed.", body.server_name, body.tool_name
            )
            return _error(500, "failed", f"Tool call {body.server_name}.{body.tool_name} failed: {exc!r}")
        if _escaped_size(answer) > MAX_MESSAGE_CHARS:
            charge.swap(0)  # the answer is dropped: it holds none of the in-flight budget
            return _error(
                502,
                "failed",
                f"Tool call {body.server_name}.{body.tool_name} failed: its result is over the limit of "
                f"{MAX_MESSAGE_CHARS} bytes of the kernel's stdin channel; ask the tool for less at a time.",
            )
        return status, answer

    async def _reply(self, kernel: _KernelCalls, seq: int | None) -> str:
        if not kernel.results and kernel.running:
            kernel.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_window):
                    await kernel.changed.wait()
        parts: list[bytes] = []
        size = 0
        for call_id, result in kernel.results.items():
            part = b'{"%s":%d,"%s":%d,"%s":' % (
                StdinChannel.ID.encode(),
                call_id,
                StdinChannel.STATUS.encode(),
                result.status,
                StdinChannel.ANSWER.encode(),
            )
            part += result.answer + b"}"
            grown = _escaped_size(part) + 1
            if parts and size + grown > MAX_MESSAGE_CHARS:
                break  # the rest go with the next reply, at once
            parts.append(part)
            size += grown
        idle = b"true" if len(parts) == len(kernel.results) and not kernel.running else b"false"
        head = b'{"%s":%s,"%s":%s,"%s":[' % (
            StdinChannel.SEQ.encode(),
            json.dumps(seq).encode(),
            StdinChannel.IDLE.encode(),
            idle,
            StdinChannel.RESULTS.encode(),
        )
        return (head + b",".join(parts) + b"]}").decode()


def _refusal(message: str, ids: list[int], seq: int | None) -> str:
    return json.dumps({StdinChannel.SEQ: seq, StdinChannel.ERROR: message, StdinChannel.IDS: ids})


def _seq_of(prompt: str) -> int | None:
    """The number of a request that was refused unread, if it has one (the kernel waits for that reply)."""
    body = prompt.removeprefix(PROMPT_PREFIX)
    if len(body) > MAX_MESSAGE_CHARS:
        return None
    try:
        seq = json.loads(body).get(StdinChannel.SEQ)
    except (ValueError, AttributeError, RecursionError):
        return None
    return seq if type(seq) is int else None


def _escaped_size(data: bytes) -> int:
    """Bytes of `data` once it is a JSON string in the reply message (quotes and backslashes escaped)."""
    return len(data) + data.count(b'"') + data.count(b"\\")
