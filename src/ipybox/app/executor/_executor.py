"""`CodeExecutor`: kernel, tool server and approval composed into one SDK object.

Application side only. This module holds its arguments and its lifecycle (`start`, `stop`,
`reset`, `upload`); running cells (`execute`, `stream`, `cancel`) is its base `_Cells`
(``_cells.py``).
"""

from __future__ import annotations

import asyncio
import shutil
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from ipybox._wire import StdinChannel, ToolServerEnv
from ipybox.app import sandbox as _sandbox
from ipybox.app._settings import ExecutorSettings
from ipybox.app.approval import ApprovalClient, Policy
from ipybox.app.executor._cells import _Cells, _Item
from ipybox.app.executor._oversight import Oversight
from ipybox.app.executor._results import CodeExecutionChunk, CodeExecutionResult
from ipybox.app.executor._snapshots import _Snapshots
from ipybox.app.kernels import KernelHost, RemoteKernelHost
from ipybox.app.mcp_client import ServerRegistry, default_registry
from ipybox.app.pool import KernelPool, PooledKernels
from ipybox.app.tools import DEFAULT_MAX_RESULT_SIZE, StdinToolCalls, ToolServer
from ipybox.errors import (
    CodeExecutionError,
)

__all__ = ["CodeExecutionChunk", "CodeExecutionError", "CodeExecutionResult", "CodeExecutor"]


