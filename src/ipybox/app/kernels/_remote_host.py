"""`RemoteKernelHost`: an executor's kernel on a gateway it did not start (`kernel_gateway_url`).

The counterpart of `KernelHost` for kernels on another machine or a cluster (Jupyter Kernel
Gateway, or Enterprise Gateway with its Kubernetes, Docker, YARN or SSH process proxies). No
gateway is started here: kernels are started, interrupted and shut down through the gateway's REST
API, and everything a local kernel gets from the disk and its process environment reaches a remote
one as cells, since the two share neither:

- the setup cell, run in every fresh kernel before it serves any execution (at start, at every
  reset and restart): the kernel environment the executor builds (`KernelEnv`, the tool channel's
  variables, ``kernel_env``; never a secret such as the tool server's token, which is of no use
  there) is applied, then ipybox's kernel extension is loaded, as the local kernel spec does;
- one cell per upload (`RemoteKernelHost.upload`: the generated ``mcptools/`` package, files the
  application hands over), a gzipped tar archive in base64 that standard-library code unpacks in
  the kernel's working directory; uploads are kept and sent again to every fresh kernel.

The gateway's token goes only into the HTTP and WebSocket requests to the gateway: with it, code
in the kernel could open other kernels through the gateway's API.
"""

from __future__ import annotations

import base64
import binascii
import io
import posixpath
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import httpx2
import websockets

from ipybox._wire import ToolServerEnv
from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels._client import KernelClient
from ipybox.app.kernels._gateway import KernelGateway
from ipybox.app.kernels._stdin import StdinHandler
from ipybox.app.sandbox import KernelConfinement
from ipybox.errors import ExecutionError, KernelConnectionError, KernelDiedError

__all__ = ["MAX_UPLOAD_SIZE", "RemoteKernelHost", "setup_cell", "upload_cell"]

# Bytes of one upload's archive: its cell (in base64) must stay under the 10 MiB a Jupyter
# Server takes in one WebSocket message.
MAX_UPLOAD_SIZE = 6 * 1024 * 1024
# What the local kernel's environment has that a remote kernel must not get: the tool server's
# token, and its addresses, which a remote kernel cannot reach (its tool calls and shell
# approvals go over its stdin channel, TOOL_SERVER_CHANNEL).
_NOT_REMOTE = (
    ToolServerEnv.TOKEN,
    ToolServerEnv.SOCKET,
    ToolServerEnv.PROXY,
    ToolServerEnv.HOST,
    ToolServerEnv.PORT,
)
_LOST = "all variables, imports and definitions are gone"
_STOPPED = "The kernel died while running the code, and the executor was stopped."

_SETUP = """\
def _ipybox_setup(env):
    import os, sys
    os.environ.update(env)
    # Only ipybox's own installation may provide its extension, never a folder the kernel writes.
    sys.path[:] = [path for path in sys.path if path not in ("", ".", os.getcwd())]
    ip = get_ipython()
    kernel = getattr(ip, "kernel", None)
    if hasattr(kernel, "_execute_sleep"):
        kernel._execute_sleep = 0
    try:
        ip.run_line_magic("colors", "nocolor")
    except Exception:
        pass
    ip.run_line_magic("load_ext", "ipybox.kernel._ext")
_ipybox_setup({env})
del _ipybox_setup
"""

_UNPACK = """\
def _ipybox_unpack(dest, data):
    import base64, io, os, shutil, tarfile
    from ipybox.kernel._imports import refresh
    if os.path.isdir(dest) and not os.path.islink(dest):
        shutil.rmtree(dest)
    elif os.path.lexists(dest):
        os.remove(dest)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data)), mode="r:gz") as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(".", filter="data")
        else:
            archive.extractall(".")
    refresh()
_ipybox_unpack({dest}, {data})
del _ipybox_unpack
"""


# Bytes of a file per cell of a download: 4 MiB of base64 in one reply.
_PIECE = 3 * 1024 * 1024
_READ = """\
def _ipybox_read(path, offset, size, limit):
    import base64, os, stat
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} is {info.st_size} bytes, over the limit of {limit}")
        piece = base64.b64encode(os.pread(fd, size, offset)).decode("ascii")
        return f"{info.st_size} {info.st_ino}.{info.st_mtime_ns} {piece}"
    finally:
        os.close(fd)
"""
# The text (repr) of what `_ipybox_read` returns: a size, the file's identity (inode and
# modification time: a file replaced between pieces is not mixed in) and base64, nothing else.
_PIECE_TEXT = re.compile(r"'(\d{1,12}) (\d{1,24}\.\d{1,24}) ([A-Za-z0-9+/=]*)'")


