"""The MCP server: the SDK's low-level `Server`, with tool calls routed to a session's tools."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import mcp_types as types
from dotenv import dotenv_values
from mcp.server import Server, ServerRequestContext
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from ipybox.app.approval import Policy
from ipybox.app.executor import CodeExecutor
from ipybox.app.pool import KernelPool
from ipybox.app.sandbox import Confined, ConfinedPathError
from ipybox.errors import IpyboxError
from ipybox.mcp_server import _files
from ipybox.mcp_server._cell_answers import Progress
from ipybox.mcp_server._elicit import ClientApproval
from ipybox.mcp_server._install import Installer, packages_dir
from ipybox.mcp_server._tools import TOOLS, ToolSession

_KERNEL_ENV_PREFIX = "KERNEL_ENV_"
_INSTRUCTIONS = (
    "ipybox runs Python in a stateful IPython kernel whose working directory is the workspace. "
    "Act by writing code: call `execute_ipython_cell`. To use an MCP server's tools from code, call "
    "`register_mcp_server` once, then import the generated modules from `mcptools.<server_name>`."
)


_LISTED = [declared.tool for declared in TOOLS.values()]

SESSIONS_DIR = "sessions"
"""Where HTTP sessions get their own working folders, inside the workspace."""


REMOTE_SESSIONS_DIR = "/tmp/ipybox-sessions"
"""Where on a remote kernel's host each MCP session's kernel works (``--kernel-gateway-url``)."""


@dataclass(frozen=True)
class Settings:
    """What the command line chose.

    Attributes:
        workspace: The workspace folder (absolute).
        sandbox: Run kernels in the sandbox.
        sandbox_config: A sandbox-runtime settings file.
        log_level: Log level of ipybox's own parts.
        spare_kernel: Keep a spare kernel per session for a fast reset (stdio); HTTP sessions
            do without, so that each costs one kernel's memory.
        session_folders: Give each session a new folder of its own inside
            ``workspace/sessions`` (`new_session_folder`) to work in, hidden from the other
            sessions' sandboxed kernels (HTTP); else every session works in `workspace` itself.
        environ: The server's environment, where ``HOME`` and ``KERNEL_ENV_*`` are read.
        approve_tool_calls: Put every tool call and shell command of a cell to the person at the
            MCP client (elicitation), instead of running them unasked.
        approval_timeout: Seconds each such question waits for its answer.
        tracing: Make OpenTelemetry spans (to the global tracer provider).
        policy: Policy rules for the tool calls and shell commands of every session.
        audit: Record every tool call in the audit trail (``ipybox audit``).
        pool: The kernel pool every session's executor takes its kernels from (``--pool``), if any.
        kernel_gateway_url: Run each session's kernel on this existing gateway; the kernel then works
            in its own folder there, gets only the ``KERNEL_ENV_*`` variables, and generated
            ``mcptools/`` are uploaded to it.
        kernel_gateway_token: That gateway's token.
        kernel_name: That gateway's kernel spec.
    """

    workspace: Path
    sandbox: bool = False
    sandbox_config: Path | None = None
    log_level: str = "WARNING"
    spare_kernel: bool = True
    session_folders: bool = False
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    approve_tool_calls: bool = False
    approval_timeout: float = 60
    tracing: bool = False
    policy: Policy | None = None
    audit: bool = False
    pool: KernelPool | None = None
    kernel_gateway_url: str | None = None
    kernel_gateway_token: str | None = field(default=None, repr=False)
    kernel_name: str | None = None

    def kernel_env(self, folder: Path | None = None) -> dict[str, str]:
        """The environment of a kernel working in `folder` (default: the workspace): ``HOME``,
        every ``KERNEL_ENV_NAME`` as ``NAME``, and the folder's packages folder first on
        ``PYTHONPATH``.

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
        # which a re-sync would reset (see _install), one folder per working folder. The folder
        # exists before the first kernel starts, so a sandbox binds it in (read-only) and
        # packages installed later are importable at once.
        packages = packages_dir(folder or self.workspace)
        packages.mkdir(mode=0o700, parents=True, exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(packages), env.get("PYTHONPATH")]))
        return env

    def executor(self, folder: Path | None = None) -> CodeExecutor:
        """A new, unstarted executor for one MCP session, working in `folder` (default: the workspace)."""
        folder = folder or self.workspace
        if self.kernel_gateway_url is not None:
            return self._remote_executor(folder)
        return CodeExecutor(
            spare_kernel=self.spare_kernel,
            kernel_env=self.kernel_env(folder),
            images_dir=folder / "images",
            sandbox=self.sandbox,
            sandbox_config=self.sandbox_config,
            log_level=self.log_level,
            approve_tool_calls=self.approve_tool_calls,
            approve_shell_cmds=self.approve_tool_calls,
            approval_timeout=self.approval_timeout,
            tracing=self.tracing,
            working_dir=folder,
            sandbox_hidden=(self.workspace / SESSIONS_DIR,) if folder != self.workspace else (),
            policy=self.policy,
            audit=self.audit,
            pool=self.pool,
        )

    def kernel_pool(self, size: int) -> KernelPool:
        """A new, unstarted pool of `size` ready kernels for the sessions: each in a new session
        folder of its own (`session_folders`), else in the workspace."""
        folders = self.session_folders
        return KernelPool(
            size,
            kernel_env=self.kernel_env(),
            sandbox=self.sandbox,
            sandbox_config=self.sandbox_config,
            log_level=self.log_level,
            approve_shell_cmds=self.approve_tool_calls,
            working_dir=self.workspace,
            sandbox_hidden=(self.workspace / SESSIONS_DIR,) if folders else (),
            new_folder=(lambda: new_session_folder(self.workspace)) if folders else None,
            folder_env=self.kernel_env if folders else None,
        )

    def _remote_executor(self, folder: Path) -> CodeExecutor:
        """An executor whose kernel runs on the gateway: this machine's home and packages folder
        mean nothing there, nor does a local working folder (images and mcptools stay in `folder`)."""
        env = self.kernel_env(folder)
        env.pop("HOME", None)
        env.pop("PYTHONPATH", None)
        return CodeExecutor(
            # A folder of its own on the kernel's host, so that sessions whose kernels share one
            # filesystem (kernels beside the gateway) do not replace each other's mcptools/.
            working_dir=f"{REMOTE_SESSIONS_DIR}/{secrets.token_hex(8)}",
            spare_kernel=self.spare_kernel,
            kernel_env=env,
            images_dir=folder / "images",
            log_level=self.log_level,
            approve_tool_calls=self.approve_tool_calls,
            approve_shell_cmds=self.approve_tool_calls,
            approval_timeout=self.approval_timeout,
            tracing=self.tracing,
            policy=self.policy,
            audit=self.audit,
            kernel_gateway_url=self.kernel_gateway_url,
            kernel_gateway_token=self.kernel_gateway_token,
            kernel_name=self.kernel_name,
        )

    def installer(self, folder: Path | None = None) -> Installer:
        """How packages are installed for kernels working in `folder` (default: the workspace)."""
        return Installer(
            packages_dir(folder or self.workspace),
            python=sys.executable,
            sandboxed=self.sandbox,
            environ=self.environ,
        )

    async def start_session(self) -> ToolSession:
        """The tools of a new session, on a started executor (a failed start leaves nothing)."""
        if not self.session_folders:
            folder = self.workspace
        elif self.pool is not None:
            folder = self.pool.claim()  # a new session folder whose kernel is ready (or starting)
        else:
            folder = new_session_folder(self.workspace)
        executor = self.executor(folder)
        try:
            await executor.start()
        except BaseException:
            if self.pool is not None and folder != self.workspace:
                with anyio.CancelScope(shield=True):
                    await self.pool.unclaim(folder)  # the kernel kept for it, if the start did not take it
            if folder != self.workspace:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if the kernel left nothing in it
            raise
        approval = ClientApproval(self.approval_timeout) if self.approve_tool_calls else None
        return ToolSession(executor, folder, self.installer(folder), self.transfer_rules(folder), approval)

    def transfer_rules(self, folder: Path | None = None) -> _files.Rules:
        """What the custom sandbox settings deny in `folder` (default: the workspace), refused by the
        file tools too."""
        if self.sandbox_config is None:
            return _files.Rules()
        from ipybox.app.sandbox import load_config

        return _files.Rules.from_sandbox_config(folder or self.workspace, load_config(self.sandbox_config))

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[ToolSession]:
        """A started session; its executor stops when the context exits, even when cancelled."""
        tools = await self.start_session()
        try:
            yield tools
        finally:
            with anyio.CancelScope(shield=True):
                await tools.executor.stop()


