"""The kernels a `KernelPool` keeps ready, and when it starts more.

Runs in the application. `KernelStock` owns the ready kernels, the tasks starting new ones and
the executors waiting for one, and the refill policy: start kernels until the ready and starting
ones cover the pool's size and its waiters, at most `max_starting` at once, only after hand-outs
have paused for `refill_delay`, and (for kernels kept ahead of need) only while the machine's
available memory has room for one more.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

from ipybox.app.pool import _capacity
from ipybox.app.pool._capacity import MIB, POOLED_KERNEL_BYTES
from ipybox.app.pool._kernel import PoolKernel
from ipybox.errors import KernelConnectionError

__all__ = ["KernelStock"]

logger = logging.getLogger(__name__)


class KernelStock:
    """The ready kernels of a pool, and the policy that starts more.

    Args:
        size: Kernels kept ready.
        max_starting: Kernels started at once.
        refill_delay: Seconds without a hand-out before refilling.
        start: Starts one kernel to keep ready; ``None`` when the pool was stopped meanwhile.
        close: Shuts down a kernel found dead among the ready ones.
        running: Whether the pool is started.

    Raises:
        ValueError: If an argument is out of range or of the wrong kind.
    """

    def __init__(
        self,
        size: int,
        max_starting: int,
        refill_delay: float,
        *,
        start: Callable[[], Awaitable[PoolKernel | None]],
        close: Callable[[PoolKernel], Awaitable[None]],
        running: Callable[[], bool],
    ) -> None:
        for name, value, least in (("size", size, 0), ("max_starting", max_starting, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"{name} must be a whole number of kernels, at least {least}, not {value!r}."
                )
        if isinstance(refill_delay, bool) or not isinstance(refill_delay, int | float) or refill_delay < 0:
            raise ValueError(f"refill_delay must be a number of seconds, at least 0, not {refill_delay!r}.")
        self.size = size
        self.max_starting = max_starting
        self.refill_delay = refill_delay
        self._start = start
        self._close = close
        self._running = running
        # Whether the last refill stopped short for want of memory (said once, until it recovers).
        self._memory_short = False
        self._ready: collections.deque[PoolKernel] = collections.deque()
        self._starting: set[asyncio.Task[None]] = set()
        self._waiting = 0
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()
        self._refill_timer: asyncio.TimerHandle | None = None

    @property
    def ready(self) -> int:
        """Kernels ready to be handed out now."""
        return len(self._ready)

    async def filled(self, on_progress: Callable[[int], None] | None = None) -> None:
        """Wait until `size` kernels are ready, calling `on_progress` with the number ready each
        time it changes.

        Raises:
            KernelConnectionError: If the pool could not start a kernel.
        """
        shown = -1
        while True:
            changed = self._changed
            if self.ready != shown and on_progress is not None:
                on_progress(self.ready)
            shown = self.ready
            if shown >= self.size:
                return
            if self._failure is not None and not self._starting:
                raise KernelConnectionError(
                    f"The kernel pool could not start a kernel ({self._failure}); check the gateway's "
                    "log (log_level='DEBUG') and the kernel environment."
                )
            await changed.wait()

    async def take(self) -> PoolKernel:
        """A ready kernel, waiting for one to start if none is.

        Raises:
            KernelConnectionError: If the pool could not start a kernel.
            RuntimeError: If the pool was stopped meanwhile.
        """
        self._waiting += 1
        try:
            self._failure = None
            while True:
                changed = self._changed
                while self._ready:
                    kernel = self._ready.popleft()
                    if not kernel.channels.dead:
                        return kernel
                    await self._close(kernel)
                if self._failure is not None and not self._starting:
                    raise KernelConnectionError(
                        f"The kernel pool could not start a kernel ({self._failure}); check the gateway's "
                        "log lines above, or stop() and start() the pool."
                    ) from self._failure
                self.refill()
                await changed.wait()
                if not self._running():
                    raise RuntimeError("The kernel pool was stopped.")
        finally:
            self._waiting -= 1
            self.refill_later()

    def pop_live(self) -> PoolKernel | None:
        """The first ready kernel still alive, if any (dead ones before it are dropped)."""
        while self._ready:
            kernel = self._ready.popleft()
            if not kernel.channels.dead:
                return kernel
        return None

    def refill(self) -> None:
        """Start kernels until the ready ones and those starting cover the pool and its waiters."""
        if not self._running():
            return
        while (
            len(self._ready) + len(self._starting) < self.size + self._waiting
            and len(self._starting) < self.max_starting
            and (self._failure is None or self._waiting)
        ):
            # A kernel a waiting executor needs is started whatever the memory; one kept ready
            # ahead only while the machine has room for it (`_capacity.memory_allows`).
            for_waiter = len(self._ready) + len(self._starting) < self._waiting
            if not for_waiter and not _capacity.memory_allows(POOLED_KERNEL_BYTES):
                if not self._memory_short:
                    logger.warning(
                        "The kernel pool keeps %d kernels ready, not %d: the machine's available memory "
                        "holds no more (each is budgeted %d MiB beside a reserve); executors still get "
                        "kernels, started when they ask.",
                        len(self._ready) + len(self._starting),
                        self.size,
                        POOLED_KERNEL_BYTES // MIB,
                    )
                self._memory_short = True
                break
            self._memory_short = False
            task = asyncio.create_task(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._started)

    def refill_later(self) -> None:
        """Refill once hand-outs have paused for `refill_delay`: a kernel starting takes a core and
        the gateway's attention, which the executor just handed a kernel needs for its first cells."""
        if self._refill_timer is not None:
            self._refill_timer.cancel()
        self._refill_timer = asyncio.get_running_loop().call_later(self.refill_delay, self.refill)

    def cancel_refill(self) -> None:
        """Cancel a refill waiting for hand-outs to pause."""
        if self._refill_timer is not None:
            self._refill_timer.cancel()

    def restarted(self) -> None:
        """Forget the last failure and refill (the gateway was replaced)."""
        self._failure = None
        self.refill()

    async def stop_starting(self) -> None:
        """Cancel the kernels being started, and wait until they have ended."""
        starting = list(self._starting)
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)

    def empty(self) -> list[PoolKernel]:
        """Take every ready kernel out (for the caller to close)."""
        ready, self._ready = list(self._ready), collections.deque()
        return ready

    def notify(self) -> None:
        """Wake whoever waits for a change (a kernel ready, a start failed, the pool stopped)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _start_one(self) -> None:
        kernel = await self._start()
        if kernel is None:
            return
        self._failure = None
        self._ready.append(kernel)

    def _started(self, task: asyncio.Task[None]) -> None:
        self._starting.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._failure = error
        self.notify()
        self.refill()
