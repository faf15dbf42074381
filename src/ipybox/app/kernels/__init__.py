"""Kernels: the gateway process, the kernel client and the sources an executor gets kernels from.

Owns starting and stopping Jupyter Kernel Gateway (``_gateway``, ``_gateway_process``, the kernel
spec in ``_spec``), talking to one kernel over REST and WebSocket (``_client``, its channels in
``_wire``, its output in ``_output``, its stdin in ``_stdin``), opening kernels (``_open``,
``_supply``) and the two kernel sources of their own: a local gateway (`KernelHost`) and a
remote one (`RemoteKernelHost`).

May import (within ``ipybox.app``): ``sandbox``, ``_settings``, ``_state``.
"""

from ipybox.app.kernels._client import ExecutionError, ExecutionResult, KernelClient
from ipybox.app.kernels._gateway import KernelGateway
from ipybox.app.kernels._local_host import KernelHost, fresh_kernel
from ipybox.app.kernels._open import open_kernel
from ipybox.app.kernels._output import DEFAULT_MAX_OUTPUT_CHARS, KeptText
from ipybox.app.kernels._remote_host import RemoteKernelHost
from ipybox.app.kernels._wire import KernelChannels, execute_request

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "ExecutionError",
    "ExecutionResult",
    "KeptText",
    "KernelChannels",
    "KernelClient",
    "KernelGateway",
    "KernelHost",
    "RemoteKernelHost",
    "execute_request",
    "fresh_kernel",
    "open_kernel",
]
