"""`KernelPool`: one kernel gateway for many executors, and kernels started before they are needed.

Runs in the application. The pool owns one `KernelGateway` and keeps `size` kernels on it ready
(started, connected and warm; `_stock.py` decides when to start more). An executor made with
``pool=`` takes one when it starts (and another at each `reset()`), through its `PooledKernels`,
instead of starting a gateway and waiting for a kernel. A kernel is handed out once, and only then
learns whose it is: a hidden first cell gives it its executor's tool server address and token, and
(sandboxed) the pool links that executor's tool server socket into a folder made for this kernel
alone before it started, which no other kernel can see (`_kernel.py`). Until then a ready
kernel has no way to any tool server. Each kernel has private temporary and IPython folders
(sandboxed: made by the kernel's launcher; not sandboxed: given by the pool), removed when it ends.

When the gateway dies, the first executor to notice starts a new one; the others find it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx2

from ipybox._wire import ToolServerEnv
from ipybox.app import sandbox as _sandbox
from ipybox.app._settings import ExecutorSettings
from ipybox.app.approval import default_audit_path
from ipybox.app.kernels import KernelChannels, KernelGateway, open_kernel
from ipybox.app.mcp_client import ServerRegistry, default_registry
from ipybox.app.pool._kernel import WARM_UP, PoolKernel, hand_out, make_folder, run_hidden
from ipybox.app.pool._places import Place, PoolPlaces
from ipybox.app.pool._pooled_kernels import PooledKernels
from ipybox.app.pool._settings import check_executor, check_hidden, pool_gateway
from ipybox.app.pool._stock import KernelStock
from ipybox.app.sandbox import KernelConfinement

__all__ = ["KernelPool"]

_STOP_GRACE = 0.05


class KernelPool:
    """One kernel gateway shared by many `CodeExecutor` objects, with kernels kept ready for them.

    An executor made with ``CodeExecutor(..., pool=pool)`` takes a ready kernel from the pool when it
    starts and at each `reset()`, so its first cell runs without waiting for a kernel to start; it
    keeps its own tool server, approval and token. A kernel is handed out once and never again, and
    gets its executor's token and tool server only then. The pool fixes what the kernels are (the
    arguments below, which mean what they mean for `CodeExecutor`): an executor whose settings
    differ is refused with `ValueError`. Stop the executors before the pool: the pool's `stop()`
    ends every kernel.

    Example:
        .. code-block:: python

            async with KernelPool(size=4, sandbox=True) as pool:
                async with CodeExecutor(sandbox=True, pool=pool) as executor:
                    result = await executor.execute("print(1 + 1)")

    Args:
        size: Kernels kept ready. ``0``: none; each executor then waits for its kernel to start.
            The pool keeps fewer while the machine's available memory (``MemAvailable``) less a
            reserve (a quarter of it, at least 512 MiB) has no room for one more at 128 MiB each
            (a warning says so once); an executor that asks still gets a kernel.
        max_starting: Kernels started at once while the pool fills up again (each start takes a
            core for about a second).
        refill_delay: Seconds without a hand-out before the pool starts kernels to refill itself,
            so that starting kernels does not slow the executors that just took theirs.
        sandbox: See `CodeExecutor`; the same for the rest.
        sandbox_config: See `CodeExecutor`.
        working_dir: See `CodeExecutor`.
        kernel_env: See `CodeExecutor`.
        memory_limit: See `CodeExecutor` (per kernel).
        max_processes: See `CodeExecutor` (per kernel).
        approve_shell_cmds: See `CodeExecutor`.
        require_shell_escape: See `CodeExecutor`.
        sandbox_hidden: See `CodeExecutor`; the default audit trail's folder is always hidden.
        warm_imports: See `CodeExecutor`. A kernel counts as ready only once it has imported them;
            an executor on the pool gets kernels with the pool's, whatever its own.
        kernel_gateway_host: Host the gateway binds to.
        log_level: Log level of the gateway.
        registry: The trusted registry whose folder sandboxed kernels can never write; executors on
            the pool must use one in the same folder (default: this user's).
        new_folder: Makes a new, empty working folder inside `working_dir`: each kernel the pool
            starts ahead then works in one of its own (for agents that must not share one), and
            `claim()` hands out such a folder with its ready kernel, for an executor to work in.
        folder_env: The `kernel_env` of kernels working in a folder (default: `kernel_env`); it
            must name the same variables as `kernel_env`.

    Raises:
        ValueError: If an argument is out of range or of the wrong kind.
    """

    def __init__(
        self,
        size: int = 2,
        *,
        max_starting: int = 1,
        refill_delay: float = 0.5,
        sandbox: bool = False,
        sandbox_config: Path | None = None,
        working_dir: Path | str | None = None,
        kernel_env: dict[str, str] | None = None,
        memory_limit: int | str | None = None,
        max_processes: int | None = None,
        approve_shell_cmds: bool = False,
        require_shell_escape: bool = False,
        sandbox_hidden: tuple[Path, ...] = (),
        warm_imports: tuple[str, ...] | None = None,
        kernel_gateway_host: str = "localhost",
        log_level: str = "WARNING",
        registry: ServerRegistry | None = None,
        new_folder: Callable[[], Path] | None = None,
        folder_env: Callable[[Path], Mapping[str, str]] | None = None,
    ) -> None:
        self._stock = KernelStock(
            size,
            max_starting,
            refill_delay,
            start=self._start_ready,
            close=lambda kernel: self._close(kernel, shutdown=True),
            running=lambda: self._gateway is not None,
        )
        self._settings = ExecutorSettings(
            kernel_gateway_host=kernel_gateway_host,
            kernel_env=kernel_env if kernel_env is not None else {},
            sandbox=sandbox,
            sandbox_config=sandbox_config,
            log_level=log_level,
            approve_shell_cmds=approve_shell_cmds,
            require_shell_escape=require_shell_escape,
            working_dir=Path(working_dir) if working_dir is not None else None,
            memory_limit=memory_limit,
            max_processes=max_processes,
            sandbox_hidden=sandbox_hidden,
            warm_imports=warm_imports,
        )
        self._registry_dir = (registry if registry is not None else default_registry()).path.parent
        self._trail_dir = default_audit_path().parent
        self._token = secrets.token_urlsafe(32)
        self._gateway: KernelGateway | None = None
        self._http: httpx2.AsyncClient | None = None
        self._base: Path | None = None
        self._names = itertools.count()
        self._generation = 0
        self._restart_lock = asyncio.Lock()
        self._places = PoolPlaces(self._settings, new_folder, folder_env)
        # Kernels handed out with their folder by claim(), for the executor that will work there.
        self._claimed: dict[Path, asyncio.Future[PoolKernel]] = {}

    @property
    def settings(self) -> ExecutorSettings:
        """What the pool's kernels are (the executor settings that must match)."""
        return self._settings

    @property
    def size(self) -> int:
        """Kernels kept ready."""
        return self._stock.size

    @property
    def max_starting(self) -> int:
        """Kernels started at once while the pool fills up again."""
        return self._stock.max_starting

    @property
    def refill_delay(self) -> float:
        """Seconds without a hand-out before the pool starts kernels to refill itself."""
        return self._stock.refill_delay

    @property
    def ready(self) -> int:
        """Kernels ready to be handed out now."""
        return self._stock.ready

    async def filled(self, on_progress: Callable[[int], None] | None = None) -> None:
        """Wait until `size` kernels are ready, calling `on_progress` with the number ready each
        time it changes (the ``ipybox --pool`` start shows it).

        Raises:
            KernelConnectionError: If the pool could not start a kernel.
        """
        await self._stock.filled(on_progress)

    @property
    def gateway(self) -> KernelGateway:
        """The pool's kernel gateway.

        Raises:
            RuntimeError: If the pool is not started.
        """
        if self._gateway is None:
            raise RuntimeError("The kernel pool is not started; call start() or use 'async with'.")
        return self._gateway

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the gateway and begin filling the pool (this returns before the kernels are ready).

        Raises:
            RuntimeError: If the pool is already started.
            GatewayError: If the kernel gateway could not start.
            SandboxUnavailableError: If the sandbox asked for cannot run here.
        """
        if self._gateway is not None:
            raise RuntimeError("The kernel pool is already started; call stop() first.")
        settings = self._settings
        base = Path(
            tempfile.mkdtemp(prefix="ipybox-pool-", dir=_sandbox.private_base() if settings.sandbox else None)
        )
        gateway = pool_gateway(settings, self._token, base, self._registry_dir, self._trail_dir)
        try:
            await gateway.start()
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        self._gateway, self._base = gateway, base
        self._http = self._new_http()
        self._stock.refill()

    async def stop(self) -> None:
        """Stop the gateway with every kernel, ready or handed out; stopping a stopped pool does nothing."""
        gateway, base = self._gateway, self._base
        self._gateway = self._base = None
        if gateway is None:
            return
        self._stock.cancel_refill()
        try:
            await self._drop_kernels()
        finally:
            try:
                await gateway.stop(timeout=_STOP_GRACE)
                self._places.drop()
            finally:
                if self._http is not None:
                    await self._http.aclose()
                    self._http = None
                if base is not None:
                    shutil.rmtree(base, ignore_errors=True)

    def claim(self) -> Path:
        """Take the folder of a kernel started ahead in a folder of its own (`new_folder`), for an
        executor made next to work in (its kernel is kept for it); a new folder if none is ready,
        whose kernel starts now.

        Raises:
            RuntimeError: If the pool has no `new_folder`, or is not started.
        """
        if self._places.new_folder is None:
            raise RuntimeError("claim() needs a pool made with new_folder=...")
        gateway = self.gateway  # raises when the pool is not started
        future: asyncio.Future[PoolKernel]
        kernel = self._stock.pop_live()
        if kernel is not None:
            future = asyncio.get_running_loop().create_future()
            future.set_result(kernel)
            self._claimed[kernel.place.working_dir] = future
            self._stock.refill_later()
            return kernel.place.working_dir
        place = self._places.new(gateway)
        future = asyncio.ensure_future(self._start_kernel(place))
        future.add_done_callback(lambda task: task.cancelled() or task.exception())
        self._claimed[place.working_dir] = future
        self._stock.refill_later()
        return place.working_dir

    async def unclaim(self, folder: Path) -> None:
        """Shut down the kernel kept for `folder` by `claim()`, when no executor will take it (its
        start failed); nothing if there is none."""
        claimed = self._claimed.pop(Path(folder), None)
        if claimed is None:
            return
        if not claimed.done():
            claimed.cancel()
        await asyncio.wait({claimed})
        if not claimed.cancelled() and claimed.exception() is None:
            await self._close(claimed.result(), shutdown=True)

    def _check(self, settings: ExecutorSettings, registry: ServerRegistry) -> None:
        """Refuse an executor whose kernels would differ from the pool's (see `check_executor`).

        Raises:
            ValueError: Naming each setting that differs, and the pool's value.
        """
        check_executor(self._settings, self._registry_dir, settings, registry)

    def _kernels_for(
        self,
        settings: ExecutorSettings,
        address: ToolServerEnv,
        on_start: Callable[[KernelConfinement], None],
        hidden: tuple[Path, ...] = (),
    ) -> PooledKernels:
        """The kernels of one executor, taken from this pool (see `PooledKernels`).

        Raises:
            ValueError: If `hidden` names a folder the pool's kernels do not have hidden.
        """
        check_hidden(self._settings, self._trail_dir, settings, hidden)
        return PooledKernels(self, settings, address, on_start)

    async def _take(self, address: ToolServerEnv, place: Place) -> KernelChannels:
        """Hand out a ready kernel (waiting for one if none is), given the tool server `address`.

        Raises:
            KernelConnectionError: If no kernel could be started, or the kernel did not take its setup.
            RuntimeError: If the pool is not started.
        """
        gateway = self.gateway
        if not gateway.running:
            await self._restart(self._generation)
        claimed = self._claimed.pop(place.working_dir, None)
        if claimed is not None:
            kernel = await claimed
        elif place == self._places.default(gateway) and self._places.new_folder is None:
            kernel = await self._stock.take()
        else:  # a folder of its own with no kernel ready: one is started for it now
            kernel = await self._start_kernel(place)
        try:
            await hand_out(kernel, address)
        except BaseException:
            await self._close(kernel, shutdown=True)
            raise
        return kernel.channels

    async def _restart(self, generation: int) -> None:
        """Replace the gateway unless it was replaced since `generation` (once for all executors)."""
        async with self._restart_lock:
            gateway = self.gateway
            if generation != self._generation:
                return
            await self._drop_kernels()
            await gateway.stop(timeout=_STOP_GRACE)
            self._places.drop()
            await gateway.start()
            self._generation += 1
            if self._http is not None:
                await self._http.aclose()
            self._http = self._new_http()
            self._stock.restarted()

    @property
    def _generation_now(self) -> int:
        """How many times the gateway was replaced."""
        return self._generation

    def _new_http(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(
            base_url=self.gateway.url,
            headers=self._headers,
            timeout=httpx2.Timeout(30.0, connect=5.0),
        )

    @property
    def _headers(self) -> dict[str, str]:
        """The headers the gateway requires."""
        return {"Authorization": f"token {self._token}"}

    def _place_of(self, settings: ExecutorSettings) -> Place:
        """Where an executor's kernels work: its working directory, with its `kernel_env`."""
        return self._places.of(settings, self.gateway)

    def _confinement_of(self, place: Place) -> KernelConfinement:
        """What the tool server of an executor working at `place` must know of its kernels."""
        return self._places.confinement(place, self.gateway)

    async def _start_ready(self) -> PoolKernel | None:
        """A kernel to keep ready; ``None`` if the pool was stopped while it started."""
        gateway = self._gateway
        kernel = await self._start_kernel(self._places.new(self.gateway))
        if self._gateway is not gateway:  # stopped or replaced meanwhile
            await self._close(kernel, shutdown=False)
            return None
        return kernel

    async def _start_kernel(self, place: Place) -> PoolKernel:
        assert self._base is not None and self._http is not None and self._gateway is not None
        gateway, base = self._gateway, self._base
        folder = base / f"k{next(self._names)}"
        env = make_folder(folder, self._settings.sandbox)
        try:
            env.update(self._places.prepare(place, gateway, base))
            channels = await open_kernel(
                self._http, f"http://{gateway.host}:{gateway.port}", self._headers, 10, env
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        kernel = PoolKernel(channels, folder, place)
        try:
            await run_hidden(channels, WARM_UP)
        except BaseException:
            await self._close(kernel, shutdown=True)
            raise
        return kernel

    async def _drop_kernels(self) -> None:
        await self._stock.stop_starting()
        claimed, self._claimed = list(self._claimed.values()), {}
        for future in claimed:
            if not future.done():
                future.cancel()
        await asyncio.gather(*claimed, return_exceptions=True)
        kept = [f.result() for f in claimed if not f.cancelled() and f.exception() is None]
        await asyncio.gather(
            *(self._close(kernel, shutdown=False) for kernel in [*self._stock.empty(), *kept]),
            return_exceptions=True,
        )
        self._stock.notify()

    async def _close(self, kernel: PoolKernel, *, shutdown: bool) -> None:
        channels = kernel.channels
        try:
            if channels.receiver is not None:
                channels.receiver.cancel()
            with contextlib.suppress(Exception):  # broad: a broken connection closes with its own errors
                await channels.ws.close()
            if shutdown and self._http is not None:
                with contextlib.suppress(httpx2.HTTPError):
                    await self._http.delete(f"/api/kernels/{channels.id}")
        finally:
            shutil.rmtree(kernel.folder, ignore_errors=True)