def setup_cell(env: dict[str, str]) -> str:
    """The cell that makes a fresh remote kernel an ipybox kernel with environment `env`."""
    return _SETUP.format(env=repr(env))


def upload_cell(source: Path, dest: str) -> str:
    """The cell that puts the file or folder `source` at `dest` (relative) in the kernel's working directory.

    Raises:
        ValueError: If `source` does not exist, or its archive is over `MAX_UPLOAD_SIZE`.
    """
    if not source.exists():
        raise ValueError(f"Nothing to upload: {str(source)!r} does not exist.")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        archive.add(source, arcname=dest, filter=_no_caches)
    data = buffer.getvalue()
    if len(data) > MAX_UPLOAD_SIZE:
        raise ValueError(
            f"{str(source)!r} is {len(data)} bytes compressed, over the {MAX_UPLOAD_SIZE} bytes one upload to a "
            "remote kernel may have; upload its parts separately, or let the kernel fetch large data itself."
        )
    return _UNPACK.format(dest=repr(dest), data=repr(base64.b64encode(data).decode()))


def _no_caches(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Leave out bytecode caches; owners and modes of this machine mean nothing there."""
    if "__pycache__" in info.name.split("/"):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def upload_dest(source: Path, dest: str | None) -> str:
    """Where an upload goes, relative to the kernel's working directory.

    Raises:
        ValueError: If `dest` is absolute or leaves the working directory.
    """
    name = dest if dest is not None else source.name
    normal = posixpath.normpath(name)
    if not name or posixpath.isabs(name) or normal == "." or normal == ".." or normal.startswith("../"):
        raise ValueError(
            f"The upload's destination must be a path inside the kernel's working directory, like "
            f"'mcptools' or 'data/input.csv', not {name!r}."
        )
    return normal


class RemoteKernelHost:
    """A kernel on an existing gateway and the client connected to it, set up and recovered.

    Args:
        settings: The executor's settings (`kernel_gateway_url`, its token, `kernel_name`,
            `kernel_start_timeout`, images folder, spare kernel).
        env: The kernel's environment, as a local kernel would get it; secrets are left out.
        on_start: Called with the kernel's confinement (none: the cluster confines it) at start.
    """

    def __init__(
        self,
        settings: ExecutorSettings,
        env: dict[str, str],
        on_start: Callable[[KernelConfinement], None],
        *,
        stdin_handler: StdinHandler | None = None,
    ) -> None:
        assert settings.kernel_gateway_url is not None
        self._stdin_handler = stdin_handler
        self._settings = settings
        self._url = settings.kernel_gateway_url
        self._env = {name: value for name, value in env.items() if name not in _NOT_REMOTE}
        self._on_start = on_start
        self._uploads: dict[str, str] = {}  # destination -> its cell
        self._client: KernelClient | None = None
        # A kernel could not be replaced after it was lost: the next execution gets a fresh one.
        self._lost = False

    @property
    def gateway(self) -> KernelGateway:
        """There is no local gateway (`KernelHost.gateway` has one).

        Raises:
            RuntimeError: Always.
        """
        raise RuntimeError(f"The kernel runs on the gateway at {self._url}; no local gateway was started.")

    @property
    def client(self) -> KernelClient:
        """The client of the current kernel.

        Raises:
            RuntimeError: If the host is not started.
        """
        if self._client is None:
            raise RuntimeError("The kernels are not started; call start() first.")
        return self._client

    async def start(self) -> None:
        """Start a kernel on the gateway and set it up.

        Raises:
            KernelConnectionError: If the gateway cannot be reached, refuses the kernel, or the
                kernel fails its setup.
            KernelStartTimeoutError: If the kernel was not ready within `kernel_start_timeout`.
        """
        self._on_start(KernelConfinement())
        client = self._new_client()
        # A second try at once, for a kernel that died or lost its connection while it started
        # (a pod evicted at boot, a loaded gateway); not after `kernel_start_timeout`, which
        # `connect` raises at once, nor with a pause: a gateway that is not there now will not be
        # there in a second.
        await client.connect(retries=2, retry_interval=0)
        self._client = client

    async def stop(self) -> None:
        """Shut the kernel (and the spare) down on the gateway; stopping a stopped host does nothing."""
        client, self._client = self._client, None
        if client is not None:
            await client.disconnect()

    async def upload(self, source: Path, dest: str | None = None) -> str:
        """Put the file or folder `source` into the kernel's working directory, now and after every reset.

        Returns:
            Where it went, relative to the working directory.

        Raises:
            ValueError: If `source` does not exist, is too large, or `dest` is not a relative path
                inside the working directory.
            KernelConnectionError: If the kernel could not unpack it.
        """
        where = upload_dest(source, dest)
        cell = upload_cell(source, where)
        try:
            # Silent, like a fresh kernel's uploads: the agent's cells keep their numbers.
            await self.client.evaluate(cell, {}, timeout=self._settings.kernel_start_timeout)
        except ExecutionError as exc:
            raise KernelConnectionError(
                f"The kernel could not unpack the upload of {str(source)!r} to {where!r}: {exc.ename}: {exc.evalue}"
            ) from exc
        # Later uploads to the same place replace earlier ones, in the order they came.
        self._uploads.pop(where, None)
        self._uploads[where] = cell
        return where

    async def download(self, path: str, max_bytes: int) -> bytes:
        """The file `path` (relative to the kernel's working directory, or absolute) on the kernel's host.

        Read a piece per silent cell, the pieces carried in the cells' replies (`KernelClient.evaluate`):
        a gateway rate-limits output, not replies. What comes back is the kernel's word, so each
        piece is checked: a size and base64, each piece as long as a read of a regular file gives.

        Raises:
            ValueError: If the kernel could not read it (missing, a link, not a regular file, over
                `max_bytes`), or it changed while it was read.
        """
        data = bytearray()
        total, identity = -1, ""
        while len(data) != total:
            call = f"_ipybox_read({path!r}, {len(data)}, {_PIECE}, {int(max_bytes)})"
            try:
                text = (await self.client.evaluate(_READ, {"piece": call}))["piece"]
            except KernelDiedError:
                raise
            except ExecutionError as exc:
                raise ValueError(f"The kernel could not read {path!r}: {exc.ename}: {exc.evalue}") from None
            match = _PIECE_TEXT.fullmatch(text)
            try:
                if match is None or len(match[3]) > (_PIECE + 2) // 3 * 4:
                    raise binascii.Error
                size, piece = int(match[1]), base64.b64decode(match[3], validate=True)
            except binascii.Error:
                raise ValueError(f"The kernel's answer for {path!r} is not a piece of a file.") from None
            # A regular file's read is short only at its end: anything else changed under the read.
            changed = total >= 0 and (size != total or match[2] != identity)
            if size > max_bytes or changed or len(piece) != min(_PIECE, size - len(data)):
                raise ValueError(f"{path!r} changed while it was read; try again.")
            total, identity = size, match[2]
            data += piece
        return bytes(data)

    async def recover(self) -> str:
        """After the kernel died (or its connection was lost): put a fresh kernel in its place.

        Returns:
            The message for the execution that was hit: what happened and what was done.
        """
        client = self._client
        if client is None:
            return _STOPPED
        lost, self._lost = self._lost, False
        try:
            await client.reset()
            # One round trip proves the fresh kernel works (a spare's connection may not have
            # noticed yet that the gateway went away).
            await client.execute("", timeout=self._settings.kernel_start_timeout)
        # Broad on purpose: whatever failed, the execution that was hit gets a message that says
        # so and what happens next, rather than an error from the middle of the recovery.
        except (KernelConnectionError, ExecutionError, TimeoutError, httpx2.HTTPError, OSError) as error:
            self._lost = True
            return (
                f"The kernel was lost (it died, or the gateway at {self._url} went away) and no fresh "
                f"kernel could be started ({error}); its state is lost. The next execution tries again."
            )
        except websockets.WebSocketException as error:
            self._lost = True
            return (
                f"The kernel was lost and the connection to a fresh one failed ({error!r}); its state is "
                "lost. The next execution tries again."
            )
        if self._client is not client:
            return _STOPPED
        if lost:
            return (
                f"The gateway at {self._url} gave a fresh kernel only now, so this code did not run; "
                f"{_LOST}. Run it again."
            )
        return f"The kernel died while running the code; a fresh kernel has replaced it and {_LOST}."

    def _setup_cells(self) -> list[str]:
        return [setup_cell(self._env), *self._uploads.values()]

    def _new_client(self) -> KernelClient:
        settings = self._settings
        return KernelClient(
            url=self._url,
            auth_token=settings.kernel_gateway_token,
            kernel_name=settings.kernel_name,
            images_dir=settings.images_dir,
            spare_kernel=settings.spare_kernel,
            start_timeout=settings.kernel_start_timeout,
            setup=self._setup_cells,
            # Tool calls come over the kernel's stdin channel: it reaches nothing but its gateway.
            stdin_handler=self._stdin_handler,
        )
