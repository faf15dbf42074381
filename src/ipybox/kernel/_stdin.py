"""Tool calls over the kernel's own stdin channel (``ipybox._wire.StdinChannel``). Standard library only.

For a kernel that reaches nothing but its gateway (another host, a cluster): a tool call asks the
application the way ``input()`` asks a person. ipykernel pairs a reply with whichever request waits,
so one request is in flight per kernel: `StdinCalls` has one thread at a time make requests (a
blocking caller that finds the channel free, else a pump thread), each carrying every call queued
meanwhile and long-polling for results, while the other callers (threads, or tasks of an event
loop) wait for theirs. ipykernel hands a reply to whichever request waits, so a late reply to an
earlier request (one an interrupt left, or code in the kernel wrote) can come while a new one
waits: each request is numbered, the application says which request its reply is to, and a reply
to another request is dropped unread (its results come again, as every result does until it is
acknowledged) while the calls of ours go out again in the next request. A caller that is interrupted (``KeyboardInterrupt`` from
``cancel()``, a cancelled task) stops waiting at once; its call is never sent again, and its late
result is acknowledged and dropped.

Requests can be made only while a cell runs (ipykernel answers ``input()`` only then): a call from
a thread a cell left running fails with an error that says so.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import json
import threading
from typing import Any

from ipybox._wire import MAX_MESSAGE_CHARS, PROMPT_PREFIX, StdinChannel

__all__ = ["CHANNEL", "StdinCalls", "StdinFailure"]

_CALLS, _ACK, _ID, _SEQ = StdinChannel.CALLS, StdinChannel.ACK, StdinChannel.ID, StdinChannel.SEQ
_RESULTS, _STATUS, _ANSWER, _ERROR, _IDLE, _IDS = (
    StdinChannel.RESULTS,
    StdinChannel.STATUS,
    StdinChannel.ANSWER,
    StdinChannel.ERROR,
    StdinChannel.IDLE,
    StdinChannel.IDS,
)


class StdinFailure(Exception):
    """A call could not be sent or answered over the stdin channel (its message says why)."""


class _Slot:
    """One call's place: its request text until sent, then its outcome once it arrived."""

    __slots__ = ("done", "failure", "id", "notify", "outcome", "text")

    def __init__(self, call_id: int, text: str, notify: Any) -> None:
        self.id = call_id
        self.text = text
        self.done = threading.Event()
        self.outcome: tuple[int, Any] | None = None
        self.failure: str | None = None
        self.notify = notify

    def finish(self, outcome: tuple[int, Any] | None, failure: str | None = None) -> None:
        self.outcome, self.failure = outcome, failure
        self.done.set()
        if self.notify is not None:
            self.notify()


