"""Create IPython kernels on a Kernel Gateway and run code in them."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import os
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Self

import httpx2
import websockets
from websockets.asyncio.client import ClientConnection

from ipybox._infra import strip_ansi
from ipybox.app._confined import Confined, ConfinedPathError, write_new
from ipybox.errors import ExecutionError, KernelConnectionError, KernelDiedError

__all__ = ["ExecutionError", "ExecutionResult", "KernelClient"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")
# The start of a terminal escape sequence (`strip_ansi`) that a later chunk of the same stream completes.
_ANSI_TAIL = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[PX^_][^\x1b]*\x1b?|[ -/]*)\Z")
_ANSI_TAIL_MAX = 4096
_INTERRUPT_GRACE = 5.0
# The channels handshake completes only once the new kernel answers; on a busy machine
# a kernel can take longer to boot than the WebSocket library's 10 s default.
_OPEN_TIMEOUT = 60.0
# Bytes one message from the kernel may have (a larger one would be held whole in memory), and
# the WebSocket close code for a message over it.
_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
_MESSAGE_TOO_BIG = 1009
# Characters of one execution's output text that an `ExecutionResult` keeps (its head and tail).
DEFAULT_MAX_OUTPUT_CHARS = 16 * 1024 * 1024
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ExecutionResult:
    """The result of code that ran to completion.

    Attributes:
        text: Everything the code printed or displayed as text, or ``None`` if nothing. Output
            over the client's ``max_output_chars`` keeps its head and tail, with a note of how
            much was dropped between them; an output the client could not read (say an image
            that is not base64 PNG data) is skipped with a note in its place.
        images: Paths of the PNG images the code displayed (e.g. matplotlib plots).
    """

    text: str | None
    images: list[Path] = field(default_factory=list)


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass
class _Kernel:
    """One kernel on the gateway with its open channels WebSocket."""

    id: str
    ws: ClientConnection
    session: str
    queues: dict[str, asyncio.Queue[dict[str, Any] | None]] = field(default_factory=dict)
    receiver: asyncio.Task[None] | None = None
    dead: bool = False
    # Why the connection ended, when the client itself ended it (a message over the size limit).
    lost_because: str | None = None
    busy: asyncio.Event = field(default_factory=asyncio.Event)
    # Executions submitted and not yet collected; `settled` is set while there are none.
    pending: int = 0
    settled: asyncio.Event = field(default_factory=_set_event)


@dataclass
class _Outcome:
    """What the messages of one execution said so far: its output, error and progress."""

    kept: KeptText
    images: list[Path] = field(default_factory=list)
    error: dict[str, Any] | None = None
    idle: bool = False
    replied: bool = False
    # One per stream name (stdout, stderr): an escape sequence may be split across its chunks.
    strippers: dict[str, _AnsiStripper] = field(default_factory=dict)

    def reply(self, content: dict[str, Any]) -> None:
        if content.get("status") == "error" and self.error is None:
            self.error = content
        elif content.get("status") == "aborted":
            self.error = {
                "ename": "Aborted",
                "evalue": "The kernel aborted the execution without running it.",
            }

    def stream(self, content: dict[str, Any]) -> str:
        chunk = content.get("text", "")
        if not isinstance(chunk, str):
            return _skipped("a stream output", "its text is not a string")
        name = str(content.get("name", ""))
        stripper = self.strippers.get(name)
        if stripper is None:
            stripper = self.strippers[name] = _AnsiStripper()
        return stripper.feed(chunk)

    def result(self) -> ExecutionResult:
        """The execution's result; `ExecutionError` if it raised."""
        if self.error is not None:
            ename = str(self.error.get("ename", ""))
            evalue = str(self.error.get("evalue", ""))
            lines = self.error.get("traceback")
            lines = [str(line) for line in lines] if isinstance(lines, list) else []
            traceback = strip_ansi("\n".join(lines))
            raise ExecutionError(
                traceback or f"{ename}: {evalue}", ename=ename, evalue=evalue, traceback=traceback
            )
        text = self.kept.text(strip="\n")
        return ExecutionResult(text=text or None, images=self.images)


