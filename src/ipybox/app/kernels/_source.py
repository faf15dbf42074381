"""`KernelSource`: what an executor needs of wherever its kernels come from.

Application side only. Three classes give an executor its kernels: `KernelHost` (a gateway of its
own), `RemoteKernelHost` (a gateway it did not start, `kernel_gateway_url`) and the pool's
`PooledKernels` (a shared gateway with kernels started ahead). They differ in where a kernel comes
from and how a lost one is put back; the executor sees only this protocol, as jupyter_client's
kernel manager sees only its provisioner's base class. Being a `typing.Protocol`, it needs no base
class: mypy checks each source against it, and ``isinstance`` does too at run time (member names
only; on Python 3.11 reading a property, so a source that is not started fails the check with
its own `RuntimeError`). The local sources also have their `gateway`; a remote one has none.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ipybox.app.kernels._client import KernelClient

__all__ = ["KernelSource"]


@runtime_checkable
class KernelSource(Protocol):
    """One executor's kernels: a client connected to the current one, and its replacement when it dies.

    The executor calls `start` once, runs cells through `client` (whose ``reset()`` gives a fresh
    kernel), calls `recover` when a cell's kernel died, and `stop` at its end.
    """

    @property
    def client(self) -> KernelClient:
        """The client of the current kernel (another object after a recovery may have replaced it).

        Raises:
            RuntimeError: If the source is not started.
        """
        ...

    async def start(self) -> None:
        """Make the first kernel ready and connect `client` to it; a failed start leaves nothing running.

        Raises:
            KernelConnectionError: If no kernel could be had.
        """
        ...

    async def stop(self) -> None:
        """Let go of the kernels this source started; stopping a stopped source does nothing."""
        ...

    async def recover(self) -> str:
        """After the kernel died mid-execution: a working kernel in its place, where possible.

        Returns:
            The message for the execution that was hit: what happened and what was done.
        """
        ...
