"""`KernelHost`: an executor's kernel gateway and the client of its kernel, and their recovery.

The host owns both for their whole life: it starts the gateway, connects a client to it, and
when a kernel dies mid-execution it puts a working kernel back, on a new gateway (and a new
client for it) if the gateway went too. Whoever needs to know what the kernel's sandbox lets it
write (the tool server) is told through `on_start`, at every start of a gateway.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import httpx2

from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels._client import KernelClient
from ipybox.app.kernels._gateway import KernelGateway
from ipybox.app.kernels._stdin import StdinHandler
from ipybox.app.sandbox import KernelConfinement
from ipybox.errors import ExecutionError, KernelConnectionError

__all__ = ["KernelHost", "fresh_kernel"]

# Seconds the gateway and kernels get to exit after SIGTERM when the host stops; they hold no
# state worth a longer wait, and then they are killed.
_STOP_GRACE = 0.05
_LOST = "all variables, imports and definitions are gone"
# What an execution hit by a dead kernel is told when the executor was stopped meanwhile.
_STOPPED = "The kernel died while running the code, and the executor was stopped."


class KernelHost:
    """A kernel gateway and a client connected to one of its kernels, started and stopped together.

    Args:
        settings: The executor's settings (gateway host and port, sandbox, limits, images folder,
            spare kernel, log level).
        env: The kernels' environment.
        on_start: Called with the kernels' confinement each time a gateway has started.
        stdin_handler: Answers the tool calls kernels send over their stdin channel (every client's).
    """

    def __init__(
        self,
        settings: ExecutorSettings,
        env: dict[str, str],
        on_start: Callable[[KernelConfinement], None],
        *,
        hidden: tuple[Path, ...] = (),
        registry_dir: Path | None = None,
        stdin_handler: StdinHandler | None = None,
    ) -> None:
        self._settings = settings
        self._stdin_handler = stdin_handler
        self._on_start = on_start
        self._token = secrets.token_urlsafe(32)
        self._gateway = KernelGateway(
            host=settings.kernel_gateway_host,
            port=settings.kernel_gateway_port,
            sandbox=settings.sandbox,
            sandbox_config=settings.sandbox_config,
            log_level=settings.log_level,
            env=env,
            auth_token=self._token,
            working_dir=settings.working_dir,
            memory_limit=settings.memory_limit,
            max_processes=settings.max_processes,
            sandbox_hidden=(*settings.sandbox_hidden, *hidden),
            registry_dir=registry_dir,
        )
        self._client: KernelClient | None = None

    @property
    def gateway(self) -> KernelGateway:
        """The kernel gateway."""
        return self._gateway

    @property
    def client(self) -> KernelClient:
        """The client of the current kernel (a new one after the gateway was replaced).

        Raises:
            RuntimeError: If the host is not started.
        """
        if self._client is None:
            raise RuntimeError("The kernels are not started; call start() first.")
        return self._client

    async def start(self) -> None:
        """Start the gateway and connect a client to a new kernel; a failed start leaves nothing running.

        Raises:
            GatewayError: If the kernel gateway could not start.
            SandboxUnavailableError: If the sandbox asked for cannot run here.
            ValueError: If the working directory is not an existing folder.
            KernelConnectionError: If no kernel could be created.
        """
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self._gateway)
            self._on_start(self._gateway.confinement)
            self._client = await stack.enter_async_context(self._new_client())
            stack.pop_all()

    async def stop(self) -> None:
        """Close the client and stop the gateway with its kernels; stopping a stopped host does nothing."""
        client, self._client = self._client, None
        try:
            if client is not None:
                # The gateway takes its kernels down with it: no shutdown request per kernel.
                await client.disconnect(shutdown_kernels=False)
        finally:
            await self._gateway.stop(timeout=_STOP_GRACE)

    async def recover(self) -> str:
        """After the kernel died mid-execution: put a fresh kernel in its place, on a fresh gateway
        if the gateway went too.

        Returns:
            The message for the execution that was hit: what happened and what was done.
        """
        client = self._client
        if client is None:
            return _STOPPED
        # A dead gateway is checked first: its spare kernel's connection may not have noticed yet,
        # so a reset onto the spare would "succeed" and leave the next execution to fail.
        if (
            self._gateway.running
            and (message := await fresh_kernel(client, self._gateway, self._settings)) is not None
        ):
            return message
        if self._client is not client:
            return _STOPPED
        return await self._fresh_gateway(client)

    async def _fresh_gateway(self, client: KernelClient) -> str:
        """A new gateway, and a new client connected to a kernel on it."""
        try:
            await client.disconnect()
            await self._gateway.stop()
            await self._gateway.start()
            self._on_start(self._gateway.confinement)
            fresh = self._new_client()
            await fresh.connect()
        # Broad on purpose: whatever failed, the execution that was hit gets a message that
        # says so and what to do, rather than an error from the middle of the recovery.
        except Exception as error:
            return (
                "The kernel gateway died while running the code, and starting a new one failed "
                f"({error}); stop() and start() the executor to try again."
            )
        if self._client is not client:  # stopped meanwhile: the fresh kernel has no one to serve
            await fresh.disconnect(shutdown_kernels=False)
            await self._gateway.stop(timeout=_STOP_GRACE)
            return _STOPPED
        self._client = fresh
        return (
            "The kernel gateway died while running the code; ipybox started a new gateway and "
            f"kernel, and {_LOST}."
        )

    def _new_client(self) -> KernelClient:
        return KernelClient(
            host=self._settings.kernel_gateway_host,
            port=self._gateway.port,
            images_dir=self._settings.images_dir,
            auth_token=self._token,
            spare_kernel=self._settings.spare_kernel,
            stdin_handler=self._stdin_handler,
        )


async def fresh_kernel(
    client: KernelClient, gateway: KernelGateway, settings: ExecutorSettings
) -> str | None:
    """After `client`'s kernel died: a fresh kernel on the running `gateway`, and the message for
    the execution that was hit; ``None`` if the gateway gives no working kernel (it is gone or
    broken, and must be replaced)."""
    died = "The kernel died while running the code"
    if gateway.memory_exceeded():
        died = (
            "The kernel was killed because it used more than its memory limit "
            f"({settings.memory_limit}) while running the code"
        )
    try:
        await client.reset()
        # A gateway killed just after its kernel may still look alive, and the spare's
        # connection may not have noticed yet: one round trip proves the fresh kernel works.
        await client.execute("", timeout=10)
    except (KernelConnectionError, ExecutionError, TimeoutError, httpx2.HTTPError, OSError):
        return None
    return f"{died}; a fresh kernel has replaced it and {_LOST}."
