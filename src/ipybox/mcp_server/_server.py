"""The MCP server: the SDK's low-level `Server`, with tool calls routed to a session's tools."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import mcp_types as types
from dotenv import dotenv_values
from mcp.server import Server, ServerRequestContext
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from ipybox.code_exec import CodeExecutor
from ipybox.mcp_server import _files
from ipybox.mcp_server._install import Installer, packages_dir
from ipybox.mcp_server._tools import TOOLS, Progress, ToolSession

_KERNEL_ENV_PREFIX = "KERNEL_ENV_"
_INSTRUCTIONS = (
    "ipybox runs Python in a stateful IPython kernel whose working directory is the workspace. "
    "Act by writing code: call `execute_ipython_cell`. To use an MCP server's tools from code, call "
    "`register_mcp_server` once, then import the generated modules from `mcptools.<server_name>`."
)


@dataclass(frozen=True)
class Settings:
    """What the command line chose.

    Attributes:
        workspace: The workspace folder (absolute); the kernel's working directory.
        sandbox: Run kernels in the sandbox.
        sandbox_config: A sandbox-runtime settings file.
        log_level: Log level of ipybox's own parts.
        spare_kernel: Keep a spare kernel per session for a fast reset (stdio); HTTP sessions
            do without, so that each costs one kernel's memory.
        environ: The server's environment, where ``HOME`` and ``KERNEL_ENV_*`` are read.
    """

    workspace: Path
    sandbox: bool = False
    sandbox_config: Path | None = None
    log_level: str = "WARNING"
    spare_kernel: bool = True
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def kernel_env(self) -> dict[str, str]:
        """The kernel's environment: ``HOME``, every ``KERNEL_ENV_NAME`` as ``NAME``, and the
        workspace's packages folder first on ``PYTHONPATH``.

        Variables come from the server's environment and the workspace's ``.env`` (the
        environment wins, as in ``${VAR}`` substitution).
        """
        dotenv_path = self.workspace / ".env"
        values = (
            {k: v for k, v in dotenv_values(dotenv_path).items() if v is not None}
            if dotenv_path.is_file()
            else {}
        )
        values.update(self.environ)
        env = {"HOME": self.environ.get("HOME") or str(Path.home())}
        env.update(
            {
                key[len(_KERNEL_ENV_PREFIX) :]: value
                for key, value in values.items()
                if key.startswith(_KERNEL_ENV_PREFIX) and len(key) > len(_KERNEL_ENV_PREFIX)
            }
        )
        # Installed packages live where only the kernel looks, outside the server's environment,
        # which a re-sync would reset (see _install). The folder exists before the first kernel
        # starts, so a sandbox binds it in (read-only) and packages installed later are
        # importable at once.
        folder = packages_dir(self.workspace)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
        return env

    def executor(self) -> CodeExecutor:
        """A new, unstarted executor for one MCP session."""
        return CodeExecutor(
            spare_kernel=self.spare_kernel,
            kernel_env=self.kernel_env(),
            images_dir=self.workspace / "images",
            sandbox=self.sandbox,
            sandbox_config=self.sandbox_config,
            log_level=self.log_level,
            approve_tool_calls=False,
            working_dir=self.workspace,
        )

    def installer(self) -> Installer:
        """How packages are installed for kernels."""
        return Installer(
            packages_dir(self.workspace), python=sys.executable, sandboxed=self.sandbox, environ=self.environ
        )

    async def start_session(self) -> ToolSession:
        """The tools of a new session, on a started executor (a failed start leaves nothing)."""
        executor = self.executor()
        await executor.start()
        return ToolSession(executor, self.workspace, self.installer(), self.transfer_rules())

    def transfer_rules(self) -> _files.Rules:
        """What the custom sandbox settings deny in the workspace, refused by the file tools too."""
        if self.sandbox_config is None:
            return _files.Rules()
        from ipybox.kernel_mgr._sandbox import load_config

        return _files.Rules.from_sandbox_config(self.workspace, load_config(self.sandbox_config))

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[ToolSession]:
        """A started session; its executor stops when the context exits, even when cancelled."""
        tools = await self.start_session()
        try:
            yield tools
        finally:
            with anyio.CancelScope(shield=True):
                await tools.executor.stop()


class SessionSource(Protocol):
    """Finds the tools of the MCP session a request belongs to."""

    async def get(self, ctx: ServerRequestContext[Any]) -> ToolSession: ...


def build_server(sessions: SessionSource, *, handshake_only: bool = False) -> Server[Any]:
    """The low-level MCP server with the ipybox tools.

    Args:
        sessions: Finds a request's session.
        handshake_only: Answer the 2026 ``server/discover`` probe with the handshake-era
            versions only, so that HTTP clients open a session (and get their own kernel).
    """

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        session = await sessions.get(ctx)
        return await session.call(params.name, params.arguments or {}, _progress_reporter(ctx))

    async def discover(ctx: ServerRequestContext[Any], params: types.RequestParams) -> types.DiscoverResult:
        # Each MCP session has its own kernel, and only the handshake era has sessions: answering
        # the 2026 discovery probe with the handshake versions makes clients open one.
        return types.DiscoverResult(
            supported_versions=list(HANDSHAKE_PROTOCOL_VERSIONS),
            capabilities=server.get_capabilities(),
            instructions=_INSTRUCTIONS,
        )

    from importlib.metadata import version

    server: Server[Any] = Server(
        "ipybox",
        version=version("ipybox"),
        instructions=_INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
    if handshake_only:
        server.add_request_handler("server/discover", types.RequestParams, discover)
    return server


def _progress_reporter(ctx: ServerRequestContext[Any]) -> Progress | None:
    meta: dict[str, Any] = dict(ctx.meta or {})
    token = meta.get("progress_token", meta.get("progressToken"))
    if token is None:
        return None

    async def report(elapsed: float, message: str) -> None:
        notification = types.ProgressNotification(
            params=types.ProgressNotificationParams(progress_token=token, progress=elapsed, message=message)
        )
        # A client gone meanwhile must not fail the cell.
        with contextlib.suppress(Exception):
            await ctx.session.send_notification(notification, related_request_id=ctx.request_id)

    return report


@dataclass
class SingleSession:
    """The one session of a stdio server."""

    tools: ToolSession

    async def get(self, ctx: ServerRequestContext[Any]) -> ToolSession:
        return self.tools
