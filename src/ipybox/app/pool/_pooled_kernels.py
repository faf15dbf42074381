"""`PooledKernels`: one executor's kernels taken from a `KernelPool`, and their recovery.

Runs in the application. It is to an executor on a pool what `KernelHost` is to an executor with
its own gateway: it owns the client of the executor's current kernel, takes a fresh kernel from the
pool at each start, and when the kernel dies mid-execution puts a working one back, on a new
gateway if the gateway went too (started once, by whichever executor noticed first). The tool
server is told the kernels' confinement through `on_start`, at every start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ipybox._wire import ToolServerEnv
from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels import KernelClient, KernelGateway, fresh_kernel
from ipybox.app.sandbox import KernelConfinement

if TYPE_CHECKING:
    from ipybox.app.pool._pool import KernelPool

__all__ = ["PooledKernels"]

_LOST = "all variables, imports and definitions are gone"
_STOPPED = "The kernel died while running the code, and the executor was stopped."


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
            message = await fresh_kernel(client, gateway, self._settings)
            if message is not None:
                return message
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
