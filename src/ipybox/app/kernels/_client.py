"""Runs in the application. `KernelClient`: one connection to a kernel on a Kernel Gateway, which
runs code in it (`execute`, `stream`), interrupts it, and swaps in a fresh kernel (`reset`, or
when an execution ignores an interrupt). Its kernels come from a `KernelSupply`."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Self

import httpx2
import websockets

from ipybox.app.kernels._output import DEFAULT_MAX_OUTPUT_CHARS, ExecutionResult, KeptText, Outcome
from ipybox.app.kernels._stdin import StdinHandler
from ipybox.app.kernels._supply import KernelSupply
from ipybox.app.kernels._wire import KernelChannels, execute_request
from ipybox.errors import ExecutionError, KernelConnectionError, KernelDiedError, KernelStartTimeoutError

__all__ = ["ExecutionError", "ExecutionResult", "KernelClient"]

_INTERRUPT_GRACE = 5.0


class KernelClient:
    """Runs code in an IPython kernel served by a `KernelGateway`.

    State persists between executions: variables, imports and definitions of one
    `execute` are there in the next. `reset()` swaps in a fresh kernel; a spare one is
    kept warm in the background so that a reset takes milliseconds.

    Example:
        ```python
        async with KernelClient(port=gateway.port) as client:
            await client.execute("x = 21")
            result = await client.execute("print(x * 2)")
            assert result.text == "42"
        ```

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
        self._supply: KernelSupply | None = None
        self._kernel: KernelChannels | None = None
        self._spare: asyncio.Task[KernelChannels] | None = None
        self._lock = asyncio.Lock()

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
        supply = self._supply = KernelSupply(
            base_url=self._base_url,
            headers=self._headers,
            ping_interval=self.ping_interval,
            max_output_chars=self.max_output_chars,
            images_dir=self.images_dir,
            http=self._shared_http,
            kernel_source=self._kernel_source,
            kernel_name=self._kernel_name,
            start_timeout=self._start_timeout,
            setup=self._setup,
            remote=self._url is not None,
            stdin_handler=self.stdin_handler,
        )
        last_error: Exception | None = None
        for attempt in range(max(retries, 1)):
            try:
                self._kernel = await supply.ready()
                break
            except KernelStartTimeoutError:
                await self._abandon_connect(supply)
                raise
            except (httpx2.HTTPError, OSError, websockets.WebSocketException, KernelConnectionError) as exc:
                last_error = exc
                if attempt + 1 < retries:
                    await asyncio.sleep(retry_interval)
        else:
            await self._abandon_connect(supply)
            raise KernelConnectionError(
                f"Could not create a kernel on the gateway at {self._base_url} after {retries} tries "
                f"(last error: {last_error}). Is the gateway running on that host and port?"
            ) from last_error

    async def _abandon_connect(self, supply: KernelSupply) -> None:
        """After a failed `connect()`: shut down kernels it left behind, then close the HTTP client."""
        self._supply = None
        await supply.shut([])

    def _start_spare(self) -> None:
        """Start booting the kernel the next `reset()` will switch to."""
        if self.spare_kernel and self._spare is None and self._supply is not None:
            self._spare = asyncio.create_task(self._supply.open_spare())
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
        # Let go of here (a stream that ends meanwhile starts no spare on it: its kernel is no
        # longer the client's).
        supply, self._supply = self._supply, None
        if supply is not None:
            await supply.shut(to_close, shutdown=shutdown_kernels)

    async def reset(self) -> None:
        """Replace the kernel with a fresh one: all variables, imports and definitions are gone.

        Raises:
            KernelConnectionError: If no fresh kernel could be created.
        """
        async with self._lock:
            await self._replace_kernel()

    async def _replace_kernel(self) -> None:
        """Switch to the spare (or a new kernel) and shut the old one down; the lock is held."""
        old, supply = self._kernel, self._supply
        if old is None or supply is None:
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
            supply.close_in_background(new)
            new = None
        if new is not None:
            try:
                new = await supply.ready(new)
            except KernelStartTimeoutError:
                raise
            except KernelConnectionError:
                new = None  # a spare whose setup failed (it was shut down): a new kernel below
        if new is None:
            new = await supply.ready()
        self._kernel = new
        self._start_spare()
        supply.close_in_background(old)

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
        assert self._supply is not None and self._kernel is not None
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
            await self._supply.http.post(f"/api/kernels/{kernel_id}/interrupt")
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

    def stream(self, code: str, timeout: float = 120) -> AsyncGenerator[str | ExecutionResult, None]:
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
        # The execution's own generator, not one around it: closing it (as `execute` does at the
        # result) runs its clean-up at once, not a loop turn later in a finalizer's task.
        return self._execution(code, timeout, Outcome(KeptText(self.max_output_chars), self.images_dir))

    async def evaluate(self, code: str, expressions: dict[str, str], timeout: float = 120) -> dict[str, str]:
        """Run `code` silently, then the text (``repr``) of each of `expressions`' values.

        The values come in the execution's reply, on the shell channel, which a gateway does not
        rate-limit as it does output: for data a remote kernel sends back.

        Raises:
            ExecutionError: If the code or an expression raised.
            KernelDiedError: If the kernel died meanwhile.
            TimeoutError: As for `stream`.
        """
        outcome = Outcome(KeptText(self.max_output_chars), self.images_dir)
        async for _ in self._execution(code, timeout, outcome, expressions):
            pass
        values: dict[str, str] = {}
        for name in expressions:
            value = outcome.expressions.get(name)
            value = value if isinstance(value, dict) else {}
            text = (value.get("data") or {}).get("text/plain") if value.get("status") == "ok" else None
            if not isinstance(text, str):
                ename, evalue = (
                    str(value.get("ename", "Error")),
                    str(value.get("evalue", "no value came back")),
                )
                raise ExecutionError(f"{ename}: {evalue}", ename=ename, evalue=evalue)
            values[name] = text
        return values

    async def _execution(
        self, code: str, timeout: float, outcome: Outcome, expressions: dict[str, str] | None = None
    ) -> AsyncGenerator[str | ExecutionResult, None]:
        """Run code (silently, with `expressions`), yielding its output and result into `outcome`."""
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
                silent = expressions is not None
                request = execute_request(
                    kernel.session, msg_id, code, allow_stdin, silent=silent, user_expressions=expressions
                )
                await kernel.ws.send(request)
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
            async for item in self._collect(kernel, queue, deadline, timeout, outcome):
                yield item
        finally:
            kernel.queues.pop(msg_id, None)
            kernel.busy.clear()
            kernel.settle()
            if self.stdin_handler is not None:
                self.stdin_handler.execution_ended(kernel.id)
            # Booting the spare only after the first execution keeps it from competing
            # with the kernel that is starting up; none for a kernel already let go.
            if self._kernel is kernel:
                self._start_spare()

    async def _collect(
        self,
        kernel: KernelChannels,
        queue: asyncio.Queue[dict[str, Any] | None],
        deadline: float,
        timeout: float,
        outcome: Outcome,
    ) -> AsyncGenerator[str | ExecutionResult, None]:
        """Read the execution's messages until the kernel replied and is idle, yielding its output."""
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
        assert self._supply is not None
        with contextlib.suppress(httpx2.HTTPError):
            await self._supply.http.post(f"/api/kernels/{kernel.id}/interrupt")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_INTERRUPT_GRACE):
                while True:
                    msg = await queue.get()
                    if msg is None:
                        return False
                    if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                        return True
        return False


def _loop_time(deadline: float) -> float:
    """Convert a `time.monotonic()` deadline to the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())