class CodeExecutor(_Cells, _Snapshots):
    """Runs Python in a stateful IPython kernel, with MCP tool calls approved by the application.

    `start()` launches a tool server and a Jupyter Kernel Gateway and connects a kernel.
    Code may call the modules written by `generate_mcp_sources`; every such call pauses
    the code and surfaces as an `ApprovalRequest` from `stream()`, to be accepted or
    rejected. The tool server runs only MCP servers recorded by `generate_mcp_sources`,
    takes calls only with a token the kernel receives, and takes decisions only from this
    executor, so code in the kernel cannot run, approve or redirect tool calls itself.

    Example:
        .. code-block:: python

            async with CodeExecutor() as executor:
                async for item in executor.stream(code):
                    match item:
                        case ApprovalRequest():
                            await item.accept()
                        case CodeExecutionResult():
                            print(item.text)

    Args:
        tool_server_host: Host the tool server binds to (the kernel connects to it).
        tool_server_port: Port of the tool server; ``None`` picks a free one.
        kernel_gateway_host: Host the kernel gateway binds to.
        kernel_gateway_port: Port of the kernel gateway; ``None`` picks a free one.
        kernel_env: Environment variables for the kernel, names and values strings. The kernel
            does not inherit the application's environment.
        images_dir: Folder for PNG images the code displays; default ``./images``.
        approval_timeout: Seconds to wait for each approval decision.
        connect_timeout: Seconds to wait for an MCP server to start.
        sandbox: Run the kernel inside Anthropic's sandbox-runtime (``srt``): no network but the
            tool server, no Unix socket of the host, nothing of the home folder but the working
            directory and the kernel's Python, no ``.env``; writes only to the working directory
            (never to ``.git``, editor and agent configuration) and private folders, and the
            application's processes out of sight. See the README's sandbox section.
        sandbox_config: Path of an srt settings file that replaces the default settings (needs
            ``sandbox=True``); the fixed rules (protected names, the trusted registry, credential
            files, the tool server reachable) hold whatever it says.
        log_level: Log level of the tool server and kernel gateway.
        approve_tool_calls: Whether MCP tool calls wait for approval; ``False`` lets them run
            unasked (shell commands still ask with ``approve_shell_cmds``).
        approve_shell_cmds: Whether shell commands in cells (``!cmd``, ``x = !cmd``, ``%%bash``,
            ``%%sh``, ``%%script``) wait for approval like tool calls: an `ApprovalRequest` with
            ``server_name="ipybox"`` and ``tool_name="shell"`` (``tool_args={"cmd": <the command
            with variables filled in>}``) or ``tool_name="shell_magic"`` (``{"magic", "cmd": <the
            cell>}``, and ``"args"`` when the magic's program has arguments). With ``sandbox=True``
            this is a wall, not a guard: the kernel cannot start any program (a seccomp filter), and
            an approved command runs on the tool server in a new sandbox with the kernel's settings.
        require_shell_escape: Refuse processes started directly from cell code (``subprocess``,
            ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn*``, ``pty.spawn``) with an
            error that says to use ``!``. A Python-level guard that code can undo: it keeps an
            agent on the approved path, it does not stop hostile code.
        memory_limit: Memory for the kernel together with every process it starts, in bytes or as
            ``"512M"``/``"2G"``; ``None``: no limit. Enforced with a control group where one can be
            created (the kernel is killed when it goes over: the execution fails with a message
            that says so, and a fresh kernel replaces it), else per process with ``RLIMIT_DATA``
            (an allocation over it raises ``MemoryError``). Sandboxed, srt's own process counts too.
        max_processes: Processes and threads the kernel may run at once, itself and everything it
            starts included (at least 16); ``None``: no limit. A fork bomb then fails to fork, and
            its processes are killed with the kernel's next replacement or at `stop()`.
        working_dir: The kernel's working directory, an existing folder. The kernel starts there,
            and after every cell that moved away (or deleted the folder it was in) it is put back,
            with a note in the output. ``None``: the application's working directory, and
            ``os.chdir`` persists.
        spare_kernel: Keep a spare kernel warm so that `reset()` takes milliseconds; ``False``
            saves that kernel's memory (the MCP server's HTTP sessions do).
        warm_imports: Modules every kernel imports in a background thread once it has run no
            cell for half a second (a spare kernel while it waits to be handed out), so that the
            first cell that needs them finds them loaded; a cell importing one meanwhile waits for
            that import. ``None`` or ``()``: nothing ahead. ``("matplotlib.pyplot",)`` makes a
            first plot after an idle moment about 0.4 s faster and costs each kernel about 31 MB
            (a sandboxed kernel also builds matplotlib's font cache at that import, seconds of
            CPU).
        max_result_size: Bytes one tool result may have on its way to the kernel (binary content
            counts as its base64; default 32 MiB); a larger result fails that call with an error
            naming the limit, and the next call works.
        sandbox_hidden: With ``sandbox=True``: folders the kernel can neither read nor write,
            whatever `sandbox_config` says, except `working_dir` when it lies inside one (the MCP
            server hides its sessions' folders from each other this way).
        tracing: OpenTelemetry spans for each cell, tool call (with its approval wait as a child)
            and MCP server start: ``True`` sends them to OpenTelemetry's global tracer provider, an
            OpenTelemetry ``TracerProvider`` to that one (``pip install 'ipybox[otel]'`` for the SDK and exporter);
            ``False`` (the default) makes none and imports nothing of OpenTelemetry for it.
        policy: Rules the tool server applies to every tool call and shell command before the
            application is asked (`ipybox.policy.Policy`): ``allow`` runs it unasked, ``deny``
            refuses it, ``ask`` yields an `ApprovalRequest` as without a policy. They live in
            this process only; the kernel can neither read nor change them.
        audit: Record every tool call and shell command in the audit trail (an SQLite file in the
            user's state folder, hidden from a sandboxed kernel; ``ipybox audit`` shows it), or
            ``False`` for no record. A path puts the database there instead (outside any folder
            the kernel can reach).
        registry: The trusted registry of MCP servers the tool server may run (by default this
            user's, ``default_registry()``, found once here); pass the same one to
            ``generate_mcp_sources``. With ``sandbox=True`` the kernel can never write its folder.
        pool: Take kernels from this `KernelPool` (its gateway, a ready kernel at start and at each
            reset) instead of starting a gateway; the executor's kernel settings must be the pool's.
        tool_channel: How generated code's tool calls reach the tool server: ``"http"`` (a local
            connection), or ``"stdin"``, over the kernel's own stdin channel and the gateway's
            WebSocket, for a kernel that can reach nothing else (on another host). Mainly for remote
            kernels; with ``"stdin"`` locally, every guarantee stays (registry, policy, approval,
            limits), calls only work while a cell runs, and ``input()`` raises ``EOFError``.
            ``None`` (the default): ``"stdin"`` with `kernel_gateway_url`, else ``"http"``.
        kernel_gateway_url: The address of an existing Jupyter gateway (Kernel Gateway, or
            Enterprise Gateway and its process proxies: Kubernetes, Docker, YARN, SSH) to run the
            kernel on, instead of starting a local one, e.g. ``"https://gateway.example.com"``.
            Kernels are started and stopped through its REST API; tool calls, approvals, plots and
            `upload` travel over the gateway's own WebSocket, so the kernel needs no connection to
            this process and no shared disk. `working_dir` is then an absolute path on the kernel's
            host (made if missing). Not available with it, as the cluster runs and isolates the
            kernel: ``sandbox``, ``sandbox_config``, ``sandbox_hidden``, ``memory_limit``,
            ``max_processes``, ``kernel_gateway_host``, ``kernel_gateway_port`` (a `ValueError`
            says why).
        kernel_gateway_token: The gateway's auth token (sent as ``Authorization: token ...``); it
            never reaches the kernel.
        kernel_name: The gateway's kernel spec to start (``GET /api/kernelspecs`` lists them);
            ``None``: its default. Its Python needs ipybox installed (see ``deploy/``).
        kernel_start_timeout: Seconds a kernel on `kernel_gateway_url` may take to start and be
            set up (a pod being scheduled, an image pulled), at start, reset and recovery; past
            them `KernelStartTimeoutError`. The gateway's own limit (Enterprise Gateway's
            ``KERNEL_LAUNCH_TIMEOUT``) may end it first.

    The arguments are checked at once and kept, frozen, as `settings`.

    Raises:
        ValueError: If an argument is out of range or of the wrong kind (the message names it),
            `sandbox_config` is given without ``sandbox=True``, the settings differ from `pool`'s,
            or an option that needs a local kernel is given with `kernel_gateway_url`.
    """

    def __init__(
        self,
        tool_server_host: str = "localhost",
        tool_server_port: int | None = None,
        kernel_gateway_host: str = "localhost",
        kernel_gateway_port: int | None = None,
        kernel_env: dict[str, str] | None = None,
        images_dir: Path | None = None,
        approval_timeout: float = 60,
        connect_timeout: float = 30,
        sandbox: bool = False,
        sandbox_config: Path | None = None,
        log_level: str = "WARNING",
        *,
        approve_tool_calls: bool = True,
        approve_shell_cmds: bool = False,
        require_shell_escape: bool = False,
        working_dir: Path | str | None = None,
        memory_limit: int | str | None = None,
        max_processes: int | None = None,
        spare_kernel: bool = True,
        warm_imports: tuple[str, ...] | None = None,
        max_result_size: int = DEFAULT_MAX_RESULT_SIZE,
        sandbox_hidden: tuple[Path, ...] = (),
        tracing: Any = False,
        policy: Policy | None = None,
        audit: bool | Path = False,
        registry: ServerRegistry | None = None,
        pool: KernelPool | None = None,
        tool_channel: Literal["http", "stdin"] | None = None,
        kernel_gateway_url: str | None = None,
        kernel_gateway_token: str | None = None,
        kernel_name: str | None = None,
        kernel_start_timeout: float = 120,
    ) -> None:
        self._settings = ExecutorSettings(
            tool_server_host=tool_server_host,
            tool_server_port=tool_server_port,
            kernel_gateway_host=kernel_gateway_host,
            kernel_gateway_port=kernel_gateway_port,
            kernel_env=kernel_env if kernel_env is not None else {},
            images_dir=images_dir,
            approval_timeout=approval_timeout,
            connect_timeout=connect_timeout,
            sandbox=sandbox,
            sandbox_config=sandbox_config,
            log_level=log_level,
            approve_tool_calls=approve_tool_calls,
            approve_shell_cmds=approve_shell_cmds,
            require_shell_escape=require_shell_escape,
            working_dir=Path(working_dir) if working_dir is not None else None,
            memory_limit=memory_limit,
            max_processes=max_processes,
            spare_kernel=spare_kernel,
            warm_imports=warm_imports,
            max_result_size=max_result_size,
            sandbox_hidden=sandbox_hidden,
            tool_channel=tool_channel,
            kernel_gateway_url=kernel_gateway_url,
            kernel_gateway_token=kernel_gateway_token,
            kernel_name=kernel_name,
            kernel_start_timeout=kernel_start_timeout,
        )
        # Objects the application keeps, not settings: the live rules, the trail, spans, the registry.
        self._oversight = Oversight(policy, audit, tracing)
        self._registry = registry if registry is not None else default_registry()
        if pool is not None:
            if self._settings.remote:
                raise ValueError(
                    "pool and kernel_gateway_url were both given; a pool keeps kernels on its own local "
                    "gateway. Drop one of them."
                )
            if self._settings.tool_channel != "http":
                raise ValueError(
                    "tool_channel='stdin' is for kernels on another host; a pool's kernels are local and "
                    "reach their tool server directly: leave tool_channel at 'http' with pool."
                )
            pool._check(self._settings, self._registry)
        self._pool = pool
        # The parts, made by start() and dropped by stop(); each owns its own lifecycle.
        self._tool_server: ToolServer | None = None
        self._kernels: KernelHost | PooledKernels | RemoteKernelHost | None = None
        self._approval: ApprovalClient | None = None
        self._socket_dir: Path | None = None
        self._stdin_calls: StdinToolCalls | None = None
        # The running execution: one at a time.
        self._lock = asyncio.Lock()
        self._requests: asyncio.Queue[_Item | None] | None = None
        self._runner: asyncio.Task[None] | None = None

    @property
    def settings(self) -> ExecutorSettings:
        """The executor's configuration, as its arguments made it (frozen)."""
        return self._settings

    @property
    def registry(self) -> ServerRegistry:
        """The trusted registry of MCP servers this executor's tool server runs from."""
        return self._registry

    @property
    def busy(self) -> bool:
        """Whether a cell is running (or waiting to run) now."""
        return self._lock.locked()

    @property
    def session_id(self) -> str:
        """The id of the current session in the audit trail (each start() begins one)."""
        return self._oversight.session_id

    @property
    def policy(self) -> Policy | None:
        """The policy rules (see the ``policy`` argument); setting it applies at once to later calls."""
        return self._oversight.policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        self._oversight.policy = policy

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the tool server and kernel gateway and connect a kernel.

        A start that fails stops whatever it had started.

        Raises:
            RuntimeError: If the executor is already started, or the tool server cannot
                bind its port.
            GatewayError: If the kernel gateway could not start.
            ValueError: If `working_dir` is not an existing folder.
            KernelConnectionError: If no kernel could be created.
            ApprovalConnectionError: If the approval connection to the tool server failed.
        """
        if self._kernels is not None:
            raise RuntimeError("The code executor is already started; call stop() first.")
        settings = self._settings
        # .env of the working directory is read when an MCP server starts (mcp_client._params),
        # not copied into this process's environment.
        async with AsyncExitStack() as stack:
            trail_dir = self._oversight.open()
            stack.callback(self._oversight.close)
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
                registry=self._registry,
                scope=settings.import_folders(),
                approve_tool_calls=settings.approve_tool_calls,
                max_result_size=settings.max_result_size,
                uds=socket_dir / "tools.sock" if socket_dir is not None else None,
                gate=self._oversight.gate,
                tracing=self._oversight.tracing,
            )
            await stack.enter_async_context(tool_server)
            # ---- the kernel's stdin channel for tool calls (tool_channel="stdin") ----
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
            kernel_env = {**settings.kernel_settings(), **address.to_env()}
            # The audit trail's folder too: a sandboxed kernel can neither read nor write it.
            hidden = (trail_dir,) if trail_dir is not None else ()
            kernels: KernelHost | PooledKernels | RemoteKernelHost
            if settings.remote:
                assert stdin_calls is not None  # a remote kernel's calls come over its stdin channel
                kernels = RemoteKernelHost(
                    settings, kernel_env, on_start=tool_server.confine, stdin_handler=stdin_calls
                )
            elif self._pool is not None:
                kernels = self._pool._kernels_for(settings, address, tool_server.confine, hidden)
            else:
                # The tool server learns from the gateway, at each of its starts, where kernels write.
                kernels = KernelHost(
                    settings,
                    kernel_env,
                    on_start=tool_server.confine,
                    hidden=hidden,
                    registry_dir=self._registry.path.parent,
                    stdin_handler=stdin_calls,
                )
            await kernels.start()
            stack.push_async_callback(kernels.stop)
            approval = ApprovalClient(
                callback=self._on_approval_request,
                host=settings.tool_server_host,
                port=tool_server.port,
                secret=tool_server.approval_secret,
            )
            await stack.enter_async_context(approval)
            self._tool_server, self._kernels, self._approval = tool_server, kernels, approval
            self._socket_dir, self._stdin_calls = socket_dir, stdin_calls
            # From here on stop() takes everything down; the stack only served a failed start.
            stack.pop_all()

    async def stop(self) -> None:
        """Stop the kernel, the kernel gateway and the tool server with its MCP servers.

        Stopping a stopped executor does nothing.
        """
        approval, kernels, tool_server = self._approval, self._kernels, self._tool_server
        socket_dir, stdin_calls = self._socket_dir, self._stdin_calls
        self._approval = self._kernels = self._tool_server = self._socket_dir = self._stdin_calls = None
        if approval is None or kernels is None or tool_server is None:
            return
        try:
            await approval.disconnect()
        finally:
            # Both run to their end even if one fails; the first failure is raised.
            outcomes = await asyncio.gather(kernels.stop(), tool_server.stop(), return_exceptions=True)
            if stdin_calls is not None:
                await stdin_calls.aclose()
            self._oversight.close()
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def reset(self) -> None:
        """Give the executor a fresh kernel and stop all MCP servers.

        Variables, imports and definitions are gone; MCP servers start again on their
        next tool call.

        Raises:
            RuntimeError: If the executor is not started.
            KernelConnectionError: If no fresh kernel could be created.
        """
        kernels, tool_server = self._require_started()
        async with self._lock:
            # Both resets run to their end even when one fails; the first failure is raised.
            outcomes = await asyncio.gather(
                kernels.client.reset(), tool_server.reset(), return_exceptions=True
            )
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def upload(self, source: Path | str, dest: str | None = None) -> str:
        """Put a file or folder into a remote kernel's working directory (`kernel_gateway_url`).

        A remote kernel shares no disk with the application: what it should import or read, such
        as the ``mcptools`` folder `generate_mcp_sources` wrote, is uploaded, and sent again to
        every fresh kernel (after `reset()`, a restart or a recovery). An upload to the same
        place replaces the earlier one (a folder whole). Locally the kernel reads `working_dir`
        itself: write files there instead.

        Example:
            .. code-block:: python

                await generate_mcp_sources("library", params, Path("build/mcptools"))
                await executor.upload("build/mcptools")  # the kernel imports mcptools.library

        Args:
            source: The local file or folder.
            dest: Where it goes, relative to the kernel's working directory; by default its name.

        Returns:
            Where it went, relative to the kernel's working directory.

        Raises:
            RuntimeError: If the executor is not started, or its kernel is local.
            ValueError: If `source` does not exist or is too large, or `dest` is not a relative
                path inside the working directory.
            KernelConnectionError: If the kernel could not unpack it.
        """
        kernels, _ = self._require_started()
        if not isinstance(kernels, RemoteKernelHost):
            raise RuntimeError(
                "upload() is for kernels on a remote gateway (kernel_gateway_url); a local kernel reads "
                "its working_dir directly: write the files there."
            )
        async with self._lock:
            return await kernels.upload(Path(source), dest)

    async def download(self, path: str, max_bytes: int = 64 * 1024 * 1024) -> bytes:
        """A file from a remote kernel's host (`kernel_gateway_url`): what `upload` is to sending.

        Read in pieces of 3 MiB carried in replies, not as output (which gateways rate-limit).

        Args:
            path: The file, relative to the kernel's working directory (or absolute). Links and
                anything but a regular file are refused.
            max_bytes: The largest file taken.

        Raises:
            RuntimeError: If the executor is not started, or its kernel is local.
            ValueError: If the kernel could not read the file, it is over `max_bytes`, or it
                changed while it was read.
        """
        kernels, _ = self._require_started()
        if not isinstance(kernels, RemoteKernelHost):
            raise RuntimeError(
                "download() is for kernels on a remote gateway; read a local kernel's files directly."
            )
        async with self._lock:
            return await kernels.download(path, max_bytes)
