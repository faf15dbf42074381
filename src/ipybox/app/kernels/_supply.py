"""Runs in the application. Where the kernels of one `KernelClient` connection come from and
where they go: each is opened (on the gateway, or taken from a `KernelPool`), given its stdin
answers and, on a gateway elsewhere, a watch on its liveness; set up with the setup cells within
the start timeout; and shut down on the gateway when the client is done with it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import websockets

from ipybox.app.kernels._open import OPEN_TIMEOUT, open_kernel
from ipybox.app.kernels._output import KeptText, Outcome
from ipybox.app.kernels._stdin import InputAnswerer, StdinHandler
from ipybox.app.kernels._wire import KernelChannels, execute_request
from ipybox.errors import ExecutionError, KernelConnectionError, KernelStartTimeoutError

__all__ = ["KernelSupply", "run_setup_cell"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")
_T = TypeVar("_T")
# Seconds between checks that a kernel elsewhere still exists, while an execution waits for it.
_LIVENESS_INTERVAL = 5.0


class KernelSupply:
    """The kernels of one connection of a `KernelClient`, and the HTTP client to their gateway.

    Args:
        base_url: The gateway's base URL.
        headers: The headers the gateway requires (its token).
        ping_interval: Seconds between WebSocket pings that keep a kernel's connection alive.
        max_output_chars: Characters of a setup cell's output kept (see `KernelClient`).
        images_dir: Where a setup cell's images go (see `KernelClient`).
        http: An HTTP client for the gateway to use (and leave open); ``None``: one is made here,
            and closed by `shut`.
        kernel_source: Where new kernels come from; ``None``: they are created on the gateway.
        kernel_name: The kernel spec to start kernels from; ``None``: the gateway's default.
        start_timeout: Seconds a kernel may take to start, connect and run `setup`.
        setup: Gives the cells each kernel runs, in order, before it serves any execution.
        remote: The gateway is elsewhere: its kernels' liveness is watched (see `RemoteChannels`).
        stdin_handler: Answers the tool calls kernels send over their stdin channel.
    """

    def __init__(
        self,
        *,
        base_url: str,
        headers: dict[str, str],
        ping_interval: float,
        max_output_chars: int,
        images_dir: Path,
        http: httpx2.AsyncClient | None = None,
        kernel_source: Callable[[], Awaitable[KernelChannels]] | None = None,
        kernel_name: str | None = None,
        start_timeout: float | None = None,
        setup: Callable[[], list[str]] | None = None,
        remote: bool = False,
        stdin_handler: StdinHandler | None = None,
    ) -> None:
        self.base_url = base_url
        self._own_http = http is None
        # Making an HTTP client costs tens of milliseconds (its TLS context): a pool's is shared.
        self.http = (
            http
            if http is not None
            else httpx2.AsyncClient(
                base_url=base_url,
                headers=headers,
                # A gateway on a cluster answers a kernel's start only once the kernel runs.
                timeout=httpx2.Timeout(max(30.0, start_timeout or 0.0), connect=5.0),
            )
        )
        self._headers = headers
        self._ping_interval = ping_interval
        self._max_output_chars = max_output_chars
        self._images_dir = images_dir
        self._kernel_source = kernel_source
        self._kernel_name = kernel_name
        self._start_timeout = start_timeout
        self._setup = setup
        self._remote = remote
        self._stdin_handler = stdin_handler
        self._answerer = InputAnswerer(stdin_handler) if stdin_handler is not None else None
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()
        # Deleting the kernels of starts given up midway (`open_kernel`'s clean-ups).
        self._abandoned: set[asyncio.Task[None]] = set()
        self._watchers: dict[str, asyncio.Task[None]] = {}

    async def ready(self, kernel: KernelChannels | None = None) -> KernelChannels:
        """`kernel` (else a new one) set up to serve executions, within the start timeout; a kernel
        that fails its setup is shut down.

        Raises:
            KernelConnectionError: If the kernel could not be created, reached or set up.
            KernelStartTimeoutError: If that took longer than the start timeout.
        """
        if kernel is None:
            kernel = await self._bounded(self._open())
        if self._setup is not None:
            try:
                await self._bounded(self._run_setup(kernel, self._setup()))
            except BaseException:
                # Broad: cleanup on the way out of a failure that is re-raised.
                self.close_in_background(kernel)
                raise
        return kernel

    async def open_spare(self) -> KernelChannels:
        """A new kernel, not yet set up, within the start timeout (what a spare kernel's task runs)."""
        # The kernel's start is made here, in the task: a task cancelled before it ran leaves no
        # coroutine behind that never ran.
        return await self._bounded(self._open())

    def close_in_background(self, kernel: KernelChannels) -> None:
        """Shut a kernel down off the caller's path; `shut()` waits for it."""
        closing = asyncio.create_task(self.close(kernel))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self, kernel: KernelChannels, shutdown: bool = True) -> None:
        """Close the kernel's connection and (with `shutdown`) ask the gateway to shut it down."""
        if kernel.receiver is not None:
            kernel.receiver.cancel()
        if kernel.answering is not None:
            kernel.answering.cancel()
        if self._stdin_handler is not None:
            # What the handler holds for this kernel (results, their budget) goes with it.
            self._stdin_handler.execution_ended(kernel.id)
        if (watcher := self._watchers.pop(kernel.id, None)) is not None:
            watcher.cancel()
        # Broad: a connection that is already broken closes with errors of its own.
        with contextlib.suppress(Exception):
            await kernel.ws.close()
        try:
            if shutdown and not self._closed:
                with contextlib.suppress(httpx2.HTTPError):
                    await self.http.delete(f"/api/kernels/{kernel.id}")
        finally:
            if kernel.on_close is not None:
                kernel.on_close()

    async def shut(self, kernels: list[KernelChannels], *, shutdown: bool = True) -> None:
        """Close `kernels`, wait for the kernels closing in the background, then close the HTTP client
        unless it is shared.

        Args:
            kernels: The kernels still in use.
            shutdown: Ask the gateway to shut the kernels down. ``False`` only closes the
                connections (and gives up on the background shutdowns), for a caller that stops
                the gateway with its kernels next.
        """
        closing = list(self._closing)
        abandoned = list(self._abandoned)
        if not shutdown:
            for task in (*closing, *abandoned):
                task.cancel()
        await asyncio.gather(
            *(self.close(kernel, shutdown=shutdown) for kernel in kernels),
            *closing,
            return_exceptions=True,
        )
        self._closed = True
        if shutdown and abandoned:
            # A start given up (a spare at stop, a timeout) is usually made and deleted within
            # moments; one a cluster takes long to finish (a pod scheduled, an image pulled) is
            # cleaned up without the caller, and the HTTP client closes after it.
            _, abandoned_still = await asyncio.wait(abandoned, timeout=_ABANDONED_GRACE)
            if abandoned_still and self._own_http:
                _detach(self._close_after(list(abandoned_still)))
                return
        if self._own_http:
            await self.http.aclose()

    async def _close_after(self, abandoned: list[asyncio.Task[None]]) -> None:
        try:
            await asyncio.gather(*abandoned, return_exceptions=True)
        finally:
            await self.http.aclose()  # also when the loop ends first and cancels this

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
                f"{self.base_url}. A cluster may take longer to start one (scheduling, image pulls): "
                "raise kernel_start_timeout, or check the gateway's kernels and logs."
            ) from None

    async def _run_setup(self, kernel: KernelChannels, cells: list[str]) -> None:
        """Run `cells` in `kernel` before it serves executions; `KernelConnectionError` if one fails."""
        for code in cells:
            await run_setup_cell(
                kernel,
                code,
                gateway=self.base_url,
                max_output_chars=self._max_output_chars,
                images_dir=self._images_dir,
            )

    async def _open(self) -> KernelChannels:
        if self._kernel_source is not None:
            kernel = await self._kernel_source()
        else:
            kernel = await open_kernel(
                self.http,
                self.base_url,
                self._headers,
                self._ping_interval,
                kernel_name=self._kernel_name,
                # With a start timeout, that bounds the handshake too.
                open_timeout=None if self._start_timeout is not None else OPEN_TIMEOUT,
                remote=self._remote,
                # A given-up start's kernel is deleted once made, off every caller's path.
                cleanups=self._abandoned,
            )
        if self._answerer is not None:
            # Set before anything is awaited: the kernel sends nothing on stdin before an
            # execute_request allows it.
            kernel.on_input = self._answerer
        if self._remote:
            self._watchers[kernel.id] = asyncio.create_task(self._watch(kernel))
        return kernel

    async def _watch(self, kernel: KernelChannels) -> None:
        """While executions wait for a kernel elsewhere, check now and then that it still exists.

        A kernel shut down through the gateway's API (culled, evicted, deleted by someone else)
        sends nothing and its WebSocket may stay open: the execution would wait for its whole
        timeout. The gateway tells of no such end, so it is asked; a kernel it no longer knows is
        dead, and the execution ends with `KernelDiedError`. An unreachable gateway is left to the
        WebSocket's pings.
        """
        while not kernel.dead and not self._closed:
            await asyncio.sleep(_LIVENESS_INTERVAL)
            if kernel.pending == 0 or self._closed:
                continue
            try:
                response = await self.http.get(f"/api/kernels/{kernel.id}")
            except httpx2.HTTPError:
                continue
            if response.status_code == 404:
                logger.warning("Kernel %s is gone from the gateway at %s.", kernel.id, self.base_url)
                kernel.died()
                return