class KernelClient:
    """Runs code in an IPython kernel served by a `KernelGateway`.

    State persists between executions: variables, imports and definitions of one
    `execute` are there in the next. `reset()` swaps in a fresh kernel; a spare one is
    kept warm in the background so that a reset takes milliseconds.

    Example:
        .. code-block:: python

            async with KernelClient(port=gateway.port) as client:
                await client.execute("x = 21")
                result = await client.execute("print(x * 2)")
                assert result.text == "42"

    Args:
        host: Host of the kernel gateway.
        port: Port of the kernel gateway.
        images_dir: Folder for PNG images displayed by code; default ``./images``.
        ping_interval: Seconds between WebSocket pings that keep the connection alive.
        auth_token: The gateway's `auth_token`, if it has one.
        spare_kernel: Keep a spare kernel warm for a fast `reset()`; ``False`` saves its
            memory (a reset then waits for a kernel to start).
        max_output_chars: Characters of an execution's output text kept for its
            `ExecutionResult`: beyond that, its first and last halves are kept and the middle
            is dropped with a note (`stream` still yields every chunk as it arrives). This
            bounds the memory a kernel that prints without end can make the application use.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 8888,
        images_dir: Path | None = None,
        ping_interval: float = 10,
        *,
        auth_token: str | None = None,
        spare_kernel: bool = True,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    ) -> None:
        if max_output_chars < 2:
            raise ValueError(f"max_output_chars must be at least 2, not {max_output_chars!r}.")
        self.max_output_chars = max_output_chars
        self.host = host
        self._headers = {"Authorization": f"token {auth_token}"} if auth_token else {}
        self.port = port
        self.images_dir = images_dir or Path("images")
        self.ping_interval = ping_interval
        self.spare_kernel = spare_kernel
        self._http: httpx2.AsyncClient | None = None
        self._kernel: _Kernel | None = None
        self._spare: asyncio.Task[_Kernel] | None = None
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def kernel_id(self) -> str:
        """The ID of the connected kernel.

        Raises:
            KernelConnectionError: If not connected to a kernel.
        """
        if self._kernel is None:
            raise KernelConnectionError("The client is not connected to a kernel; call connect() first.")
        return self._kernel.id

    @property
    def _base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.disconnect()

    async def connect(self, retries: int = 10, retry_interval: float = 1.0) -> None:
        """Create a kernel on the gateway and connect to it.

        Args:
            retries: How many times to try before giving up.
            retry_interval: Seconds between tries.

        Raises:
            KernelConnectionError: If no kernel could be created or reached.
        """
        if self._kernel is not None:
            return
        self._http = httpx2.AsyncClient(
            base_url=self._base_url, headers=self._headers, timeout=httpx2.Timeout(30.0, connect=5.0)
        )
        last_error: Exception | None = None
        for attempt in range(max(retries, 1)):
            try:
                self._kernel = await self._open_kernel()
                break
            except (httpx2.HTTPError, OSError, websockets.WebSocketException, KernelConnectionError) as exc:
                last_error = exc
                if attempt + 1 < retries:
                    await asyncio.sleep(retry_interval)
        else:
            await self._http.aclose()
            self._http = None
            raise KernelConnectionError(
                f"Could not create a kernel on the gateway at {self._base_url} after {retries} tries "
                f"(last error: {last_error}). Is the gateway running on that host and port?"
            ) from last_error

    def _start_spare(self) -> None:
        """Start booting the kernel the next `reset()` will switch to."""
        if self.spare_kernel and self._spare is None and self._http is not None:
            self._spare = asyncio.create_task(self._open_kernel())
            # A spare that fails is replaced on reset(); its error must not go unretrieved.
            self._spare.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def disconnect(self, *, shutdown_kernels: bool = True) -> None:
        """Shut down the kernel (and the spare) and close the connection.

        Args:
            shutdown_kernels: Ask the gateway to shut the kernels down. ``False`` only closes
                the connections, for a caller that stops the gateway with its kernels next.
        """
        kernel, self._kernel = self._kernel, None
        spare, self._spare = self._spare, None
        to_close: list[_Kernel] = [kernel] if kernel else []
        if spare is not None:
            spare.cancel()
            await asyncio.wait({spare})
            if not spare.cancelled() and spare.exception() is None:
                to_close.append(spare.result())
        closing = list(self._closing)
        if not shutdown_kernels:
            for task in closing:
                task.cancel()
        await asyncio.gather(
            *(self._close_kernel(k, shutdown=shutdown_kernels) for k in to_close),
            *closing,
            return_exceptions=True,
        )
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def reset(self) -> None:
        """Replace the kernel with a fresh one: all variables, imports and definitions are gone.

        Raises:
            KernelConnectionError: If no fresh kernel could be created.
        """
        async with self._lock:
            await self._replace_kernel()

    async def _replace_kernel(self) -> None:
        """Switch to the spare (or a new kernel) and shut the old one down; the lock is held."""
        old = self._kernel
        if old is None or self._http is None:
            raise KernelConnectionError("The client is not connected to a kernel; call connect() first.")
        spare = self._spare
        self._spare = None
        new: _Kernel | None = None
        if spare is not None:
            try:
                new = await spare
            except Exception:  # broad: a spare kernel that failed to start is replaced by a new one below
                new = None
        if new is None or new.dead:
            if new is not None:
                self._close_in_background(new)
            new = await self._open_kernel()
        self._kernel = new
        self._start_spare()
        self._close_in_background(old)

    def _close_in_background(self, kernel: _Kernel) -> None:
        """Shut a kernel down off the caller's path; `disconnect()` waits for it."""
        closing = asyncio.create_task(self._close_kernel(kernel))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def interrupt(
        self, *, wait_until_started: bool = False, ended: asyncio.Future[Any] | None = None
    ) -> None:
        """Interrupt the code running in the kernel, as Ctrl-C would.

        The running `execute` or `stream` then raises `ExecutionError` with
        ``ename == "KeyboardInterrupt"``; the kernel keeps its state.

        Args:
            wait_until_started: If the execution to interrupt was submitted but the kernel
                has not started it yet, wait until it has (or until it ended): a kernel
                between executions ignores an interrupt, or drops the request it was about to
                run. However long the kernel takes to start it (a busy machine), the interrupt
                is sent only then.
            ended: With `wait_until_started`, what finishes when the execution to interrupt has
                ended (the task consuming its `stream`); by default, the end of every execution
                already submitted.

        Raises:
            KernelConnectionError: If not connected to a kernel, or the gateway cannot be reached.
        """
        kernel_id = self.kernel_id
        assert self._http is not None and self._kernel is not None
        kernel = self._kernel
        if wait_until_started and not kernel.busy.is_set():
            started = asyncio.ensure_future(kernel.busy.wait())
            done = ended if ended is not None else asyncio.ensure_future(kernel.settled.wait())
            try:
                await asyncio.wait({started, done}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
                if ended is None:
                    done.cancel()
            if not kernel.busy.is_set():
                return  # every execution ended before it started: nothing to interrupt
        try:
            await self._http.post(f"/api/kernels/{kernel_id}/interrupt")
        except httpx2.HTTPError as exc:
            raise KernelConnectionError(
                f"The kernel could not be interrupted: the gateway at {self._base_url} did not answer ({exc!r})."
            ) from exc

    async def execute(self, code: str, timeout: float = 120) -> ExecutionResult:
        """Run code and return its complete result.

        Args:
            code: Python code; top-level ``await`` works.
            timeout: Seconds the execution may take.

        Returns:
            The output text and images.

        Raises:
            ExecutionError: If the code raised (with ``ename``, ``evalue``, ``traceback``).
            KernelDiedError: If the kernel died while running the code.
            TimeoutError: If the code ran longer than `timeout`; the kernel is
                interrupted, keeps its state and stays usable.
        """
        async with contextlib.aclosing(self.stream(code, timeout=timeout)) as items:
            async for item in items:
                if isinstance(item, ExecutionResult):
                    return item
        raise AssertionError("stream() always ends with an ExecutionResult")  # pragma: no cover

    async def stream(self, code: str, timeout: float = 120) -> AsyncGenerator[str | ExecutionResult, None]:
        """Run code, yielding output text as it arrives and then the `ExecutionResult`.

        Args:
            code: Python code; top-level ``await`` works.
            timeout: Seconds the execution may take.

        Yields:
            Output chunks (``str``) while the code runs, then one `ExecutionResult`.

        Raises:
            ExecutionError: If the code raised (with ``ename``, ``evalue``, ``traceback``).
            KernelDiedError: If the kernel died while running the code.
            TimeoutError: If the code ran longer than `timeout`; the kernel is
                interrupted, keeps its state and stays usable. Code that does not stop when
                interrupted (blocked in C) gets a fresh kernel instead, and the message says so.
        """
        # The lock covers only submitting the request, never a ``yield``: a stream its caller
        # abandons holds nothing, and the kernel itself runs submitted requests one at a time.
        deadline = time.monotonic() + timeout
        msg_id = uuid.uuid4().hex
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        async with self._lock:
            kernel = self._kernel
            if kernel is None:
                raise KernelConnectionError("The client is not connected to a kernel; call connect() first.")
            if kernel.dead:
                raise KernelDiedError(
                    "The kernel has died and lost its state; call reset() to start a fresh one.",
                    ename="KernelDied",
                )
            kernel.queues[msg_id] = queue
            kernel.pending += 1
            kernel.settled.clear()
            try:
                await kernel.ws.send(_execute_request(kernel.session, msg_id, code))
            except websockets.ConnectionClosed:
                # Gone before the receiver noticed (the gateway died between executions).
                kernel.queues.pop(msg_id, None)
                self._settle(kernel)
                self._kernel_died(kernel)
                raise KernelDiedError(
                    "The connection to the kernel closed before the code could be sent; its "
                    "state is lost. Call reset() to start a fresh kernel.",
                    ename="KernelDied",
                ) from None
        try:
            async for item in self._collect(kernel, queue, deadline, timeout):
                yield item
        finally:
            kernel.queues.pop(msg_id, None)
            kernel.busy.clear()
            self._settle(kernel)
            # Booting the spare only after the first execution keeps it from competing
            # with the kernel that is starting up.
            self._start_spare()

    async def _collect(
        self, kernel: _Kernel, queue: asyncio.Queue[dict[str, Any] | None], deadline: float, timeout: float
    ) -> AsyncGenerator[str | ExecutionResult, None]:
        """Read the execution's messages until the kernel replied and is idle, yielding its output."""
        outcome = _Outcome(KeptText(self.max_output_chars))
        while not (outcome.idle and outcome.replied):
            msg = await self._next_message(kernel, queue, deadline, timeout)
            text = self._read(kernel, outcome, msg)
            if text:
                outcome.kept.append(text)
                yield text
        yield outcome.result()

    async def _next_message(
        self, kernel: _Kernel, queue: asyncio.Queue[dict[str, Any] | None], deadline: float, timeout: float
    ) -> dict[str, Any]:
        """The execution's next message; `TimeoutError` past the deadline, `KernelDiedError` if none will come."""
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                msg = await queue.get()
        except TimeoutError:
            await self._stop_overdue(kernel, queue, timeout)
        if msg is None:
            if kernel.lost_because is not None:
                raise KernelDiedError(
                    f"{kernel.lost_because} Call reset() to start a fresh kernel.",
                    ename="KernelOutputTooLarge",
                    evalue=kernel.lost_because,
                )
            raise KernelDiedError(
                "The kernel died while running the code and lost its state; call reset() to start a fresh one.",
                ename="KernelDied",
            )
        return msg

    async def _stop_overdue(
        self, kernel: _Kernel, queue: asyncio.Queue[dict[str, Any] | None], timeout: float
    ) -> NoReturn:
        """Interrupt an execution past its deadline, or restart the kernel if it ignores that; raises."""
        if await self._interrupt(kernel, queue):
            raise TimeoutError(
                f"The execution did not finish within {timeout:g} s; it was interrupted and "
                "the kernel kept its state."
            ) from None
        # Code blocked in C (a regex, a lock, a native library) never sees SIGINT.
        async with self._lock:
            await self._replace_kernel()
        raise TimeoutError(
            f"The execution did not finish within {timeout:g} s and did not stop when interrupted "
            "(it was blocked in code that ignores interrupts), so the kernel was restarted: "
            "its state (variables, imports, definitions) is lost."
        ) from None

    def _read(self, kernel: _Kernel, outcome: _Outcome, msg: dict[str, Any]) -> str | None:
        """Take in one message of the execution; the output text it carries, if any."""
        content = msg["content"]
        if not isinstance(content, dict):
            return None  # not a Jupyter message's content: nothing in it to read
        match msg["msg_type"]:
            case "execute_reply":
                outcome.replied = True
                outcome.reply(content)
            case "status":
                outcome.idle = content.get("execution_state") == "idle"
            case "execute_input":
                # Published once the kernel takes SIGINT as KeyboardInterrupt; before that
                # it ignores the signal, so interrupt() waits for this.
                kernel.busy.set()
            case "stream":
                return outcome.stream(content)
            case "execute_result" | "display_data":
                return self._display(content.get("data"), outcome.images)
            case "error":
                outcome.error = content
        return None

    @staticmethod
    def _settle(kernel: _Kernel) -> None:
        kernel.pending -= 1
        if kernel.pending == 0:
            kernel.settled.set()

    def _display(self, data: Any, images: list[Path]) -> str | None:
        """Save a display bundle's PNG, or return its text; a note for one that cannot be read."""
        if not isinstance(data, dict):
            return _skipped("a display output", "its data is not a mapping of MIME types")
        if "image/png" in data:
            png = data["image/png"]
            # The signature is checked on the first bytes: b64decode skips what is not base64.
            if not isinstance(png, str) or not _is_png(png):
                return _skipped("an image/png output", "it is not base64-encoded PNG data")
            saved = self._save_image(png)
            if isinstance(saved, str):
                return saved
            images.append(saved)
            return None
        if "text/plain" in data:
            plain = data["text/plain"]
            if not isinstance(plain, str):
                return _skipped("a text/plain output", "it is not a string")
            return strip_ansi(plain) + "\n"
        return None

    async def _interrupt(self, kernel: _Kernel, queue: asyncio.Queue[dict[str, Any] | None]) -> bool:
        """Interrupt the kernel and wait briefly until it is idle again; whether it got there."""
        assert self._http is not None
        with contextlib.suppress(httpx2.HTTPError):
            await self._http.post(f"/api/kernels/{kernel.id}/interrupt")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_INTERRUPT_GRACE):
                while True:
                    msg = await queue.get()
                    if msg is None:
                        return False
                    if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                        return True
        return False

    def _save_image(self, b64: str) -> Path | str:
        """Save a PNG the code displayed; its path, or a line of output saying why it was not saved."""
        try:
            return self._write_image(b64)
        except (ConfinedPathError, OSError, ValueError) as exc:  # ValueError: not base64
            logger.warning("An image was not saved: %s", exc)
            return f"[The image was not saved: {exc}]\n"

    def _write_image(self, b64: str) -> Path:
        # Kernel code can write the images folder (by default in its working directory): the
        # folder is walked without following links, so one put in its place is refused, and the
        # file is created new. Its parent is taken as the application names it.
        folder = Path(os.path.normpath(self.images_dir.absolute()))
        name = f"{uuid.uuid4().hex[:12]}.png"
        folder.parent.mkdir(parents=True, exist_ok=True)
        with Confined(folder.parent, label=repr(str(folder.parent))) as parent:
            fd = parent.open_dir([folder.name] if folder.name else [], create=True)
            try:
                write_new(fd, name, base64.b64decode(b64))
            finally:
                os.close(fd)
        return folder / name

    async def _open_kernel(self) -> _Kernel:
        assert self._http is not None
        # Sending "env" makes the gateway give the kernel only PATH plus the variables
        # the KernelGateway whitelisted, never the gateway's whole environment.
        try:
            response = await self._http.post("/api/kernels", json={"env": {}})
        except httpx2.HTTPError as exc:
            raise KernelConnectionError(
                f"No kernel could be created: the gateway at {self._base_url} did not answer ({exc!r})."
            ) from exc
        if response.status_code != 201:
            raise KernelConnectionError(
                f"The gateway refused to create a kernel (HTTP {response.status_code}): {response.text}"
            )
        kernel_id = response.json()["id"]
        session = uuid.uuid4().hex
        try:
            ws = await websockets.connect(
                f"ws://{self.host}:{self.port}/api/kernels/{kernel_id}/channels?session_id={session}",
                max_size=_MAX_MESSAGE_SIZE,
                ping_interval=self.ping_interval,
                compression=None,
                open_timeout=_OPEN_TIMEOUT,
                additional_headers=self._headers,
                subprotocols=[_WS_PROTOCOL],  # type: ignore[list-item]  # a plain str is a valid subprotocol
            )
            if ws.subprotocol != _WS_PROTOCOL:
                await ws.close()
                raise KernelConnectionError(
                    f"The gateway at {self._base_url} does not speak the {_WS_PROTOCOL} WebSocket "
                    "protocol; use jupyter-kernel-gateway 3 or later."
                )
        except BaseException:
            # Broad: cleanup on the way out of a failure that is re-raised.
            with contextlib.suppress(Exception):
                await self._http.delete(f"/api/kernels/{kernel_id}")
            raise
        kernel = _Kernel(id=kernel_id, ws=ws, session=session)
        kernel.receiver = asyncio.create_task(self._receive(kernel))
        return kernel

    async def _close_kernel(self, kernel: _Kernel, shutdown: bool = True) -> None:
        if kernel.receiver is not None:
            kernel.receiver.cancel()
        # Broad: a connection that is already broken closes with errors of its own.
        with contextlib.suppress(Exception):
            await kernel.ws.close()
        if shutdown and self._http is not None:
            with contextlib.suppress(httpx2.HTTPError):
                await self._http.delete(f"/api/kernels/{kernel.id}")

    async def _receive(self, kernel: _Kernel) -> None:
        """Route every message from the kernel to the execution it belongs to."""
        try:
            async for raw in kernel.ws:
                msg = _decode(raw)
                if msg["msg_type"] == "status" and msg["content"].get("execution_state") in (
                    "restarting",
                    "dead",
                ):
                    self._kernel_died(kernel)
                    continue
                queue = kernel.queues.get(msg["parent_id"])
                if queue is not None:
                    queue.put_nowait(msg)
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is None and exc.sent is not None and exc.sent.code == _MESSAGE_TOO_BIG:
                kernel.lost_because = (
                    f"The kernel sent one message over {_MAX_MESSAGE_SIZE // (1024 * 1024)} MiB (an output that "
                    "large at once, e.g. one print of it), so ipybox closed its connection to the kernel and "
                    "the kernel's state is lost; print less at once (write large data to a file instead)."
                )
        except Exception:  # broad: see below
            # Without the router no execution can finish: report the kernel as lost.
            logger.exception("Unreadable message from kernel %s; treating it as dead.", kernel.id)
        finally:
            self._kernel_died(kernel)

    @staticmethod
    def _kernel_died(kernel: _Kernel) -> None:
        kernel.dead = True
        for queue in kernel.queues.values():
            queue.put_nowait(None)


