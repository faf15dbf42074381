"""`CodeExecutor`: kernel, tool server and approval composed into one SDK object.

Application side only. The executor is the one composition root, and holds its parts rather
than inheriting them: `Parts` (``_parts.py``) starts and stops the tool server, the kernels (one
`KernelSource`) and the approval client; `Cells` (``_cells.py``) runs one cell at a time; the
snapshot work is in ``_snapshot.py``. This module holds the arguments and the public methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from pathlib import Path
from types import TracebackType
from typing import Any, Self, Unpack

from ipybox.app._settings import (
    ExecutorKeywords,
    ExecutorSettings,
    KernelOptions,
    RemoteGateway,
    ToolOptions,
    gather_options,
)
from ipybox.app.approval import ApprovalRequest, Policy
from ipybox.app.executor import _snapshot
from ipybox.app.executor._cells import Cells, Item
from ipybox.app.executor._oversight import Oversight
from ipybox.app.executor._parts import Parts
from ipybox.app.executor._results import CodeExecutionChunk, CodeExecutionResult
from ipybox.app.executor._snapshot import DEFAULT_MAX_SNAPSHOT_BYTES, SnapshotReport
from ipybox.app.kernels import KernelSource, RemoteKernelHost
from ipybox.app.mcp_client import ServerRegistry, default_registry
from ipybox.app.pool import KernelPool
from ipybox.app.sandbox import KernelConfinement
from ipybox.app.tools import ToolServer
from ipybox.errors import CodeExecutionError

__all__ = ["CodeExecutionChunk", "CodeExecutionError", "CodeExecutionResult", "CodeExecutor"]


class CodeExecutor:
    """Runs Python in a stateful IPython kernel, with MCP tool calls approved by the application.

        `start()` launches a tool server and a Jupyter Kernel Gateway and connects a kernel.
        Code may call the modules written by `generate_mcp_sources`; every such call pauses
        the code and surfaces as an `ApprovalRequest` from `stream()`, to be accepted or
        rejected. The tool server runs only MCP servers recorded by `generate_mcp_sources`,
        takes calls only with a token the kernel receives, and takes decisions only from this
        executor, so code in the kernel cannot run, approve or redirect tool calls itself.

        Example:
            ```python
    async with CodeExecutor() as executor:
        async for item in executor.stream(code):
            match item:
                case ApprovalRequest():
                    await item.accept()
                case CodeExecutionResult():
                    print(item.text)
            ```

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
            kernel: What each kernel is (`KernelOptions`: working directory, memory and process limits,
                shell approval, modules imported ahead, hidden folders); shared with `KernelPool`.
            tools: How tool calls reach the tool server and what it lets through (`ToolOptions`:
                approval of tool calls, the largest result, the channel).
            remote: Run the kernel on an existing gateway (`RemoteGateway`) instead of starting a local one.
            spare_kernel: Keep a spare kernel warm so that `reset()` takes milliseconds; ``False``
                saves that kernel's memory (the MCP server's HTTP sessions do).
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
            **keywords: The fields of `KernelOptions` and `ToolOptions` under their own names
                (``working_dir=``, ``memory_limit=``, ``max_processes=``, ``warm_imports=``,
                ``approve_shell_cmds=``, ``require_shell_escape=``, ``sandbox_hidden=``,
                ``approve_tool_calls=``, ``max_result_size=``, ``tool_channel=``) and those of
                `RemoteGateway` as ``kernel_gateway_url=``, ``kernel_gateway_token=``, ``kernel_name=``,
                ``kernel_start_timeout=``: the same settings as the option object with that field.

        The arguments are checked at once and kept, frozen, as `settings`.

        Raises:
            ValueError: If an argument is out of range or of the wrong kind (the message names it),
                `sandbox_config` is given without ``sandbox=True``, the settings differ from `pool`'s,
                an option that needs a local kernel is given with a remote gateway, or a setting is
                given both in an option object and as a keyword.
            TypeError: If a keyword argument is none of the above.
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
        kernel: KernelOptions | None = None,
        tools: ToolOptions | None = None,
        remote: RemoteGateway | None = None,
        spare_kernel: bool = True,
        tracing: Any = False,
        policy: Policy | None = None,
        audit: bool | Path = False,
        registry: ServerRegistry | None = None,
        pool: KernelPool | None = None,
        **keywords: Unpack[ExecutorKeywords],
    ) -> None:
        options = gather_options(
            "CodeExecutor", keywords, ExecutorKeywords.__optional_keys__, kernel, tools, remote
        )
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
            spare_kernel=spare_kernel,
            **options,  # type: ignore[arg-type]  # each checked by ExecutorSettings
        )
        # Objects the application keeps, not settings: the live rules, the trail, spans, the registry.
        self._oversight = Oversight(policy, audit, tracing)
        self._registry = registry if registry is not None else default_registry()
        if pool is not None:
            pool.check(self._settings, self._registry)
        self._pool = pool
        self._cells = Cells(self._oversight)
        # What start() makes and stop() ends: tool server, kernels, approval client.
        self._parts: Parts | None = None

    @property
    def settings(self) -> ExecutorSettings:
        """The executor's configuration, as its arguments made it (frozen)."""
        return self._settings

    @property
    def registry(self) -> ServerRegistry:
        """The trusted registry of MCP servers this executor's tool server runs from."""
        return self._registry

    @property
    def started(self) -> bool:
        """Whether the executor is started (between `start()` and `stop()`)."""
        return self._parts is not None

    @property
    def confinement(self) -> KernelConfinement | None:
        """What the kernels can write, as the tool server holds it (it refuses to run an MCP server
        from there); ``None`` while the executor is not started."""
        return self._parts.tool_server.confinement if self._parts is not None else None

    @property
    def busy(self) -> bool:
        """Whether a cell is running (or waiting to run) now."""
        return self._cells.lock.locked()

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

    @property
    def _kernels(self) -> KernelSource | None:
        # White-box tests reach the kernels' gateway and client through this.
        return self._parts.kernels if self._parts is not None else None

    @property
    def _tool_server(self) -> ToolServer | None:
        # White-box tests reach the tool server through this.
        return self._parts.tool_server if self._parts is not None else None

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
        if self._parts is not None:
            raise RuntimeError("The code executor is already started; call stop() first.")
        self._parts = await Parts.start(
            self._settings, self._registry, self._oversight, self._pool, self._cells.on_approval_request
        )

    async def stop(self) -> None:
        """Stop the kernel, the kernel gateway and the tool server with its MCP servers.

        Stopping a stopped executor does nothing.
        """
        parts, self._parts = self._parts, None
        if parts is not None:
            await parts.stop()

    async def cancel(self) -> None:
        """Interrupt the running execution, if any, from another task.

        The interrupted `stream()` or `execute()` raises `CodeExecutionError` with
        ``ename == "KeyboardInterrupt"``; the kernel keeps its state.

        Raises:
            RuntimeError: If the executor is not started.
        """
        await self._cells.cancel(self._require_started().kernels)

    async def execute(self, code: str, timeout: float = 120) -> CodeExecutionResult:
        """Run code, approving every tool call it makes, and return the result.

        Args:
            code: Python code; top-level ``await`` works.
            timeout: Seconds the whole execution may take.

        Returns:
            The complete output text and images.

        Raises:
            CodeExecutionError: If the code raised, including a failed tool call.
            TimeoutError: If the execution took longer than `timeout`; the kernel keeps
                its state and the executor stays usable.
            RuntimeError: If the executor is not started.
        """
        async with contextlib.aclosing(self.stream(code, timeout=timeout)) as items:
            async for item in items:
                if isinstance(item, ApprovalRequest):
                    await item.accept()
                elif isinstance(item, CodeExecutionResult):
                    return item
        raise AssertionError("stream() always ends with a CodeExecutionResult")  # pragma: no cover

    async def stream(
        self, code: str, timeout: float = 120, chunks: bool = False
    ) -> AsyncGenerator[Item, None]:
        """Run code, yielding approval requests, output chunks and the final result.

        Every tool call the code makes is yielded as an `ApprovalRequest`, and waits until
        it is accepted or rejected (or `approval_timeout` passes). A rejected call raises
        inside the kernel. A second `stream()` on the same executor waits for the first.

        Args:
            code: Python code; top-level ``await`` works.
            timeout: Seconds the whole execution may take, approval waits included.
            chunks: Also yield `CodeExecutionChunk` items as output arrives.

        Yields:
            `ApprovalRequest` and (with ``chunks=True``) `CodeExecutionChunk` items, then
            one `CodeExecutionResult`.

        Raises:
            CodeExecutionError: If the code raised, a tool call was rejected or failed, or
                the kernel died (it is replaced by a fresh one; state is lost).
            TimeoutError: If the execution took longer than `timeout`; the kernel keeps
                its state and the executor stays usable.
            RuntimeError: If the executor is not started.
        """
        cells = self._cells.stream(self._require_started().kernels, code, timeout, chunks)
        async with contextlib.aclosing(cells):
            async for item in cells:
                yield item

    async def reset(self) -> None:
        """Give the executor a fresh kernel and stop all MCP servers.

        Variables, imports and definitions are gone; MCP servers start again on their
        next tool call.

        Raises:
            RuntimeError: If the executor is not started.
            KernelConnectionError: If no fresh kernel could be created.
        """
        parts = self._require_started()
        async with self._cells.lock:
            # Both resets run to their end even when one fails; the first failure is raised.
            outcomes = await asyncio.gather(
                parts.kernels.client.reset(), parts.tool_server.reset(), return_exceptions=True
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
                    ```python
        await generate_mcp_sources("library", params, Path("build/mcptools"))
        await executor.upload("build/mcptools")  # the kernel imports mcptools.library
                    ```

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
        kernels = self._require_started().kernels
        if not isinstance(kernels, RemoteKernelHost):
            raise RuntimeError(
                "upload() is for kernels on a remote gateway (kernel_gateway_url); a local kernel reads "
                "its working_dir directly: write the files there."
            )
        async with self._cells.lock:
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
        kernels = self._require_started().kernels
        if not isinstance(kernels, RemoteKernelHost):
            raise RuntimeError(
                "download() is for kernels on a remote gateway; read a local kernel's files directly."
            )
        async with self._cells.lock:
            return await kernels.download(path, max_bytes)

    async def save_snapshot(
        self,
        path: Path | str,
        *,
        max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
        timeout: float = 120,
        dir_fd: int | None = None,
    ) -> SnapshotReport:
        """Write the kernel's state to the file `path`, to be loaded later into a fresh kernel.

        Kept: the user's variables, functions, classes and their instances (each name pickled on
        its own, in the kernel; names that held one object hold one object again), the modules
        bound to names (imported again by name) and the working directory. Not kept, and named in
        the report: open files, sockets and clients, threads, running tasks, generators and frames,
        values that cannot be pickled (each name with its reason), IPython's history and output
        cache, ipybox's own plumbing and the MCP servers' sessions (`SnapshotReport.not_kept`).
        The file is written by the kernel and only checked here (never unpickled); it replaces
        `path` atomically once whole. A name that would take it over `max_bytes` is left out.

        Args:
            path: The snapshot file to write (its folder must exist).
            max_bytes: The largest snapshot (default 2 GiB).
            timeout: Seconds the kernel may take to write it.
            dir_fd: A descriptor of the folder to write in; `path` is then a file name in it,
                and no link is followed.

        Returns:
            The names saved and left out, the modules, the working directory, size and time.

        Raises:
            RuntimeError: If the executor is not started.
            SnapshotError: If the kernel failed, died or wrote no whole snapshot, or `path`'s folder
                cannot be written.
            TimeoutError: If the kernel took longer than `timeout`.
        """
        kernels = self._require_started().kernels
        async with self._cells.lock:
            return await _snapshot.save(
                kernels, self._settings, path, dir_fd=dir_fd, max_bytes=max_bytes, timeout=timeout
            )

    async def load_snapshot(
        self,
        path: Path | str,
        *,
        max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
        timeout: float = 120,
        dir_fd: int | None = None,
    ) -> SnapshotReport:
        """Load the snapshot at `path` into the kernel (normally a fresh one); its names replace
        those of the same name.

        The file is checked here (whole, of this format, under `max_bytes`) and unpickled only in the
        kernel, with the kernel's rights (sandboxed when the executor is): a hostile snapshot can do
        what a cell can, nothing more. A name that fails to load is reported in `left_out` and the
        others load; the file is never changed.

        Args:
            path: The snapshot file.
            max_bytes: The largest snapshot taken (default 2 GiB).
            timeout: Seconds the kernel may take to load it.
            dir_fd: A descriptor of the folder the file is in; `path` is then a file name in it,
                and no link is followed.

        Returns:
            The names restored and those that were not (with the reason), the modules, the working
            directory, size and time.

        Raises:
            RuntimeError: If the executor is not started.
            SnapshotError: If the file is missing, cut short, not a snapshot, over `max_bytes`, from
                another Python version, or the kernel failed or died loading it.
            TimeoutError: If the kernel took longer than `timeout`.
        """
        kernels = self._require_started().kernels
        async with self._cells.lock:
            return await _snapshot.load(
                kernels, self._settings, path, dir_fd=dir_fd, max_bytes=max_bytes, timeout=timeout
            )

    def _require_started(self) -> Parts:
        if self._parts is None:
            raise RuntimeError("The code executor is not started; call start() or use 'async with'.")
        return self._parts
