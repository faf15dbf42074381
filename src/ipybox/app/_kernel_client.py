"""Create IPython kernels on a Kernel Gateway and run code in them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Protocol, Self, TypeVar

import httpx2
import websockets
from websockets.asyncio.client import ClientConnection

from ipybox._wire import PROMPT_PREFIX
from ipybox.app._kernel_output import DEFAULT_MAX_OUTPUT_CHARS, ExecutionResult, KeptText, Outcome
from ipybox.app._kernel_wire import (
    MAX_MESSAGE_SIZE,
    WS_PROTOCOL,
    KernelChannels,
    RemoteChannels,
    execute_request,
    input_reply,
)
from ipybox.errors import ExecutionError, KernelConnectionError, KernelDiedError, KernelStartTimeoutError

__all__ = ["ExecutionError", "ExecutionResult", "KernelClient", "StdinHandler"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")
_INTERRUPT_GRACE = 5.0
_T = TypeVar("_T")
# Seconds between checks that a kernel elsewhere still exists, while an execution waits for it.
_LIVENESS_INTERVAL = 5.0
# The channels handshake completes only once the new kernel answers; on a busy machine
# a kernel can take longer to boot than the WebSocket library's 10 s default.
_OPEN_TIMEOUT = 60.0
# What ipykernel's input() takes for end of input: it raises EOFError.
_EOF = "\x04"


class StdinHandler(Protocol):
    """Answers the tool call requests a kernel makes on its stdin channel (``ipybox._wire.StdinChannel``)."""

    async def input_request(self, kernel_id: str, prompt: str) -> str:
        """The reply to `prompt` (which starts with ``PROMPT_PREFIX``) from the kernel `kernel_id`.

        The kernel is known from the connection the request came on, never from the request.
        """
        ...

    def execution_ended(self, kernel_id: str) -> None:
        """An execution of the kernel `kernel_id` ended: answer a held request, drop what nobody takes."""
        ...


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
        kernel_source: Where new kernels come from (a `KernelPool`'s hand-out); ``None``: the
            client creates them on the gateway itself.
        http: An HTTP client for the gateway to use (and leave open) instead of making one.
        max_output_chars: Characters of an execution's output text kept for its
            `ExecutionResult`: beyond that, its first and last halves are kept and the middle
            is dropped with a note (`stream` still yields every chunk as it arrives). This
            bounds the memory a kernel that prints without end can make the application use.
        stdin_handler: Answers the tool calls the kernel sends over its stdin channel (mainly for a
            kernel on another host). Executions then allow stdin: a request whose prompt starts with
            ``PROMPT_PREFIX`` goes to the handler, and a plain ``input()`` in the code raises
            ``EOFError`` (nobody types into a kernel ipybox runs). ``None``: stdin is not allowed,
            and ``input()`` raises ``StdinNotImplementedError``.
        url: The gateway's base URL (``http://`` or ``https://``, with a path prefix if it has
            one), for a gateway elsewhere; replaces `host` and `port`.
        kernel_name: The kernel spec to start kernels from; ``None``: the gateway's default.
        start_timeout: Seconds a kernel may take to start, connect and run `setup`; past them
            `KernelStartTimeoutError`. ``None``: the gateway's own limits apply.
        setup: Gives the cells each kernel runs, in order, before it serves any execution (at
            connect, at every reset and restart); called each time, so that they can change.
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
        kernel_source: Callable[[], Awaitable[KernelChannels]] | None = None,
        http: httpx2.AsyncClient | None = None,
        stdin_handler: StdinHandler | None = None,
        url: str | None = None,
        kernel_name: str | None = None,
        start_timeout: float | None = None,
        setup: Callable[[], list[str]] | None = None,
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
        self._kernel_source = kernel_source
        self._shared_http = http
        self.stdin_handler = stdin_handler
        self._url = url.rstrip("/") if url is not None else None
        self._kernel_name = kernel_name
        self._start_timeout = start_timeout
        self._setup = setup
        self._http: httpx2.AsyncClient | None = None
        self._kernel: KernelChannels | None = None
        self._spare: asyncio.Task[KernelChannels] | None = None
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        self._watchers: dict[str, asyncio.Task[None]] = {}

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
        return self._url if self._url is not None else f"http://{self.host}:{self.port}"

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
        # Making an HTTP client costs tens of milliseconds (its TLS context): a pool's is shared.
        self._http = self._shared_http or httpx2.AsyncClient(
            base_url=self._base_url,
            headers=self._headers,
            # A gateway on a cluster answers a kernel's start only once the kernel runs.
            timeout=httpx2.Timeout(max(30.0, self._start_timeout or 0.0), connect=5.0),
        )
        last_error: Exception | None = None
        for attempt in range(max(retries, 1)):
            try:
                self._kernel = await self._ready_kernel(None)
                break
            except KernelStartTimeoutError:
                await self._abandon_connect()
                raise
            except (httpx2.HTTPError, OSError, websockets.WebSocketException, KernelConnectionError) as exc:
                last_error = exc
                if attempt + 1 < retries:
                    await asyncio.sleep(retry_interval)
        else:
            await self._abandon_connect()
            raise KernelConnectionError(
                f"Could not create a kernel on the gateway at {self._base_url} after {retries} tries "
                f"(last error: {last_error}). Is the gateway running on that host and port?"
            ) from last_error

    async def _abandon_connect(self) -> None:
        """After a failed `connect()`: shut down kernels it left behind, then close the HTTP client."""
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._http is not None and self._http is not self._shared_http:
            await self._http.aclose()
        self._http = None

    def _start_spare(self) -> None:
        """Start booting the kernel the next `reset()` will switch to."""
        if self.spare_kernel and self._spare is None and self._http is not None:
            self._spare = asyncio.create_task(self._open_spare())
            # A spare that fails is replaced on reset(); its error must not go unretrieved.
            self._spare.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _open_spare(self) -> KernelChannels:
        # The kernel's start is made here, in the task: a task cancelled before it ran leaves no
        # coroutine behind that never ran.
        return await self._bounded(self._open_kernel())

    async def disconnect(self, *, shutdown_kernels: bool = True) -> None:
        """Shut down the kernel (and the spare) and close the connection.

        Args:
            shutdown_kernels: Ask the gateway to shut the kernels down. ``False`` only closes
                the connections, for a caller that stops the gateway with its kernels next.
        """
        kernel, self._kernel = self._kernel, None
        spare, self._spare = self._spare, None
        to_close: list[KernelChannels] = [kernel] if kernel else []
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
        if self._http is not None and self._http is not self._shared_http:
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
        new: KernelChannels | None = None
        if spare is not None:
            try:
                new = await spare
            except Exception:  # broad: a spare kernel that failed to start is replaced by a new one below
                new = None
        if new is not None and new.dead:
            self._close_in_background(new)
            new = None
        if new is not None and self._setup is not None:
            try:
                new = await self._ready_kernel(new)
            except KernelStartTimeoutError:
                raise
            except KernelConnectionError:
                new = None  # a spare whose setup failed (it was shut down): a new kernel below
        if new is None:
            new = await self._ready_kernel(None)
        self._kernel = new
        self._start_spare()
        self._close_in_background(old)

    def _close_in_background(self, kernel: KernelChannels) -> None:
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
                allow_stdin = self.stdin_handler is not None
                await kernel.ws.send(execute_request(kernel.session, msg_id, code, allow_stdin))
            except websockets.ConnectionClosed:
                # Gone before the receiver noticed (the gateway died between executions).
                kernel.queues.pop(msg_id, None)
                kernel.settle()
                kernel.died()
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
            kernel.settle()
            if self.stdin_handler is not None:
                self.stdin_handler.execution_ended(kernel.id)
            # Booting the spare only after the first execution keeps it from competing
            # with the kernel that is starting up.
            self._start_spare()

    async def _collect(
        self,
        kernel: KernelChannels,
        queue: asyncio.Queue[dict[str, Any] | None],
        deadline: float,
        timeout: float,
    ) -> AsyncGenerator[str | ExecutionResult, None]:
        """Read the execution's messages until the kernel replied and is idle, yielding its output."""
        outcome = Outcome(KeptText(self.max_output_chars), self.images_dir)
        while not (outcome.idle and outcome.replied):
            msg = await self._next_message(kernel, queue, deadline, timeout)
            text = outcome.read(msg, kernel.busy)
            if text:
                outcome.kept.append(text)
                yield text
        yield outcome.result()

    async def _next_message(
        self,
        kernel: KernelChannels,
        queue: asyncio.Queue[dict[str, Any] | None],
        deadline: float,
        timeout: float,
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
        self, kernel: KernelChannels, queue: asyncio.Queue[dict[str, Any] | None], timeout: float
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

    async def _interrupt(self, kernel: KernelChannels, queue: asyncio.Queue[dict[str, Any] | None]) -> bool:
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

    async def _ready_kernel(self, kernel: KernelChannels | None) -> KernelChannels:
        """`kernel` (else a new one) set up to serve executions, within the start timeout; a kernel
        that fails its setup is shut down."""
        if kernel is None:
            kernel = await self._bounded(self._open_kernel())
        if self._setup is not None:
            try:
                await self._bounded(self._run_setup(kernel, self._setup()))
            except BaseException:
                # Broad: cleanup on the way out of a failure that is re-raised.
                self._close_in_background(kernel)
                raise
        return kernel

    async def _bounded(self, work: Coroutine[Any, Any, _T]) -> _T:
        """`work` (a kernel's start or setup) within `start_timeout`."""
        if self._start_timeout is None:
            return await work
        scope = asyncio.timeout(self._start_timeout)
        try:
            async with scope:
                return await work
        except TimeoutError:
            if not scope.expired():
                raise  # a limit of its own inside (the WebSocket handshake's), not this one
            raise KernelStartTimeoutError(
                f"No kernel was ready within kernel_start_timeout={self._start_timeout:g} s on the gateway at "
                f"{self._base_url}. A cluster may take longer to start one (scheduling, image pulls): "
                "raise kernel_start_timeout, or check the gateway's kernels and logs."
            ) from None

    async def _run_setup(self, kernel: KernelChannels, cells: list[str]) -> None:
        """Run `cells` in `kernel` before it serves executions; `KernelConnectionError` if one fails."""
        for code in cells:
            await self._run_setup_cell(kernel, code)

    async def _run_setup_cell(self, kernel: KernelChannels, code: str) -> None:
        msg_id = uuid.uuid4().hex
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        kernel.queues[msg_id] = queue
        outcome = Outcome(KeptText(self.max_output_chars), self.images_dir)
        try:
            # Silent: the agent's first cell stays In[1]; a failure still comes in the reply.
            await kernel.ws.send(execute_request(kernel.session, msg_id, code, silent=True))
            while not (outcome.idle and outcome.replied):
                msg = await queue.get()
                if msg is None:
                    raise KernelConnectionError(
                        f"The kernel {kernel.id} died while ipybox set it up, on the gateway at {self._base_url}."
                    )
                outcome.read(msg, kernel.busy)
            outcome.result()
        except websockets.ConnectionClosed as exc:
            raise KernelConnectionError(
                f"The connection to kernel {kernel.id} closed while ipybox set it up, on the gateway at {self._base_url}."
            ) from exc
        except ExecutionError as exc:
            raise KernelConnectionError(
                f"The kernel {kernel.id} on the gateway at {self._base_url} failed ipybox's setup: "
                f"{exc.ename}: {exc.evalue}. Its Python needs ipybox installed (see deploy/kernel-image)."
            ) from exc
        finally:
            kernel.queues.pop(msg_id, None)
            kernel.busy.clear()

    async def _open_kernel(self) -> KernelChannels:
        assert self._http is not None
        if self._kernel_source is not None:
            kernel = await self._kernel_source()
        else:
            kernel = await open_kernel(
                self._http,
                self._base_url,
                self._headers,
                self.ping_interval,
                kernel_name=self._kernel_name,
                # With a start timeout, that bounds the handshake too.
                open_timeout=None if self._start_timeout is not None else _OPEN_TIMEOUT,
                remote=self._url is not None,
            )
        if self.stdin_handler is not None:
            # Set before anything is awaited: the kernel sends nothing on stdin before an
            # execute_request allows it.
            kernel.on_input = self._on_input
        if self._url is not None:
            self._watchers[kernel.id] = asyncio.create_task(self._watch(kernel))
        return kernel

    def _on_input(self, kernel: KernelChannels, msg: dict[str, Any]) -> None:
        """Answer an input_request of the kernel's stdin channel (written by code in the kernel: hostile)."""
        # ipykernel waits for one reply at a time: a new request means nobody reads the answer to
        # the one before any more. So at most one answer is made per kernel, however many come.
        if kernel.answering is not None:
            kernel.answering.cancel()
        kernel.answering = asyncio.create_task(self._answer_input(kernel, msg))

    async def _answer_input(self, kernel: KernelChannels, msg: dict[str, Any]) -> None:
        content = msg["content"]
        prompt = content.get("prompt") if isinstance(content, dict) else None
        handler = self.stdin_handler
        value = _EOF
        # Only while an execution runs: a request made between executions (by a thread a cell
        # left behind) would hold results and budget that no execution's end ever frees.
        running = kernel.pending > 0
        if handler is not None and running and isinstance(prompt, str) and prompt.startswith(PROMPT_PREFIX):
            try:
                value = await handler.input_request(kernel.id, prompt)
            except Exception:  # broad: a failed answer must still end the kernel's wait (as end of input)
                logger.exception("Answering a tool call request of kernel %s failed.", kernel.id)
        with contextlib.suppress(websockets.ConnectionClosed):
            await kernel.ws.send(input_reply(kernel.session, msg["header"], value))

    async def _watch(self, kernel: KernelChannels) -> None:
        """While executions wait for a kernel elsewhere, check now and then that it still exists.

        A kernel shut down through the gateway's API (culled, evicted, deleted by someone else)
        sends nothing and its WebSocket may stay open: the execution would wait for its whole
        timeout. The gateway tells of no such end, so it is asked; a kernel it no longer knows is
        dead, and the execution ends with `KernelDiedError`. An unreachable gateway is left to the
        WebSocket's pings.
        """
        while not kernel.dead:
            await asyncio.sleep(_LIVENESS_INTERVAL)
            if kernel.pending == 0 or self._http is None:
                continue
            try:
                response = await self._http.get(f"/api/kernels/{kernel.id}")
            except httpx2.HTTPError:
                continue
            if response.status_code == 404:
                logger.warning("Kernel %s is gone from the gateway at %s.", kernel.id, self._base_url)
                kernel.died()
                return

    async def _close_kernel(self, kernel: KernelChannels, shutdown: bool = True) -> None:
        if kernel.receiver is not None:
            kernel.receiver.cancel()
        if kernel.answering is not None:
            kernel.answering.cancel()
        if self.stdin_handler is not None:
            # What the handler holds for this kernel (results, their budget) goes with it.
            self.stdin_handler.execution_ended(kernel.id)
        if (watcher := self._watchers.pop(kernel.id, None)) is not None:
            watcher.cancel()
        # Broad: a connection that is already broken closes with errors of its own.
        with contextlib.suppress(Exception):
            await kernel.ws.close()
        try:
            if shutdown and self._http is not None:
                with contextlib.suppress(httpx2.HTTPError):
                    await self._http.delete(f"/api/kernels/{kernel.id}")
        finally:
            if kernel.on_close is not None:
                kernel.on_close()


async def open_kernel(
    http: httpx2.AsyncClient,
    base_url: str,
    headers: dict[str, str],
    ping_interval: float,
    env: dict[str, str] | None = None,
    *,
    kernel_name: str | None = None,
    open_timeout: float | None = _OPEN_TIMEOUT,
    remote: bool = False,
) -> KernelChannels:
    """Create a kernel on the gateway at `base_url` (with `env` for the variables the gateway lets
    a request set, from `kernel_name`'s spec) and open its channels; returns once the kernel answers.
    `remote`: the gateway is elsewhere (see `RemoteChannels`).

    Raises:
        KernelConnectionError: If the gateway refused or did not answer.
    """
    # Sending "env" makes the gateway give the kernel only PATH plus the variables
    # the KernelGateway whitelisted, never the gateway's whole environment.
    body: dict[str, Any] = {"env": env or {}}
    if kernel_name is not None:
        body["name"] = kernel_name
    try:
        response = await http.post("/api/kernels", json=body)
    except httpx2.HTTPError as exc:
        raise KernelConnectionError(
            f"No kernel could be created: the gateway at {base_url} did not answer ({exc!r})."
        ) from exc
    if response.status_code in (401, 403):
        raise KernelConnectionError(
            f"The gateway at {base_url} refused the credentials (HTTP {response.status_code}); "
            "check its token (kernel_gateway_token)."
        )
    if response.status_code != 201:
        raise KernelConnectionError(
            f"The gateway refused to create a kernel (HTTP {response.status_code}): {response.text}"
        )
    kernel_id = response.json()["id"]
    session = uuid.uuid4().hex
    ws_base = "ws" + base_url.removeprefix("http")  # http -> ws, https -> wss
    try:
        ws = await websockets.connect(
            f"{ws_base}/api/kernels/{kernel_id}/channels?session_id={session}",
            max_size=MAX_MESSAGE_SIZE,
            ping_interval=ping_interval,
            compression=None,
            open_timeout=open_timeout,
            additional_headers=headers,
            subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]  # a plain str is a valid subprotocol
        )
    except BaseException:
        # Broad: cleanup on the way out of a failure that is re-raised.
        with contextlib.suppress(Exception):
            await http.delete(f"/api/kernels/{kernel_id}")
        raise
    # A gateway on Jupyter Server 1 (Enterprise Gateway 3.3) speaks only plain JSON.
    json_protocol = ws.subprotocol != WS_PROTOCOL
    channels: ClientConnection | RemoteChannels = ws
    if remote or json_protocol:
        channels = RemoteChannels(ws, json_protocol=json_protocol)
    kernel = KernelChannels(id=kernel_id, ws=channels, session=session)
    kernel.receiver = asyncio.create_task(kernel.receive())
    return kernel


def _loop_time(deadline: float) -> float:
    """Convert a `time.monotonic()` deadline to the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