class StdinCalls:
    """The kernel's tool calls over its stdin channel: one thread making requests, any number of waiting callers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._requests = itertools.count(1)
        self._queued: list[int] = []
        self._waiting: dict[int, _Slot] = {}
        self._acks: list[int] = []
        self._pumping = False

    def call(self, body: str) -> tuple[int, Any]:
        """Send one call (a ``/run`` body as JSON) and wait for its outcome: the HTTP status and answer.

        A caller that finds no request in flight makes the requests itself until its own result
        came (so that an interrupt raises ``KeyboardInterrupt`` right out of its ``input()``), then
        hands the channel on to a pump thread if other calls still wait.

        Raises:
            StdinFailure: The request could not be made or was not answered.
            KeyboardInterrupt: The kernel was interrupted; the call's result, if any, is dropped.
        """
        call_id, slot = self._submit(body, None)
        with self._lock:
            lead = not self._pumping
            self._pumping = True
        try:
            if lead:
                self._pump(slot)
            slot.done.wait()
        except BaseException:
            self._abandon(call_id)
            if lead:
                with self._lock:
                    self._pumping = False
                self._kick()
            raise
        return self._outcome(slot)

    async def acall(self, body: str) -> tuple[int, Any]:
        """Like `call`, for a task of an event loop: calls gathered together go in one request.

        Raises:
            StdinFailure: The request could not be made or was not answered.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def notify() -> None:
            loop.call_soon_threadsafe(_resolve, future)

        call_id, slot = self._submit(body, notify)
        # Sent once the tasks started with this one have queued their calls too (asyncio.gather).
        loop.call_soon(self._kick)
        try:
            await future
        except BaseException:
            self._abandon(call_id)
            raise
        return self._outcome(slot)

    def _submit(self, body: str, notify: Any) -> tuple[int, _Slot]:
        if not body.startswith("{"):
            raise ValueError("a call's body is a JSON object")
        call_id = next(self._ids)
        slot = _Slot(call_id, f'{{"{_ID}": {call_id}, {body[1:]}', notify)
        with self._lock:
            self._waiting[call_id] = slot
            self._queued.append(call_id)
        return call_id, slot

    def _abandon(self, call_id: int) -> None:
        with self._lock:
            self._waiting.pop(call_id, None)
            if call_id in self._queued:
                self._queued.remove(call_id)  # never sent: it never runs

    @staticmethod
    def _outcome(slot: _Slot) -> tuple[int, Any]:
        if slot.outcome is None:
            raise StdinFailure(slot.failure or "the call was not answered")
        return slot.outcome

    def _kick(self) -> None:
        """Start a pump thread if calls wait and nobody makes requests."""
        with self._lock:
            if self._pumping or not self._waiting:
                return
            self._pumping = True
        threading.Thread(target=self._pump, name="ipybox-tool-calls", daemon=True).start()

    def _pump(self, until: _Slot | None = None) -> None:
        """Make requests while calls wait (or until `until` is done, then hand on to a pump thread)."""
        while True:
            with self._lock:
                if not self._waiting or (until is not None and until.done.is_set()):
                    self._pumping = False
                    if until is None or not self._waiting:
                        return
                    break
                acks, self._acks = self._acks, []
                sent, too_large = self._batch(acks)
                seq = next(self._requests)
            for slot in too_large:
                slot.finish(
                    None,
                    f"its arguments are over the stdin channel's limit of {MAX_MESSAGE_CHARS} characters as JSON; "
                    "pass large data as a file instead",
                )
            calls = ", ".join(s.text for s in sent)
            prompt = f'{PROMPT_PREFIX}{{"{_SEQ}": {seq}, "{_CALLS}": [{calls}], "{_ACK}": {acks}}}'
            failure = self._send(prompt, seq, sent, acks)
            if failure is not None:
                self._fail_all(failure)
        self._kick()

    def _batch(self, acks: list[int]) -> tuple[list[_Slot], list[_Slot]]:
        """The queued calls that fit in one request, and those that never fit; the rest stay queued (lock held)."""
        size = len(PROMPT_PREFIX) + 32 + 12 * len(acks)
        sent: list[_Slot] = []
        too_large: list[_Slot] = []
        rest: list[int] = []
        for call_id in self._queued:
            slot = self._waiting.get(call_id)
            if slot is None:
                continue
            if len(PROMPT_PREFIX) + 32 + len(slot.text) > MAX_MESSAGE_CHARS:
                too_large.append(self._waiting.pop(call_id))
                continue
            if size + len(slot.text) > MAX_MESSAGE_CHARS:
                rest.append(call_id)
                continue
            sent.append(slot)
            size += len(slot.text) + 2
        self._queued = rest
        return sent, too_large

    def _send(self, prompt: str, seq: int, sent: list[_Slot], acks: list[int]) -> str | None:
        """Make one request and take in its reply; why the channel cannot be used, if it cannot."""
        reader = builtins.input
        # During a cell ipykernel puts its own method there; outside one, input() would read the
        # kernel process's real stdin.
        if getattr(getattr(reader, "__self__", None), "stdin_socket", None) is None:
            return "tool calls over the stdin channel can be made only while a cell runs"
        try:
            value = reader(prompt)
        except Exception as exc:  # StdinNotImplementedError: the client did not allow stdin; EOFError
            return f"no application answers tool calls on this kernel's stdin channel ({exc!r})"
        try:
            reply = json.loads(value)
            if type(reply.get(_SEQ)) is not int or reply[_SEQ] != seq:
                # A late reply to another request, taken by ipykernel for ours: nothing in it is
                # about this request. Ours is answered too, unread; its calls and acks go again.
                self._resend(sent, acks)
                return None
            results = reply.get(_RESULTS)
            error = reply.get(_ERROR)
            if error is not None:
                # Only the calls it names: a late refusal of another request (one this kernel's
                # code wrote itself) leaves ours waiting for their own reply.
                refused = {int(i) for i in reply.get(_IDS, [])}
                self._fail([slot for slot in sent if slot.id in refused], str(error))
                return None
            outcomes = [(int(r[_ID]), int(r[_STATUS]), r[_ANSWER]) for r in results]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            self._fail(sent, f"the application's reply is not one: {value[:200]!r}")
            return None
        with self._lock:
            self._acks.extend(call_id for call_id, _, _ in outcomes)
            slots = [
                (self._waiting.pop(call_id, None), status, answer) for call_id, status, answer in outcomes
            ]
            # The application holds none of our calls: those sent before are lost (their execution
            # ended; they may or may not have run). Calls not sent yet go out next.
            lost = (
                [s for i, s in self._waiting.items() if i not in self._queued]
                if reply.get(_IDLE) is True
                else []
            )
        for slot, status, answer in slots:
            if slot is not None:
                slot.finish((status, answer))
        if lost:
            self._fail(
                lost, "the execution that made it ended before its result came; it may or may not have run"
            )
        return None

    def _resend(self, sent: list[_Slot], acks: list[int]) -> None:
        """Put a request's calls (those still waited for) and acks first in line for the next one."""
        with self._lock:
            again = [slot.id for slot in sent if slot.id in self._waiting]
            self._queued[:0] = again
            self._acks[:0] = acks

    def _fail(self, slots: list[_Slot], failure: str) -> None:
        with self._lock:
            for slot in slots:
                self._waiting.pop(slot.id, None)
        for slot in slots:
            slot.finish(None, failure)

    def _fail_all(self, failure: str) -> None:
        with self._lock:
            slots = list(self._waiting.values())
            self._waiting.clear()
            self._queued = []
        for slot in slots:
            slot.finish(None, failure)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


CHANNEL = StdinCalls()
"""The kernel's one dispatcher (one request in flight per kernel)."""
