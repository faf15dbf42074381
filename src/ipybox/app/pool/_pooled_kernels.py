"""`PooledKernels`: one executor's kernels taken from a `KernelPool`, and their recovery.

Runs in the application. It is to an executor on a pool what `KernelHost` is to an executor with
its own gateway: it owns the client of the executor's current kernel, takes a fresh kernel from the
pool at each start, and when the kernel dies mid-execution puts a working one back, on a new
gateway if the gateway went too (started once, by whichever executor noticed first). The tool
server is told the kernels' confinement through `on_start`, at every start. It is a `KernelSource`,
and reaches its pool only through the `KernelLender` the pool gives it (``_pool._Lending``), so
this module does not import the pool's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels import KernelClient, KernelGateway, fresh_kernel
from ipybox.app.sandbox import KernelConfinement

__all__ = ["KernelLender", "PooledKernels"]

_LOST = "all variables, imports and definitions are gone"
_STOPPED = "The kernel died while running the code, and the executor was stopped."


class KernelLender(Protocol):
    """What `PooledKernels` needs of its pool, for one executor (its tool server and working place)."""

    @property
    def started(self) -> bool:
        """Whether the pool is started."""
        ...

    @property
    def gateway(self) -> KernelGateway:
        """The pool's current gateway.

        Raises:
            RuntimeError: If the pool is not started.
        """
        ...

    @property
    def generation(self) -> int:
        """How many times the pool's gateway was replaced."""
        ...

    def new_client(self) -> KernelClient:
        """A (not yet connected) client whose kernels, at its connect and at each reset, come from the pool."""
        ...

    async def restart(self, generation: int) -> None:
        """Replace the gateway unless it was replaced since `generation` (once for all executors)."""
        ...

    def confinement(self) -> KernelConfinement:
        """What the executor's tool server must know of the kernels it is lent."""
        ...


class PooledKernels:
    """One executor's kernels from a `KernelPool`: what `KernelHost` is for an executor with its own gateway.

    Args:
        lender: The pool, as seen by this executor.
        settings: The executor's settings (its memory limit, for the message of a kernel killed over it).
        on_start: Called with the kernels' confinement now and after the gateway is replaced.
    """

    def __init__(
        self,
        lender: KernelLender,
        settings: ExecutorSettings,
        on_start: Callable[[KernelConfinement], None],
    ) -> None:
        self._lender = lender
        self._settings = settings
        self._on_start = on_start
        self._client: KernelClient | None = None
        self._generation = -1

    @property
    def gateway(self) -> KernelGateway:
        """The pool's gateway (shared with the pool's other executors)."""
        return self._lender.gateway

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
        self._on_start(self._lender.confinement())

    async def stop(self) -> None:
        """Shut this executor's kernel down (the pool's gateway keeps running)."""
        client, self._client = self._client, None
        if client is not None:
            await client.disconnect(shutdown_kernels=self._lender.started)

    async def recover(self) -> str:
        """After the kernel died mid-execution: a fresh kernel from the pool, on a new gateway if the
        gateway went too (started by whichever executor noticed first).

        Returns:
            The message for the execution that was hit.
        """
        client = self._client
        if client is None:
            return _STOPPED
        lender = self._lender
        if not lender.started:
            return "The kernel died while running the code, and the kernel pool was stopped."
        gateway = lender.gateway
        if self._generation == lender.generation and gateway.running:
            message = await fresh_kernel(client, gateway, self._settings)
            if message is not None:
                return message
        try:
            await client.disconnect(shutdown_kernels=False)
            await lender.restart(self._generation)
            fresh = await self._new_client()
            self._on_start(lender.confinement())
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
        self._generation = self._lender.generation
        client = self._lender.new_client()
        await client.connect(retries=1)
        return client
