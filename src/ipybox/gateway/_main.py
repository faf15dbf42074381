"""Entry point of the gateway child process: ``python -m ipybox.gateway._main``.

It runs the stock Jupyter Kernel Gateway application with three changes, all for speed:

- ``jsonschema`` imports ``rfc3987_syntax`` (via nbformat) when it is installed, which
  builds a parser at import time and costs over a second; the gateway never validates
  IRI formats, so the import is blocked and jsonschema skips that format.
- Tornado leaves Nagle's algorithm on for WebSockets. A kernel sends several small
  messages per execution, and with delayed ACKs on the client each one after the first
  waits ~40 ms. The kernel channels socket is switched to TCP_NODELAY.
- jupyter_server subscribes to every kernel's output a second time only to record
  activity (for idle culling, which ipybox does not use), decoding each message again;
  that costs about a third of the gateway's time per execution. The kernel is marked
  idle once and not watched. Death and restarts still reach clients through the
  channels connection.

The application keeps this process's stdin open and never writes to it
(``IPYBOX_EXIT_WITH_PARENT``): end of file means the application is gone, even killed with
SIGKILL, and the gateway then stops as it does on SIGTERM, its kernels with it. A
parent-death signal cannot do this, because Linux sends it when the thread that started the
process ends, and applications start executors from worker threads.

With ``IPYBOX_GATEWAY_LOCK`` (sandboxed kernels), each kernel's connection file and ZMQ sockets
go in a folder of that kernel's own, removed when the kernel ends, and this process holds a lock
on that file for its whole life: the watcher each sandboxed kernel's launcher leaves outside the
sandbox ends the kernel once the lock is released (see ``ipybox.gateway._kernel_launch``).
With resource limits in control groups (``IPYBOX_KERNEL_GROUPS``), a kernel's groups are also
cleared as soon as its process has ended.
"""

import contextlib
import json
import os
import sys
from datetime import UTC, datetime
from typing import Any

sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]  # None blocks the import

from jupyter_client.provisioning.local_provisioner import LocalProvisioner  # noqa: E402
from jupyter_server.services.kernels.kernelmanager import MappingKernelManager  # noqa: E402
from jupyter_server.services.kernels.websocket import KernelWebsocketHandler  # noqa: E402
from kernel_gateway.gatewayapp import launch_instance  # noqa: E402

from ipybox._wire import GatewayEnv  # noqa: E402
from ipybox.gateway import _kernel_launch, _limits  # noqa: E402

_open = KernelWebsocketHandler.open


async def _open_nodelay(self: KernelWebsocketHandler, *args: Any, **kwargs: Any) -> None:
    self.set_nodelay(True)
    await _open(self, *args, **kwargs)  # type: ignore[no-untyped-call]  # jupyter_server is untyped here


KernelWebsocketHandler.open = _open_nodelay  # type: ignore[method-assign]


def _watch_activity_lightly(self: MappingKernelManager, kernel_id: str) -> None:
    """Set what the kernels listing reports, without subscribing to the kernel's output."""
    kernel = self._kernels[kernel_id]
    kernel.reason = ""
    kernel.last_activity = datetime.now(UTC)
    kernel.execution_state = "idle"


MappingKernelManager.start_watching_activity = _watch_activity_lightly  # type: ignore[method-assign]