def _is_png(b64: str) -> bool:
    try:
        return base64.b64decode(b64.lstrip()[:12]).startswith(_PNG_SIGNATURE)
    except (binascii.Error, ValueError):
        return False


def _skipped(what: str, why: str) -> str:
    return f"[ipybox skipped {what}: {why}]\n"


class KeptText:
    """The output text an execution keeps: whole up to `limit` characters, else its head and tail.

    The head takes the first half of the limit and the tail the last output that fits the
    other half; what lies between is counted and dropped, so memory stays bounded however much
    a kernel prints. The MCP server keeps a running cell's output with it too.
    """

    def __init__(self, limit: int) -> None:
        self._head_room = limit // 2
        self._tail_room = limit - self._head_room
        self._head: list[str] = []
        self._tail: deque[str] = deque()
        self._tail_size = 0
        self._dropped = 0

    def append(self, text: str) -> None:
        if self._head_room:
            part = text[: self._head_room]
            self._head.append(part)
            self._head_room -= len(part)
            text = text[len(part) :]
            if not text:
                return
        self._tail.append(text)
        self._tail_size += len(text)
        while self._tail_size > self._tail_room:
            excess = self._tail_size - self._tail_room
            first = self._tail[0]
            if len(first) <= excess:
                self._tail.popleft()
                cut = len(first)
            else:
                self._tail[0] = first[excess:]
                cut = excess
            self._tail_size -= cut
            self._dropped += cut

    def __bool__(self) -> bool:
        return bool(self._head)

    def recent(self, count: int = 10) -> str:
        """The last `count` chunks joined (for progress reports while a cell runs)."""
        tail = list(itertools.islice(reversed(self._tail), count))[::-1]
        head = self._head[len(self._head) - (count - len(tail)) :] if len(tail) < count else []
        return "".join([*head, *tail])

    def text(self, strip: str = "") -> str:
        """Everything kept, with a note where output was dropped; without the `strip` characters at its ends."""
        parts = [*self._head]
        if self._dropped:
            parts.append(
                f"\n[... ipybox dropped {self._dropped} characters of output here: an execution keeps at most "
                f"{self._head_room_total() + self._tail_room} characters, its beginning and its end ...]\n"
            )
        parts.extend(self._tail)
        # Stripping the end parts before joining spares a copy of the whole (megabytes, for a large output).
        return "".join(_strip_parts(parts, strip) if strip else parts)

    def _head_room_total(self) -> int:
        return sum(len(part) for part in self._head) + self._head_room


