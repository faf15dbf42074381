"""`KernelPool`: one kernel gateway for many executors, and kernels started before they are needed.

The pool owns one `KernelGateway` and keeps `size` kernels on it ready (started, connected and warm).
An executor made with ``pool=`` takes one when it starts (and another at each `reset()`), instead of
starting a gateway and waiting for a kernel. A kernel is handed out once, and only then learns whose
it is: a hidden first cell gives it its executor's tool server address and token, and (sandboxed)
the pool links that executor's tool server socket into a folder made for this kernel alone before it
started, which no other kernel can see. Until then a ready kernel has no way to any tool server.
Each kernel has private temporary and IPython folders (sandboxed: made by the kernel's launcher; not
sandboxed: given by the pool), removed when it ends.

When the gateway dies, the first executor to notice starts a new one; the others find it started.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx2
import websockets

from ipybox._wire import KernelEnv, PoolEnv, ToolServerEnv
from ipybox.app import _capacity, _sandbox
from ipybox.app._audit import default_audit_path
from ipybox.app._capacity import MIB, POOLED_KERNEL_BYTES
from ipybox.app._gateway import KernelGateway
from ipybox.app._kernel_client import KernelClient, open_kernel
from ipybox.app._kernel_wire import KernelChannels, execute_request
from ipybox.app._registry import ServerRegistry, default_registry
from ipybox.app._settings import ExecutorSettings
from ipybox.app._shell import KernelConfinement
from ipybox.errors import ExecutionError, KernelConnectionError

__all__ = ["KernelPool"]

logger = logging.getLogger(__name__)

# Settings that make a kernel what it is: an executor on a pool must have the pool's.
_KERNEL_FIELDS = (
    "kernel_gateway_host",
    "sandbox",
    "sandbox_config",
    "memory_limit",
    "max_processes",
    "approve_shell_cmds",
    "require_shell_escape",
    "sandbox_hidden",
)
_STOP_GRACE = 0.05
_SETUP_TIMEOUT = 30.0
_SOCKET_NAME = "tools.sock"
_LOST = "all variables, imports and definitions are gone"
_STOPPED = "The kernel died while running the code, and the executor was stopped."
# Warms a fresh kernel's first execution (imports the execution path pulls in lazily).
_WARM_UP = "pass"


@dataclass(frozen=True)
class _Place:
    """Where a kernel works and with what environment (`kernel_env`)."""

    working_dir: Path
    env: tuple[tuple[str, str], ...]


@dataclass
class _Kernel:
    """A started kernel, its private folder (removed when the kernel ends) and its place."""

    channels: KernelChannels
    folder: Path
    place: _Place


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
        kernel_gateway_host: str = "localhost",
        log_level: str = "WARNING",
        registry: ServerRegistry | None = None,
        new_folder: Callable[[], Path] | None = None,
        folder_env: Callable[[Path], Mapping[str, str]] | None = None,
    ) -> None:
        for name, value, least in (("size", size, 0), ("max_starting", max_starting, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"{name} must be a whole number of kernels, at least {least}, not {value!r}."
                )
        self.size = size
        self.max_starting = max_starting
        # Whether the last refill stopped short for want of memory (said once, until it recovers).
        self._memory_short = False
        if isinstance(refill_delay, bool) or not isinstance(refill_delay, int | float) or refill_delay < 0:
            raise ValueError(f"refill_delay must be a number of seconds, at least 0, not {refill_delay!r}.")
        self.refill_delay = refill_delay
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
        )
        self._registry_dir = (registry if registry is not None else default_registry()).path.parent
        self._trail_dir = default_audit_path().parent
        self._token = secrets.token_urlsafe(32)
        self._gateway: KernelGateway | None = None
        self._http: httpx2.AsyncClient | None = None
        self._base: Path | None = None
        self._ready: collections.deque[_Kernel] = collections.deque()
        self._starting: set[asyncio.Task[None]] = set()
        self._waiting = 0
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()
        self._names = itertools.count()
        self._generation = 0
        self._restart_lock = asyncio.Lock()
        self._refill_timer: asyncio.TimerHandle | None = None
        self._new_folder = new_folder
        self._folder_env = folder_env
        # Kernels handed out with their folder by claim(), for the executor that will work there.
        self._claimed: dict[Path, asyncio.Future[_Kernel]] = {}
        # Sandboxed kernels working elsewhere than the gateway: their settings file, confinement
        # and placeholder journal folder, per place (until the gateway is replaced).
        self._places: dict[_Place, tuple[Path, KernelConfinement, Path]] = {}

    @property
    def settings(self) -> ExecutorSettings:
        """What the pool's kernels are (the executor settings that must match)."""
        return self._settings

    @property
    def ready(self) -> int:
        """Kernels ready to be handed out now."""
        return len(self._ready)

    async def filled(self, on_progress: Callable[[int], None] | None = None) -> None:
        """Wait until `size` kernels are ready, calling `on_progress` with the number ready each
        time it changes (the ``ipybox --pool`` start shows it).

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
        gateway = KernelGateway(
            host=settings.kernel_gateway_host,
            port=0,
            sandbox=settings.sandbox,
            sandbox_config=settings.sandbox_config,
            log_level=settings.log_level,
            env=settings.kernel_settings(),
            auth_token=self._token,
            working_dir=settings.working_dir,
            memory_limit=settings.memory_limit,
            max_processes=settings.max_processes,
            sandbox_hidden=(*settings.sandbox_hidden, self._trail_dir),
            registry_dir=self._registry_dir,
            per_kernel_env=(
                *((ToolServerEnv.SOCKET, PoolEnv.SETTINGS) if settings.sandbox else ("TMPDIR", "IPYTHONDIR")),
                KernelEnv.START_DIR,
                KernelEnv.WORKING_DIR,
                *settings.kernel_env,
            ),
            tools_base=base if settings.sandbox else None,
        )
        try:
            await gateway.start()
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        self._gateway, self._base = gateway, base
        self._http = self._new_http()
        self._refill()

    async def stop(self) -> None:
        """Stop the gateway with every kernel, ready or handed out; stopping a stopped pool does nothing."""
        gateway, base = self._gateway, self._base
        self._gateway = self._base = None
        if gateway is None:
            return
        if self._refill_timer is not None:
            self._refill_timer.cancel()
        try:
            await self._drop_kernels()
        finally:
            try:
                await gateway.stop(timeout=_STOP_GRACE)
                self._drop_places()
            finally:
                if self._http is not None:
                    await self._http.aclose()
                    self._http = None
                if base is not None:
                    shutil.rmtree(base, ignore_errors=True)

    def _check(self, settings: ExecutorSettings, registry: ServerRegistry) -> None:
        """Refuse an executor whose kernels would differ from the pool's.

        Raises:
            ValueError: Naming each setting that differs, and the pool's value.
        """
        known = {field.name for field in fields(ExecutorSettings)}
        assert set(_KERNEL_FIELDS) <= known
        differ = [
            f"{name}={getattr(settings, name)!r} (the pool's: {getattr(self._settings, name)!r})"
            for name in _KERNEL_FIELDS
            if getattr(settings, name) != getattr(self._settings, name)
        ]
        if set(settings.kernel_env) != set(self._settings.kernel_env):
            differ.append(
                f"kernel_env names {sorted(settings.kernel_env)} (the pool's: {sorted(self._settings.kernel_env)})"
            )
        working_dir = settings.working_dir or Path.cwd().resolve()
        if not working_dir.is_relative_to(self._settings.working_dir or Path.cwd().resolve()):
            differ.append(
                f"working_dir={str(working_dir)!r} (not in the pool's: {str(self._settings.working_dir)!r})"
            )
        if settings.kernel_gateway_port is not None:
            differ.append(
                f"kernel_gateway_port={settings.kernel_gateway_port!r} (the pool's gateway picks its own)"
            )
        if settings.sandbox and registry.path.parent != self._registry_dir:
            differ.append(f"registry in {registry.path.parent} (the pool's: {self._registry_dir})")
        if differ:
            raise ValueError(
                "This executor's kernels would differ from the pool's: "
                + "; ".join(differ)
                + ". Give the executor the pool's settings, or make a pool with these."
            )

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
        if settings.sandbox:
            pool_hidden = (*self._settings.sandbox_hidden, self._trail_dir)
            for folder in hidden:
                if not any(folder.resolve().is_relative_to(Path(h).resolve()) for h in pool_hidden):
                    raise ValueError(
                        f"The audit trail in {folder} is not hidden from the pool's kernels; pass "
                        f"sandbox_hidden=({str(folder)!r},) to the pool as well, or audit=False."
                    )
        return PooledKernels(self, settings, address, on_start)

    async def _take(self, address: ToolServerEnv, place: _Place) -> KernelChannels:
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
        elif place == self._default_place() and self._new_folder is None:
            kernel = await self._take_ready()
        else:  # a folder of its own with no kernel ready: one is started for it now
            kernel = await self._start_kernel(place)
        try:
            setup = {key: value for key, value in address.to_env().items() if key != ToolServerEnv.SOCKET}
            if address.socket is not None:
                # A hard link: the kernel reaches this socket and nothing else, whatever its path.
                os.link(address.socket, kernel.folder / _SOCKET_NAME, follow_symlinks=False)
                setup[ToolServerEnv.SOCKET] = str(kernel.folder / _SOCKET_NAME)
            await _run_hidden(kernel.channels, f"import os as _o; _o.environ.update({setup!r}); del _o")
        except BaseException:
            await self._close(kernel, shutdown=True)
            raise
        kernel.channels.on_close = lambda: shutil.rmtree(kernel.folder, ignore_errors=True)
        return kernel.channels

    async def _restart(self, generation: int) -> None:
        """Replace the gateway unless it was replaced since `generation` (once for all executors)."""
        async with self._restart_lock:
            gateway = self.gateway
            if generation != self._generation:
                return
            await self._drop_kernels()
            await gateway.stop(timeout=_STOP_GRACE)
            self._drop_places()
            await gateway.start()
            self._generation += 1
            if self._http is not None:
                await self._http.aclose()
            self._http = self._new_http()
            self._failure = None
            self._refill()

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

    def _refill(self) -> None:
        """Start kernels until the ready ones and those starting cover the pool and its waiters."""
        if self._gateway is None:
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
            task = asyncio.create_task(self._start_ready())
            self._starting.add(task)
            task.add_done_callback(self._started)

    def _refill_later(self) -> None:
        """Refill once hand-outs have paused for `refill_delay`: a kernel starting takes a core and
        the gateway's attention, which the executor just handed a kernel needs for its first cells."""
        if self._refill_timer is not None:
            self._refill_timer.cancel()
        self._refill_timer = asyncio.get_running_loop().call_later(self.refill_delay, self._refill)

    def _started(self, task: asyncio.Task[None]) -> None:
        self._starting.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._failure = error
        self._notify()
        self._refill()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _default_place(self) -> _Place:
        return _Place(self.gateway.working_dir, tuple(sorted(self._settings.kernel_env.items())))

    def _place_of(self, settings: ExecutorSettings) -> _Place:
        """Where an executor's kernels work: its working directory, with its `kernel_env`."""
        working_dir = settings.working_dir or self.gateway.working_dir
        return _Place(working_dir, tuple(sorted(settings.kernel_env.items())))

    def _new_place(self) -> _Place:
        """The place of the next kernel started ahead: a new folder, or the pool's working directory."""
        if self._new_folder is None:
            return self._default_place()
        folder = Path(self._new_folder()).resolve()
        env = (
            dict(self._folder_env(folder))
            if self._folder_env is not None
            else dict(self._settings.kernel_env)
        )
        return _Place(folder, tuple(sorted(env.items())))

    def _confinement_of(self, place: _Place) -> KernelConfinement:
        """What the tool server of an executor working at `place` must know of its kernels."""
        prepared = self._places.get(place)
        return prepared[1] if prepared is not None else self.gateway.confinement

    def _prepare(self, place: _Place) -> dict[str, str]:
        """The environment that makes a kernel work at `place` (sandboxed elsewhere than the
        gateway: settings of its own, written once per place)."""
        if place == self._default_place():
            return {}
        env = {**dict(place.env), KernelEnv.START_DIR: str(place.working_dir)}
        if self._settings.working_dir is not None:
            env[KernelEnv.WORKING_DIR] = str(place.working_dir)
        if self._settings.sandbox:
            prepared = self._places.get(place)
            if prepared is None:
                assert self._base is not None
                private = Path(tempfile.mkdtemp(prefix="ipybox-jupyter-pool-", dir=_sandbox.private_base()))
                settings_file = self._base / f"p{next(self._names)}.json"
                kernel_env = {**self._settings.kernel_settings(), **dict(place.env)}
                confinement = self.gateway.folder_confinement(
                    place.working_dir, kernel_env, settings_file, private
                )
                prepared = self._places[place] = (settings_file, confinement, private)
            env[PoolEnv.SETTINGS] = str(prepared[0])
        return env

    def _drop_places(self) -> None:
        places, self._places = self._places, {}
        for _, _, private in places.values():
            _sandbox.remove_placeholders(private)
            shutil.rmtree(private, ignore_errors=True)

    def claim(self) -> Path:
        """Take the folder of a kernel started ahead in a folder of its own (`new_folder`), for an
        executor made next to work in (its kernel is kept for it); a new folder if none is ready,
        whose kernel starts now.

        Raises:
            RuntimeError: If the pool has no `new_folder`, or is not started.
        """
        if self._new_folder is None:
            raise RuntimeError("claim() needs a pool made with new_folder=...")
        self.gateway  # noqa: B018  # raises when the pool is not started
        future: asyncio.Future[_Kernel]
        while self._ready:
            kernel = self._ready.popleft()
            if not kernel.channels.dead:
                future = asyncio.get_running_loop().create_future()
                future.set_result(kernel)
                self._claimed[kernel.place.working_dir] = future
                self._refill_later()
                return kernel.place.working_dir
        place = self._new_place()
        future = asyncio.ensure_future(self._start_kernel(place))
        future.add_done_callback(lambda task: task.cancelled() or task.exception())
        self._claimed[place.working_dir] = future
        self._refill_later()
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

    async def _start_ready(self) -> None:
        gateway = self._gateway
        kernel = await self._start_kernel(self._new_place())
        if self._gateway is not gateway:  # stopped or replaced meanwhile
            await self._close(kernel, shutdown=False)
            return
        self._failure = None
        self._ready.append(kernel)

    async def _start_kernel(self, place: _Place) -> _Kernel:
        assert self._base is not None and self._http is not None and self._gateway is not None
        gateway, base = self._gateway, self._base
        folder = base / f"k{next(self._names)}"
        folder.mkdir(mode=0o700)
        if self._settings.sandbox:
            env = {ToolServerEnv.SOCKET: str(folder / _SOCKET_NAME)}
        else:
            for name in ("tmp", "ipython"):
                (folder / name).mkdir(mode=0o700)
            env = {"TMPDIR": str(folder / "tmp"), "IPYTHONDIR": str(folder / "ipython")}
        try:
            env.update(self._prepare(place))
            channels = await open_kernel(
                self._http, f"http://{gateway.host}:{gateway.port}", self._headers, 10, env
            )
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        kernel = _Kernel(channels, folder, place)
        try:
            await _run_hidden(channels, _WARM_UP)
        except BaseException:
            await self._close(kernel, shutdown=True)
            raise
        return kernel

    async def _take_ready(self) -> _Kernel:
        self._waiting += 1
        try:
            self._failure = None
            while True:
                changed = self._changed
                while self._ready:
                    kernel = self._ready.popleft()
                    if not kernel.channels.dead:
                        return kernel
                    await self._close(kernel, shutdown=True)
                if self._failure is not None and not self._starting:
                    raise KernelConnectionError(
                        f"The kernel pool could not start a kernel ({self._failure}); check the gateway's "
                        "log lines above, or stop() and start() the pool."
                    ) from self._failure
                self._refill()
                await changed.wait()
                if self._gateway is None:
                    raise RuntimeError("The kernel pool was stopped.")
        finally:
            self._waiting -= 1
            self._refill_later()

    async def _drop_kernels(self) -> None:
        starting = list(self._starting)
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        claimed, self._claimed = list(self._claimed.values()), {}
        for future in claimed:
            if not future.done():
                future.cancel()
        await asyncio.gather(*claimed, return_exceptions=True)
        ready = [*self._ready, *(f.result() for f in claimed if not f.cancelled() and f.exception() is None)]
        self._ready = collections.deque()
        await asyncio.gather(
            *(self._close(kernel, shutdown=False) for kernel in ready), return_exceptions=True
        )
        self._notify()

    async def _close(self, kernel: _Kernel, *, shutdown: bool) -> None:
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