# Held until this process ends, however it ends: sandboxed kernels end when it is released
# (see ipybox.gateway._kernel_launch).
_GATEWAY_LOCK = os.environ.get(GatewayEnv.GATEWAY_LOCK)
if _GATEWAY_LOCK:
    import asyncio
    import fcntl
    import shutil
    import stat
    import tempfile
    import time

    from jupyter_client.manager import KernelManager
    from jupyter_client.multikernelmanager import MultiKernelManager

    _RUNTIME = os.path.dirname(_GATEWAY_LOCK)
    _lock_fd = os.open(_GATEWAY_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(_lock_fd, fcntl.LOCK_EX)

    _pre_start = MultiKernelManager.pre_start_kernel

    def _pre_start_in_own_folder(
        self: MultiKernelManager, kernel_name: str | None, kwargs: Any
    ) -> tuple[Any, str, str]:
        """Put the kernel's connection file and sockets in a new folder of its own: its sandbox
        shows it that folder only, never another kernel's key or sockets."""
        manager, name, kernel_id = _pre_start(self, kernel_name, kwargs)
        # A short name: srt's sockets inside must fit a Unix socket's 107 bytes.
        folder = tempfile.mkdtemp(prefix="k", dir=self.connection_dir)
        manager.connection_file = os.path.join(folder, "kernel.json")
        manager.ip = os.path.join(folder, "ipc")
        return manager, name, kernel_id

    MultiKernelManager.pre_start_kernel = _pre_start_in_own_folder  # type: ignore[method-assign]

    _LINKS = ".links"
    """The gateway connects to a kernel's sockets through hard links in its folder with this suffix."""
    _KERNEL_CHANNELS = ("shell", "iopub", "stdin", "control", "hb")
    _BIND_TIMEOUT = 120.0
    _post_start = KernelManager._async_post_start_kernel
    _make_url = KernelManager._make_url

    async def _post_start_through_links(self: KernelManager, **kw: Any) -> None:
        """Connect to the kernel's sockets only through hard links out of the kernel's reach.

        The kernel can replace the socket files in its folder with links to any Unix socket of
        the host, which ZMQ would follow when it reconnects (after the kernel closed a socket or
        died). Once the kernel has bound them, each socket file is hard-linked into a folder
        beside the kernel's, which it cannot see: the links name the sockets the kernel bound and
        nothing else, and lead nowhere once it has ended.
        """
        folder = os.path.dirname(self.connection_file)
        if self.transport == "ipc" and os.path.dirname(folder) == _RUNTIME:
            links = folder + _LINKS
            os.makedirs(links, 0o700, exist_ok=True)
            deadline = time.monotonic() + _BIND_TIMEOUT
            for channel in _KERNEL_CHANNELS:
                path = f"{self.ip}-{getattr(self, channel + '_port')}"
                link = os.path.join(links, os.path.basename(path))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(link)  # a restarted kernel's sockets are new ones
                while True:
                    try:
                        os.link(path, link, follow_symlinks=False)
                        break
                    except FileNotFoundError:
                        if time.monotonic() > deadline or not await self._async_is_alive():
                            raise RuntimeError(f"the kernel did not bind its {channel} socket") from None
                        await asyncio.sleep(0.005)
                if not stat.S_ISSOCK(os.lstat(link).st_mode):
                    raise RuntimeError(f"the kernel's {channel} socket {path} is not a socket")
            self._ipybox_links = links  # type: ignore[attr-defined]
        await _post_start(self, **kw)

    def _make_url_through_links(self: KernelManager, channel: str) -> str:
        url = _make_url(self, channel)
        links = getattr(self, "_ipybox_links", None)
        return url if links is None else "ipc://" + os.path.join(links, os.path.basename(url))

    KernelManager._async_post_start_kernel = _post_start_through_links  # type: ignore[method-assign]
    KernelManager._make_url = _make_url_through_links  # type: ignore[method-assign,assignment]

    _cleanup_folder = LocalProvisioner.cleanup

    async def _cleanup_and_remove_folder(self: LocalProvisioner, restart: bool = False) -> None:
        """Also remove the ended kernel's own folder (a restart keeps it)."""
        await _cleanup_folder(self, restart)
        connection_file = self.parent.connection_file if self.parent is not None else ""
        folder = os.path.dirname(connection_file)
        if not restart and connection_file and os.path.dirname(folder) == _RUNTIME:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(folder + _LINKS, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(folder + _kernel_launch.SETTINGS_SUFFIX)

    LocalProvisioner.cleanup = _cleanup_and_remove_folder  # type: ignore[method-assign]

if os.environ.get(GatewayEnv.EXIT_WITH_PARENT) == "1":
    import signal
    import threading
    import time

    def _exit_with_parent() -> None:
        while sys.stdin.buffer.read(4096):
            pass  # nothing is ever written; end of file is the message
        os.kill(os.getpid(), signal.SIGTERM)  # the gateway's own shutdown: kernels too
        time.sleep(10)
        os._exit(1)

    threading.Thread(target=_exit_with_parent, name="ipybox-parent-watch", daemon=True).start()

_GROUPS = json.loads(os.environ.get(GatewayEnv.KERNEL_GROUPS) or "[]")
if _GROUPS:
    _cleanup = LocalProvisioner.cleanup

    async def _cleanup_and_reap(self: LocalProvisioner, restart: bool = False) -> None:
        """Also clear the ended kernel's control groups (see ``ipybox.gateway._limits``)."""
        await _cleanup(self, restart)
        _limits.reap(_GROUPS, self.pid)

    LocalProvisioner.cleanup = _cleanup_and_reap  # type: ignore[method-assign]

if __name__ == "__main__":
    launch_instance()
