"""Runs in the application. Opening a kernel on a Kernel Gateway: the REST request that creates
it and the channels WebSocket to it, with its router of messages started."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

import httpx2
import websockets
from websockets.asyncio.client import ClientConnection

from ipybox.app.kernels._wire import MAX_MESSAGE_SIZE, WS_PROTOCOL, KernelChannels, RemoteChannels
from ipybox.errors import KernelConnectionError

__all__ = ["OPEN_TIMEOUT", "open_kernel"]

logger = logging.getLogger("ipybox.kernel_mgr.client")

# The channels handshake completes only once the new kernel answers; on a busy machine
# a kernel can take longer to boot than the WebSocket library's 10 s default.
OPEN_TIMEOUT = 60.0


async def open_kernel(
    http: httpx2.AsyncClient,
    base_url: str,
    headers: dict[str, str],
    ping_interval: float,
    env: dict[str, str] | None = None,
    *,
    kernel_name: str | None = None,
    open_timeout: float | None = OPEN_TIMEOUT,
    remote: bool = False,
    cleanups: set[asyncio.Task[None]] | None = None,
) -> KernelChannels:
    """Create a kernel on the gateway at `base_url` (with `env` for the variables the gateway lets
    a request set, from `kernel_name`'s spec) and open its channels; returns once the kernel answers.
    `remote`: the gateway is elsewhere (see `RemoteChannels`). `cleanups`: where the task goes that
    deletes the kernel of a request cancelled midway, for the caller to wait on before it closes
    `http`; without it the request is cancelled too (a caller that stops the gateway next).

    Raises:
        KernelConnectionError: If the gateway refused or did not answer.
    """
    # Sending "env" makes the gateway give the kernel only PATH plus the variables
    # the KernelGateway whitelisted, never the gateway's whole environment.
    body: dict[str, Any] = {"env": env or {}}
    if kernel_name is not None:
        body["name"] = kernel_name
    create = asyncio.ensure_future(http.post("/api/kernels", json=body))
    try:
        response = await asyncio.shield(create)
    except httpx2.HTTPError as exc:
        raise KernelConnectionError(
            f"No kernel could be created: the gateway at {base_url} did not answer ({exc!r})."
        ) from exc
    except asyncio.CancelledError:
        # Cancelled mid-request (a start timeout, a spare given up): the gateway makes the kernel
        # whether or not anyone reads its answer, so the request runs on and the kernel goes.
        if cleanups is None:
            create.cancel()
        else:
            task = asyncio.create_task(_delete_created(http, create))
            cleanups.add(task)
            task.add_done_callback(cleanups.discard)
        raise
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


async def _delete_created(http: httpx2.AsyncClient, create: asyncio.Future[httpx2.Response]) -> None:
    """Delete the kernel the request `create` makes, once the gateway answers it."""
    try:
        response = await create
    except asyncio.CancelledError:
        create.cancel()  # given up too (the gateway is stopped next, its kernels with it)
        raise
    except Exception as exc:  # broad: the request failed on its own (closed client too): no kernel made
        logger.debug("A kernel start that was given up failed on its own (%r): no kernel to delete.", exc)
        return
    if response.status_code != 201:
        return
    try:
        kernel_id = response.json()["id"]
        await http.delete(f"/api/kernels/{kernel_id}")
    except Exception as exc:  # broad: a clean-up nobody awaits; whatever failed, it is logged here
        logger.warning("A kernel whose start was given up may be left on the gateway (%r).", exc)