class PooledKernels:
    """One executor's kernels from a `KernelPool`: what `KernelHost` is for an executor with its own gateway.

    Args:
        pool: The pool.
        settings: The executor's settings (its images folder).
        address: The executor's tool server, given to each kernel it takes.
        on_start: Called with the kernels' confinement now and after the gateway is replaced.
    """

    def __init__(
        self,
        pool: KernelPool,
        settings: ExecutorSettings,
        address: ToolServerEnv,
        on_start: Callable[[KernelConfinement], None],
    ) -> None:
        self._pool = pool
        self._settings = settings
        self._address = address
        self._on_start = on_start
        self._client: KernelClient | None = None
        self._generation = -1

    @property
    def gateway(self) -> KernelGateway:
        """The pool's gateway (shared with the pool's other executors)."""
        return self._pool.gateway

    @property
    def client(self) -> KernelClient:
        """The client of the current kernel.

        Raises:
            RuntimeError: If not started.
        """
        if self._client is None:
            raise RuntimeError("The kernels are not started; call start() first.")
        return self._client

    async def start(self) -> None:
        """Take a kernel from the pool.

        Raises:
            KernelConnectionError: If no kernel could be had.
        """
        self._client = await self._new_client()
        self._on_start(self._pool._confinement_of(self._pool._place_of(self._settings)))

    async def stop(self) -> None:
        """Shut this executor's kernel down (the pool's gateway keeps running)."""
        client, self._client = self._client, None
        if client is not None:
            await client.disconnect(shutdown_kernels=self._pool._gateway is not None)

    async def recover(self) -> str:
        """After the kernel died mid-execution: a fresh kernel from the pool, on a new gateway if the
        gateway went too (started by whichever executor noticed first).

        Returns:
            The message for the execution that was hit.
        """
        client = self._client
        if client is None:
            return _STOPPED
        pool = self._pool
        if pool._gateway is None:
            return "The kernel died while running the code, and the kernel pool was stopped."
        gateway = pool.gateway
        if self._generation == pool._generation_now and gateway.running:
            died = "The kernel died while running the code"
            if gateway.memory_exceeded():
                died = (
                    "The kernel was killed because it used more than its memory limit "
                    f"({self._settings.memory_limit}) while running the code"
                )
            try:
                await client.reset()
                await client.execute("", timeout=10)
                return f"{died}; a fresh kernel has replaced it and {_LOST}."
            except (KernelConnectionError, ExecutionError, TimeoutError, httpx2.HTTPError, OSError):
                pass  # no working kernel: the gateway itself is gone or broken
        try:
            await client.disconnect(shutdown_kernels=False)
            await pool._restart(self._generation)
            fresh = await self._new_client()
            self._on_start(pool._confinement_of(pool._place_of(self._settings)))
        # Broad on purpose: the execution that was hit gets a message saying what to do.
        except Exception as error:
            return (
                "The kernel gateway died while running the code, and starting a new one failed "
                f"({error}); stop() and start() the executor to try again."
            )
        if self._client is not client:
            await fresh.disconnect()
            return _STOPPED
        self._client = fresh
        return (
            "The kernel gateway died while running the code; ipybox started a new gateway and "
            f"kernel, and {_LOST}."
        )

    async def _new_client(self) -> KernelClient:
        pool = self._pool
        self._generation = pool._generation_now
        gateway = pool.gateway
        client = KernelClient(
            host=gateway.host,
            port=gateway.port,
            images_dir=self._settings.images_dir,
            auth_token=pool._token,
            spare_kernel=False,
            kernel_source=lambda: pool._take(self._address, pool._place_of(self._settings)),
            http=pool._http,
        )
        await client.connect(retries=1)
        return client


async def _run_hidden(channels: KernelChannels, code: str) -> None:
    """Run `code` silently (no count, no history, no output) and wait until the kernel is idle again.

    Raises:
        KernelConnectionError: If the kernel failed it or did not answer in time.
    """
    msg_id = uuid.uuid4().hex
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    channels.queues[msg_id] = queue
    replied = idle = False
    status = "ok"
    try:
        await channels.ws.send(execute_request(channels.session, msg_id, code, silent=True))
        async with asyncio.timeout(_SETUP_TIMEOUT):
            while not (replied and idle):
                msg = await queue.get()
                if msg is None:
                    raise KernelConnectionError("The kernel died while it was being set up.")
                if msg["msg_type"] == "execute_reply":
                    replied, status = True, msg["content"].get("status", "error")
                elif msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                    idle = True
    except (TimeoutError, websockets.ConnectionClosed) as exc:
        raise KernelConnectionError(f"The kernel did not take its setup ({exc!r}).") from exc
    finally:
        channels.queues.pop(msg_id, None)
    if status != "ok":
        raise KernelConnectionError(f"The kernel failed its setup (status {status!r}).")
