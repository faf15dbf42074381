"""`Parts`: what a started `CodeExecutor` runs, assembled by `Parts.start` and taken down by `stop`.

Application side only. The tool server (with the kernels' stdin channel for tool calls when they
use it), the kernels from one `KernelSource` (a gateway of the executor's own, a remote gateway or
a pool), and the approval client that hands the tool server's requests to the running cell. Each
part receives what it needs when it is made; a start that fails stops what it had started.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from ipybox._wire import StdinChannel, ToolServerEnv
from ipybox.app import sandbox as _sandbox
from ipybox.app._settings import ExecutorSettings
from ipybox.app.approval import ApprovalClient, ApprovalRequest
from ipybox.app.executor._oversight import Oversight
from ipybox.app.kernels import KernelHost, KernelSource, RemoteKernelHost
from ipybox.app.mcp_client import ServerRegistry
from ipybox.app.pool import KernelPool
from ipybox.app.tools import StdinToolCalls, ToolServer

__all__ = ["Parts"]


@dataclass(frozen=True, kw_only=True)
class Parts:
    """A started executor's parts; `stop` ends them all."""

    tool_server: ToolServer
    kernels: KernelSource
    approval: ApprovalClient
    oversight: Oversight
    # A sandboxed kernel's folder for the tool server's socket, which other executors' kernels cannot see.
    socket_dir: Path | None
    stdin_calls: StdinToolCalls | None

    @classmethod
    async def start(
        cls,
        settings: ExecutorSettings,
        registry: ServerRegistry,
        oversight: Oversight,
        pool: KernelPool | None,
        on_approval_request: Callable[[ApprovalRequest], Awaitable[None]],
    ) -> Parts:
        """Start the tool server, the kernels and the approval client, in that order.

        Raises:
            RuntimeError: If the tool server cannot bind its port.
            GatewayError: If the kernel gateway could not start.
            ValueError: If `working_dir` is not an existing folder.
            KernelConnectionError: If no kernel could be created.
            ApprovalConnectionError: If the approval connection to the tool server failed.
        """
        # .env of the working directory is read when an MCP server starts (mcp_client._params),
        # not copied into this process's environment.
        async with AsyncExitStack() as stack:
            trail_dir = oversight.open()
            stack.callback(oversight.close)
            # A sandboxed kernel has no network: it reaches the tool server through a Unix socket,
            # in a folder other executors' kernels cannot see.
            socket_dir = _sandbox.tools_dir() if settings.sandbox else None
            if socket_dir is not None:
                stack.callback(shutil.rmtree, socket_dir, True)
            tool_server = ToolServer(
                host=settings.tool_server_host,
                port=settings.tool_server_port or 0,
                approval_timeout=settings.approval_timeout,
                connect_timeout=settings.connect_timeout,
                log_level=settings.log_level,
                log_to_stderr=True,
                registry=registry,
                scope=settings.import_folders(),
                approve_tool_calls=settings.approve_tool_calls,
                max_result_size=settings.max_result_size,
                uds=socket_dir / "tools.sock" if socket_dir is not None else None,
                gate=oversight.gate,
                tracing=oversight.tracing,
            )
            await stack.enter_async_context(tool_server)
            # The kernel's stdin channel for tool calls (tool_channel="stdin").
            stdin_calls = StdinToolCalls(tool_server) if settings.tool_channel == "stdin" else None
            if stdin_calls is not None:
                stack.push_async_callback(stdin_calls.aclose)
            address = ToolServerEnv(
                host=settings.tool_server_host,
                port=tool_server.port,
                token=tool_server.token,
                socket=str(tool_server.uds) if tool_server.uds is not None else None,
                channel=StdinChannel.VALUE if stdin_calls is not None else None,
            )
            # The audit trail's folder too: a sandboxed kernel can neither read nor write it.
            hidden = (trail_dir,) if trail_dir is not None else ()
            kernels = _kernel_source(settings, registry, pool, tool_server, stdin_calls, address, hidden)
            await kernels.start()
            stack.push_async_callback(kernels.stop)
            approval = ApprovalClient(
                callback=on_approval_request,
                host=settings.tool_server_host,
                port=tool_server.port,
                secret=tool_server.approval_secret,
            )
            await stack.enter_async_context(approval)
            parts = cls(
                tool_server=tool_server,
                kernels=kernels,
                approval=approval,
                oversight=oversight,
                socket_dir=socket_dir,
                stdin_calls=stdin_calls,
            )
            # From here on stop() takes everything down; the stack only served a failed start.
            stack.pop_all()
        return parts

    async def stop(self) -> None:
        """Stop the kernels and the tool server with its MCP servers; the first failure is raised."""
        try:
            await self.approval.disconnect()
        finally:
            # Both run to their end even if one fails; the first failure is raised.
            outcomes = await asyncio.gather(
                self.kernels.stop(), self.tool_server.stop(), return_exceptions=True
            )
            if self.stdin_calls is not None:
                await self.stdin_calls.aclose()
            self.oversight.close()
            if self.socket_dir is not None:
                shutil.rmtree(self.socket_dir, ignore_errors=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome


def _kernel_source(
    settings: ExecutorSettings,
    registry: ServerRegistry,
    pool: KernelPool | None,
    tool_server: ToolServer,
    stdin_calls: StdinToolCalls | None,
    address: ToolServerEnv,
    hidden: tuple[Path, ...],
) -> KernelSource:
    """Where the executor's kernels come from: a remote gateway, a pool, or a gateway of its own.

    The tool server learns from the source, at each start of a gateway, where kernels write.
    """
    if settings.remote:
        assert stdin_calls is not None  # a remote kernel's calls come over its stdin channel
        kernel_env = {**settings.kernel_settings(), **address.to_env()}
        return RemoteKernelHost(settings, kernel_env, on_start=tool_server.confine, stdin_handler=stdin_calls)
    if pool is not None:
        return pool.kernels_for(settings, address, tool_server.confine, hidden)
    return KernelHost(
        settings,
        {**settings.kernel_settings(), **address.to_env()},
        on_start=tool_server.confine,
        hidden=hidden,
        registry_dir=registry.path.parent,
        stdin_handler=stdin_calls,
    )