def _strip_parts(parts: list[str], chars: str) -> list[str]:
    """The parts whose join is ``"".join(parts).strip(chars)``."""
    first = next((i for i, part in enumerate(parts) if part.lstrip(chars)), len(parts))
    last = next((i for i in range(len(parts) - 1, first - 1, -1) if parts[i].rstrip(chars)), first - 1)
    kept = parts[first : last + 1]
    if kept:
        kept[0] = kept[0].lstrip(chars)
        kept[-1] = kept[-1].rstrip(chars)
    return kept


class _AnsiStripper:
    """Removes escape sequences from one output stream whose chunks may split a sequence."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        """The text of this chunk without escape sequences; an unfinished one waits for the next."""
        if not self._held and "\x1b" not in text:
            return text  # nothing to strip (most output): no regular expression runs over it
        text = strip_ansi(self._held + text)
        tail = _ANSI_TAIL.search(text)
        if tail is not None and len(text) - tail.start() <= _ANSI_TAIL_MAX:
            self._held = text[tail.start() :]
            return text[: tail.start()]
        self._held = ""
        return text


def _execute_request(session: str, msg_id: str, code: str) -> bytes:
    header = {
        "msg_id": msg_id,
        "msg_type": "execute_request",
        "username": "ipybox",
        "session": session,
        "version": "5.3",
        "date": "",
    }
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
        # Executions are independent: one that fails must not abort the next one queued.
        "stop_on_error": False,
    }
    return _encode("shell", [header, {}, {}, content])


# The gateway's binary WebSocket protocol passes the kernel's message parts through
# untouched; the JSON one makes the gateway decode and re-encode every message.
# Frame: count of offsets, the offsets (8-byte little-endian each), then the channel
# name and the header, parent header, metadata and content parts they delimit.
_WS_PROTOCOL = "v1.kernel.websocket.jupyter.org"


def _encode(channel: str, parts: list[dict[str, Any]]) -> bytes:
    chunks = [channel.encode(), *(json.dumps(part).encode() for part in parts)]
    offsets = [8 * (len(chunks) + 2)]
    for chunk in chunks:
        offsets.append(offsets[-1] + len(chunk))
    head = len(offsets).to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
    return head + b"".join(chunks)


def _decode(frame: str | bytes) -> dict[str, Any]:
    """Decode the parts of a kernel message that the client routes on and reads."""
    if isinstance(frame, str):
        frame = frame.encode()
    count = int.from_bytes(frame[:8], "little")
    offsets = [int.from_bytes(frame[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]
    header = json.loads(frame[offsets[1] : offsets[2]])
    parent = json.loads(frame[offsets[2] : offsets[3]])
    return {
        "msg_type": header["msg_type"],
        "parent_id": parent.get("msg_id"),
        "content": json.loads(frame[offsets[4] : offsets[5]]),
    }


def _loop_time(deadline: float) -> float:
    """Convert a `time.monotonic()` deadline to the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