# Seconds `shut()` waits for the clean-up of starts given up before leaving it to run on its own.
_ABANDONED_GRACE = 10.0
# Clean-ups that outlive the supply that started them (a strong reference keeps each running).
_DETACHED: set[asyncio.Task[None]] = set()


def _detach(work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(work)
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


async def run_setup_cell(
    kernel: KernelChannels, code: str, *, gateway: str, max_output_chars: int, images_dir: Path
) -> None:
    """Run `code` in `kernel` silently, before it serves executions, and wait until it is done.

    Silent: no execution count and no history, so the agent's first cell stays ``In[1]``.

    Args:
        kernel: The kernel.
        code: The cell.
        gateway: The gateway's base URL, for the error messages.
        max_output_chars: Characters of the cell's output kept.
        images_dir: Where images the cell displays go.

    Raises:
        KernelConnectionError: If the cell failed, or the kernel died or its connection closed.
    """
    msg_id = uuid.uuid4().hex
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    kernel.queues[msg_id] = queue
    outcome = Outcome(KeptText(max_output_chars), images_dir)
    try:
        # Silent: the agent's first cell stays In[1]; a failure still comes in the reply.
        await kernel.ws.send(execute_request(kernel.session, msg_id, code, silent=True))
        while not (outcome.idle and outcome.replied):
            msg = await queue.get()
            if msg is None:
                raise KernelConnectionError(
                    f"The kernel {kernel.id} died while ipybox set it up, on the gateway at {gateway}."
                )
            outcome.read(msg, kernel.busy)
        outcome.result()
    except websockets.ConnectionClosed as exc:
        raise KernelConnectionError(
            f"The connection to kernel {kernel.id} closed while ipybox set it up, on the gateway at {gateway}."
        ) from exc
    except ExecutionError as exc:
        raise KernelConnectionError(
            f"The kernel {kernel.id} on the gateway at {gateway} failed ipybox's setup: "
            f"{exc.ename}: {exc.evalue}. Its Python needs ipybox installed (see deploy/kernel-image)."
        ) from exc
    finally:
        kernel.queues.pop(msg_id, None)
        kernel.busy.clear()
