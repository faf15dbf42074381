"""One kernel of a `KernelPool`: its private folder, its silent setup cells, and its hand-out.

Runs in the application. A pooled kernel is started with a private folder of its own (sandboxed:
where the pool later links its executor's tool server socket; not sandboxed: its temporary and
IPython folders), warmed with a hidden first cell, and learns whose it is only when it is handed
out: a hidden cell gives it its executor's tool server address and token. The folder is removed
when the kernel ends.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import websockets

from ipybox._wire import ToolServerEnv
from ipybox.app.kernels import KernelChannels, execute_request
from ipybox.app.pool._places import Place
from ipybox.errors import KernelConnectionError

__all__ = ["WARM_UP", "PoolKernel", "hand_out", "make_folder", "run_hidden"]

_SETUP_TIMEOUT = 30.0
_SOCKET_NAME = "tools.sock"
WARM_UP = "__import__('ipybox.kernel._warm', fromlist=['wait']).wait()"
"""Warms a fresh kernel's first execution (imports the execution path pulls in lazily) and makes
its warm imports (`ipybox.kernel._warm`) now: a pool's kernel is ready once they are done."""


@dataclass
class PoolKernel:
    """A started kernel, its private folder (removed when the kernel ends) and its place."""

    channels: KernelChannels
    folder: Path
    place: Place


def make_folder(folder: Path, sandbox: bool) -> dict[str, str]:
    """Make a kernel's private `folder`.

    Returns:
        The environment that points the kernel at it (sandboxed: where its tool server socket
        will be; not sandboxed: its temporary and IPython folders inside it).
    """
    folder.mkdir(mode=0o700)
    if sandbox:
        return {ToolServerEnv.SOCKET: str(folder / _SOCKET_NAME)}
    for name in ("tmp", "ipython"):
        (folder / name).mkdir(mode=0o700)
    return {"TMPDIR": str(folder / "tmp"), "IPYTHONDIR": str(folder / "ipython")}


async def hand_out(kernel: PoolKernel, address: ToolServerEnv) -> None:
    """Give `kernel` its executor's tool server `address`, and remove its folder when it ends.

    Raises:
        OSError: If the socket could not be linked into the kernel's folder.
        KernelConnectionError: If the kernel did not take its setup.
    """
    setup = {key: value for key, value in address.to_env().items() if key != ToolServerEnv.SOCKET}
    if address.socket is not None:
        # A hard link: the kernel reaches this socket and nothing else, whatever its path.
        os.link(address.socket, kernel.folder / _SOCKET_NAME, follow_symlinks=False)
        setup[ToolServerEnv.SOCKET] = str(kernel.folder / _SOCKET_NAME)
    await run_hidden(kernel.channels, f"import os as _o; _o.environ.update({setup!r}); del _o")
    kernel.channels.on_close = lambda: shutil.rmtree(kernel.folder, ignore_errors=True)


async def run_hidden(channels: KernelChannels, code: str) -> None:
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