def new_session_folder(workspace: Path) -> Path:
    """Make a new, empty folder for one session in ``workspace/sessions``, never through a link.

    Its name is the UTC time and random characters: nothing in it comes from the client, nor
    tells one session's kernel where another's folder is.

    Raises:
        IpyboxError: If ``workspace/sessions`` is a link or a file, or the folder cannot be made.
    """
    name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(6)}"
    try:
        with Confined(workspace) as root:
            fd = root.open_dir(SESSIONS_DIR, create=True)
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            finally:
                os.close(fd)
    except (ConfinedPathError, OSError) as exc:
        raise IpyboxError(
            f"Cannot make a session folder in {workspace / SESSIONS_DIR}: {str(exc).rstrip('.')}. Fix that, "
            "or start the server with --shared-workspace."
        ) from exc
    return workspace / SESSIONS_DIR / name


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
        return types.ListToolsResult(tools=_LISTED)

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        session = await sessions.get(ctx)
        return await session.call(params.name, params.arguments or {}, _progress_reporter(ctx), ctx, params)

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
        # A client gone meanwhile must not fail the cell (broad: the SDK's transports fail with
        # errors of their own, none of which matter to the cell).
        with contextlib.suppress(Exception):
            await ctx.session.send_notification(notification, related_request_id=ctx.request_id)

    return report


@dataclass
class SingleSession:
    """The one session of a stdio server."""

    tools: ToolSession

    async def get(self, ctx: ServerRequestContext[Any]) -> ToolSession:
        return self.tools
