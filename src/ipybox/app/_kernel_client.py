"""Create IPython kernels on a Kernel Gateway and run code in them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Protocol, Self

import httpx2
import websockets

from ipybox._wire import PROMPT_PREFIX
from ipybox.app._kernel_output import DEFAULT_MAX_OUTPUT_CHARS, ExecutionResult, KeptText, Outcome
from ipybox.app._kernel_wire import (
    MAX_MESSAGE_SIZE,
    WS_PROTOCOL,
    KernelChannels,
    execute_request,
    input_reply,
)
from ipybox.errors import ExecutionError, KernelConnectionError, KernelDiedError

__all__ = ["ExecutionError", "ExecutionResult", "KernelClient", "StdinHandler"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")
_INTERRUPT_GRACE = 5.0
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
        self._http: httpx2.AsyncClient | None = None
        self._kernel: KernelChannels | None = None
        self._spare: asyncio.Task[KernelChannels] | None = None
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
        # Making an HTTP client costs tens of milliseconds (its TLS context): a pool's is shared.
        self._http = self._shared_http or httpx2.AsyncClient(
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
            if self._http is not self._shared_http:
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
        if new is None or new.dead:
            if new is not None:
                self._close_in_background(new)
            new = await self._open_kernel()
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

    async def _open_kernel(self) -> KernelChannels:
        assert self._http is not None
        if self._kernel_source is not None:
            kernel = await self._kernel_source()
        else:
            kernel = await open_kernel(self._http, self.host, self.port, self._headers, self.ping_interval)
        if self.stdin_handler is not None:
            # Set before anything is awaited: the kernel sends nothing on stdin before an
            # execute_request allows it.
            kernel.on_input = self._on_input
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
        if handler is not None and isinstance(prompt, str) and prompt.startswith(PROMPT_PREFIX):
            try:
                value = await handler.input_request(kernel.id, prompt)
            except Exception:  # broad: a failed answer must still end the kernel's wait (as end of input)
                logger.exception("Answering a tool call request of kernel %s failed.", kernel.id)
        with contextlib.suppress(websockets.ConnectionClosed):
            await kernel.ws.send(input_reply(kernel.session, msg["header"], value))

    async def _close_kernel(self, kernel: KernelChannels, shutdown: bool = True) -> None:
        if kernel.receiver is not None:
            kernel.receiver.cancel()
        if kernel.answering is not None:
            kernel.answering.cancel()
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
    host: str,
    port: int,
    headers: dict[str, str],
    ping_interval: float,
    env: dict[str, str] | None = None,
) -> KernelChannels:
    """Create a kernel on the gateway (with `env` for the variables the gateway lets a request
    set) and open its channels; returns once the kernel answers.

    Raises:
        KernelConnectionError: If the gateway refused or did not answer.
    """
    base_url = f"http://{host}:{port}"
    # Sending "env" makes the gateway give the kernel only PATH plus the variables
    # the KernelGateway whitelisted, never the gateway's whole environment.
    try:
        response = await http.post("/api/kernels", json={"env": env or {}})
    except httpx2.HTTPError as exc:
        raise KernelConnectionError(
            f"No kernel could be created: the gateway at {base_url} did not answer ({exc!r})."
        ) from exc
    if response.status_code != 201:
        raise KernelConnectionError(
            f"The gateway refused to create a kernel (HTTP {response.status_code}): {response.text}"
        )
    kernel_id = response.json()["id"]
    session = uuid.uuid4().hex
    try:
        ws = await websockets.connect(
            f"ws://{host}:{port}/api/kernels/{kernel_id}/channels?session_id={session}",
            max_size=MAX_MESSAGE_SIZE,
            ping_interval=ping_interval,
            compression=None,
            open_timeout=_OPEN_TIMEOUT,
            additional_headers=headers,
            subprotocols=[WS_PROTOCOL],  # type: ignore[list-item]  # a plain str is a valid subprotocol
        )
        if ws.subprotocol != WS_PROTOCOL:
            await ws.close()
            raise KernelConnectionError(
                f"The gateway at {base_url} does not speak the {WS_PROTOCOL} WebSocket "
                "protocol; use jupyter-kernel-gateway 3 or later."
            )
    except BaseException:
        # Broad: cleanup on the way out of a failure that is re-raised.
        with contextlib.suppress(Exception):
            await http.delete(f"/api/kernels/{kernel_id}")
        raise
    kernel = KernelChannels(id=kernel_id, ws=ws, session=session)
    kernel.receiver = asyncio.create_task(kernel.receive())
    return kernel


def _loop_time(deadline: float) -> float:
    """Convert a `time.monotonic()` deadline to the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
