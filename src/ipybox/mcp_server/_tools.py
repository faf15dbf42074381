"""The MCP tools of the ipybox server, implemented on one `CodeExecutor` per MCP session.

In the ``ipybox`` MCP server's process (trusted). How a cell's answer is made (output, images,
progress, asking the client) is in :mod:`ipybox.mcp_server._cell_answers`.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import logging
import mimetypes
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from pydantic import Field

from ipybox.app.approval import ApprovalRequest, Decider, decide_for
from ipybox.app.executor import CodeExecutionChunk, CodeExecutionResult, CodeExecutor
from ipybox.app.kernels import DEFAULT_MAX_OUTPUT_CHARS, KeptText
from ipybox.app.sandbox import Confined, ConfinedPathError, relative_parts
from ipybox.errors import (
    ApiGenerationError,
    ApprovalError,
    CodeExecutionError,
    IpyboxError,
    MCPServerError,
    ServerParamsError,
    ToolSearchError,
)
from ipybox.kernel._search import MAX_LIMIT, MAX_QUERY_CHARS
from ipybox.mcp_server import _elicit, _files, _search
from ipybox.mcp_server._cell_answers import Progress, _CellAnswers, _error, _report_progress, _text
from ipybox.mcp_server._declare import Declared, declare
from ipybox.mcp_server._install import Installer, InstallError
from ipybox.mcp_server._snapshots import SNAPSHOT_TOOLS, SnapshotTools

logger = logging.getLogger(__name__)

MCPTOOLS_DIR = "mcptools"
_MIN_OUTPUT_CHARS = 200
_MAX_MIB = _files.MAX_FILE_BYTES // (1024 * 1024)

# What install_package answers for a kernel on a gateway, whose environment is on its own host.
_REMOTE_INSTALL = (
    "This session's kernel runs on a kernel gateway (--kernel-gateway-url), in an environment on its "
    "own host: install_package installs only for a local kernel. Put the package into the kernel's "
    "image (deploy/kernel-image/Dockerfile), or install it from a cell where the kernel's host can "
    "reach a package index: `import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', "
    "'install', {package!r}], check=True)`."
)

# The refresh after a registration or an install (see `ipybox.kernel._imports`): the import
# system's file caches are cleared, and with `prefix` the modules of the (re)generated package go.
_REFRESH = "from ipybox.kernel._imports import refresh as _ipybox_refresh\n_ipybox_refresh({prefix!r})\ndel _ipybox_refresh\n"

TOOLS: dict[str, Declared] = {}
"""The tools, by name, in the order they are listed: each declared once, on its `ToolSession` method."""
_tool = functools.partial(declare, TOOLS)


class ToolSession(_CellAnswers, SnapshotTools):
    """The tools of one MCP session, on that session's executor.

    Args:
        executor: A started `CodeExecutor` whose working directory is `workspace`.
        workspace: The workspace folder.
        installer: How packages are installed for the kernel.
        rules: What the sandbox's settings deny in the workspace, refused by the file tools too.
    """

    def __init__(
        self,
        executor: CodeExecutor,
        workspace: Path,
        installer: Installer,
        rules: _files.Rules | None = None,
        approval: _elicit.ClientApproval | None = None,
    ) -> None:
        self.executor = executor
        self.workspace = workspace
        self.installer = installer
        self.rules = rules or _files.Rules()
        self.approval = approval

    async def call(
        self,
        name: str,
        arguments: Mapping[str, Any],
        progress: Progress | None,
        ctx: ServerRequestContext[Any] | None = None,
        state: types.CallToolRequestParams | None = None,
    ) -> types.CallToolResult | types.InputRequiredResult:
        """Run the tool `name`; errors come back as results with ``isError``.

        With `approval` (``--approve-tool-calls``), cells ask the client of `ctx` about their tool
        calls; `state` is a 2026-07-28 retry that carries the client's answers.
        """
        declared = TOOLS.get(name)
        if declared is None:
            return _error(f"There is no tool named {name!r}; the tools are: {', '.join(TOOLS)}.")
        try:
            kwargs = declared.validate(arguments)
        except ValueError as exc:
            return _error(str(exc))
        if declared.takes_progress:
            kwargs["progress"] = progress
        try:
            if self.approval is not None and declared.handler is ToolSession.execute_ipython_cell:
                return await self._execute_asking(self.approval, ctx, state, **kwargs)
            return await declared.handler(self, **kwargs)
        except IpyboxError as exc:
            # The executor's own failures (the gateway gone and not restartable, a reset that
            # found no kernel) reach the agent as tool errors it can read.
            return _error(f"{type(exc).__name__}: {exc}")

    @_tool(
        title="Execute Python code",
        description=(
            "Run Python code in a stateful IPython kernel and return its output: printed text, the value of "
            "the last expression, errors with their traceback, and plots as images.\n\n"
            "Variables, imports and definitions persist between calls until `reset`. Top-level `await` works. "
            "The working directory is the workspace. Find the tools of registered MCP servers with `search_tools`; "
            "call them from code: "
            "`from mcptools.<server_name>.<tool_module> import Params, run` and `run(Params(...))`; "
            "these calls run without asking, unless the server runs with --approve-tool-calls (then the user "
            "accepts or declines each call and shell command; a declined one raises an error in the cell). "
            "Shell commands work with `!cmd`.\n\n"
            "Output longer than `max_output_chars` keeps its beginning and end; the full text is saved to a "
            "file in the workspace that the output names. After `timeout` seconds the code is interrupted "
            "(state is kept) and the output so far is returned."
        ),
        read_only=False,
        destructive=True,
        open_world=True,
    )
    async def execute_ipython_cell(
        self,
        code: Annotated[str, Field(description="Python code to run; may contain IPython magics.")],
        timeout: Annotated[
            float, Field(gt=0, description="Seconds the code may run before it is interrupted.")
        ] = 120,
        max_output_chars: Annotated[
            int,
            Field(
                ge=_MIN_OUTPUT_CHARS,
                description="Longest output returned; longer output keeps its head and tail.",
            ),
        ] = 5000,
        *,
        progress: Progress | None = None,
    ) -> types.CallToolResult:
        """Run `code` in the kernel; output, images and errors shaped for an agent."""
        output = KeptText(DEFAULT_MAX_OUTPUT_CHARS)
        result: CodeExecutionResult | None = None
        failure: str | None = None
        async with anyio.create_task_group() as tasks:
            if progress is not None:
                tasks.start_soon(_report_progress, progress, output)
            try:
                stream = self.executor.stream(code, timeout=timeout, chunks=True)
                async with contextlib.aclosing(stream) as items:
                    async for item in items:
                        if isinstance(item, CodeExecutionChunk):
                            output.append(item.text)
                        elif isinstance(item, CodeExecutionResult):
                            result = item
                        elif isinstance(item, ApprovalRequest):  # pragma: no cover - calls run unasked
                            await item.accept()
            except CodeExecutionError as exc:
                failure = exc.traceback or str(exc)
            except TimeoutError as exc:
                failure = f"[Timed out: {exc}]"
            finally:
                tasks.cancel_scope.cancel()
        return await self._cell_answer(output, result, failure, max_output_chars)

    @_tool(
        title="Register an MCP server",
        description=(
            "Connect to an MCP server, generate a typed Python API for its tools in "
            "`mcptools/<server_name>/` in the workspace, and allow code to call them. Returns the tool "
            "module names; import one with `from mcptools.<server_name>.<module> import Params, run` "
            "(`Result` too when the tool declares an output schema) and read its source for the "
            "parameters.\n\n"
            '`server_params` for a local server: `{"command": "npx", "args": [...], "env": {...}}`; for '
            'a remote one: `{"url": "https://.../mcp", "headers": {...}}`. Write secrets as `${VAR}`: '
            "they are filled in from the server's environment or the workspace's `.env` file and never "
            "reach the kernel. Registering a name again regenerates its API."
        ),
        read_only=False,
        destructive=False,
        idempotent=True,
        open_world=True,
    )
    async def register_mcp_server(
        self,
        server_name: Annotated[
            str,
            Field(description="Python package name for the server, e.g. 'github' or 'brave_search'."),
        ],
        server_params: Annotated[
            dict[str, Any], Field(description="stdio: command, args, env, cwd; HTTP: url, headers, type.")
        ],
    ) -> types.CallToolResult:
        """Generate `mcptools/<server_name>/` and record the server for the tool server."""
        from ipybox.app.apigen import generate_mcp_sources, kernel_writable_warning

        # An early, friendly refusal of a link in place of mcptools/ (before the server is
        # recorded); the write itself is confined whatever happens in between.
        try:
            with Confined(self.workspace) as workspace:
                workspace.mkdir(MCPTOOLS_DIR)
        except ConfinedPathError as exc:
            return _error(f"Cannot register {server_name!r}: {exc}")
        # Under --sandbox the server must not run from where kernels write: refused before it is
        # started for the listing (the tool server checks again at every start).
        confinement = self.executor.confinement
        if confinement is not None and confinement.writable:
            from ipybox.app.mcp_client import StdioParams, confine, resolve_params

            try:
                resolved = resolve_params(server_params)
                if isinstance(resolved, StdioParams):
                    confine(server_name, resolved, confinement.writable, confinement.readonly)
            except ServerParamsError as exc:
                return _error(str(exc))
        try:
            names = await generate_mcp_sources(
                server_name,
                server_params,
                self.workspace / MCPTOOLS_DIR,
                connect_timeout=self.executor.settings.connect_timeout,
                registry=self.executor.registry,
            )
        except (ServerParamsError, MCPServerError, ApiGenerationError) as exc:
            return _error(str(exc))
        if self.executor.settings.remote:
            # A kernel on a gateway shares no disk with this server: it gets the package as a cell.
            await self.executor.upload(self.workspace / MCPTOOLS_DIR, MCPTOOLS_DIR)
        # A kernel that imported an earlier version of this package must see the new one.
        await self._run_quietly(_REFRESH.format(prefix=f"{MCPTOOLS_DIR}.{server_name}"))
        listing = "\n".join(f"- {name}" for name in names) or "(the server has no tools)"
        example = f"from {MCPTOOLS_DIR}.{server_name}.{names[0]} import Params, run" if names else ""
        warning = kernel_writable_warning(server_name, server_params, self.workspace)
        text = (
            f"Registered MCP server {server_name!r}. Tool modules in {MCPTOOLS_DIR}/{server_name}/:\n{listing}"
            + (f"\n\nImport one with: {example}" if example else "")
            + (f"\n\nWarning: {warning}" if warning else "")
        )
        return types.CallToolResult(
            content=[_text(text)], structured_content={"server_name": server_name, "tools": names}
        )

    @_tool(
        title="Search the tools of registered MCP servers",
        description=(
            "Find the tools of the registered MCP servers that fit a need, best first. Each match names the "
            "server and tool and gives the line that imports its module and how it is called "
            "(`module.run(module.Params(...))`). Search first, then read only the modules you will use. "
            "Kernel code can search too: `from ipybox.tool_exec.search import search_tools`."
        ),
        read_only=True,
        idempotent=True,
        open_world=False,
    )
    async def search_tools(
        self,
        query: Annotated[
            str,
            Field(
                description=f"What the tool should do, in words (at most {MAX_QUERY_CHARS} characters), "
                "e.g. 'create an issue in a repository'."
            ),
        ],
        limit: Annotated[int, Field(description=f"How many matches at most, from 1 to {MAX_LIMIT}.")] = 5,
    ) -> types.CallToolResult:
        """The best tools in `mcptools/` for `query`, each with its import line and signature."""
        try:
            matches = await anyio.to_thread.run_sync(
                _search.search, self.workspace, MCPTOOLS_DIR, query, limit
            )
        except ToolSearchError as exc:
            return _error(str(exc))
        text = "\n".join(f"{rank}. {match}" for rank, match in enumerate(matches, 1))
        return types.CallToolResult(
            content=[
                _text(
                    text
                    or f"No tool matches {query!r}: none shares its words or comes close in meaning. Try "
                    "other words, or register an MCP server that does it."
                )
            ],
            structured_content={"matches": [dataclasses.asdict(match) for match in matches]},
        )

    @_tool(
        title="Install a Python package",
        description=(
            "Install a Python package for the kernel; it can be imported right after, without a reset. "
            "Accepts a name with optional extras and version specifiers ('pandas', 'httpx[http2]>=0.28') "
            "or a 'git+https://...' URL. The installer's error is returned if it fails."
        ),
        read_only=False,
        destructive=False,
        idempotent=True,
        open_world=True,
    )
    async def install_package(
        self,
        package_name: Annotated[
            str,
            Field(
                description="One requirement: 'name', 'name==1.2', 'name[extra]>=1', or 'git+https://...'."
            ),
        ],
        *,
        progress: Progress | None = None,
    ) -> types.CallToolResult:
        """Install `package_name` and make it importable in the running kernel; progress reports
        the installer's latest output line."""
        if self.executor.settings.remote:
            return _error(_REMOTE_INSTALL.format(package=package_name))
        output = KeptText(DEFAULT_MAX_OUTPUT_CHARS)
        failure: str | None = None
        log = ""
        started = time.monotonic()
        logger.info("Installing %r for the kernel", package_name)
        async with anyio.create_task_group() as tasks:
            if progress is not None:
                await progress(0, f"installing {package_name}")
                tasks.start_soon(_report_progress, progress, output)
            try:
                log = await self.installer.install(package_name, on_output=output.append)
            except InstallError as exc:
                failure = str(exc)
            except TimeoutError:
                failure = f"Installing {package_name!r} did not finish within 10 minutes and was stopped."
            finally:
                tasks.cancel_scope.cancel()
        if failure is not None:
            logger.info("Installing %r failed after %.1f s", package_name, time.monotonic() - started)
            return _error(failure)
        logger.info("Installed %r in %.1f s", package_name, time.monotonic() - started)
        await self._run_quietly(_REFRESH.format(prefix=""))
        last = log.splitlines()[-1] if log else ""
        return types.CallToolResult(content=[_text(f"Installed {package_name}. {last}".strip())])

    @_tool(
        title="Reset the kernel",
        description=(
            "Replace the kernel with a fresh one: all variables, imports and definitions are gone. "
            "Installed packages, registered MCP servers and files in the workspace stay."
        ),
        read_only=False,
        destructive=True,
        idempotent=True,
        open_world=False,
    )
    async def reset(self) -> types.CallToolResult:
        """Give the session a fresh kernel."""
        await self.executor.reset()
        return types.CallToolResult(
            content=[
                _text(
                    "The kernel was reset: variables, imports and definitions are gone. Installed packages, "
                    f"registered MCP servers ({MCPTOOLS_DIR}/) and workspace files are kept."
                )
            ]
        )

    @_tool(
        title="Put a file into the workspace",
        description=(
            "Write a file into the workspace, where code can read it (the workspace is the working "
            f"directory). `content_base64` is the file's bytes in base64; at most {_MAX_MIB} MiB. Parent "
            "folders are created; an existing file is replaced. Paths are relative to the workspace and "
            "cannot leave it; symbolic links are not followed, and secrets and configuration files (.env, "
            ".mcp.json, .claude/, .git/, ...) are refused."
        ),
        read_only=False,
        destructive=True,
        idempotent=True,
        open_world=False,
    )
    async def upload_file(
        self,
        path: Annotated[str, Field(description="Path relative to the workspace, e.g. 'data/input.csv'.")],
        content_base64: Annotated[str, Field(description="The file's bytes, base64-encoded.")],
    ) -> types.CallToolResult:
        """Write a file into the workspace."""
        try:
            size = _files.write(self.workspace, path, content_base64, rules=self.rules)
            if self.executor.settings.remote:
                # The kernel shares no disk with the workspace: it gets the file (again after a reset).
                await self.executor.upload(self.workspace / _shown(path), _shown(path))
        except _files.WorkspacePathError as exc:
            return _error(str(exc))
        except (ValueError, IpyboxError, TimeoutError) as exc:
            return _error(f"Wrote {_shown(path)} in the workspace, but the kernel did not get it: {exc}")
        return types.CallToolResult(
            content=[_text(f"Wrote {size} bytes to {_shown(path)} in the workspace.")]
        )

    @_tool(
        title="Get a file from the workspace",
        description=(
            "Return a file from the workspace (for example one that code wrote) as an embedded resource "
            f"with base64 content; at most {_MAX_MIB} MiB. Paths are relative to the workspace and cannot "
            "leave it; symbolic links, files with several hard links and secrets or configuration files "
            "(.env, .mcp.json, .claude/, .git/, ...) are refused."
        ),
        read_only=True,
        idempotent=True,
        open_world=False,
    )
    async def download_file(
        self,
        path: Annotated[str, Field(description="Path relative to the workspace, e.g. 'results/plot.png'.")],
    ) -> types.CallToolResult:
        """Return a file of the workspace as an embedded resource."""
        try:
            if self.executor.settings.remote:
                # The file is on the kernel's host; the names refused locally are refused there too.
                _files.check_read(self.workspace, path, rules=self.rules)
                data = await self.executor.download(_shown(path), _files.MAX_FILE_BYTES)
            else:
                data = _files.read(self.workspace, path, rules=self.rules)
        except (_files.WorkspacePathError, ValueError, IpyboxError, TimeoutError) as exc:
            return _error(str(exc) or f"Reading {path!r} in the kernel failed: {exc!r}")
        shown = _shown(path)
        mime_type = mimetypes.guess_type(shown)[0] or "application/octet-stream"
        resource = types.BlobResourceContents(
            uri=(self.workspace.absolute() / shown).as_uri(),
            mime_type=mime_type,
            blob=base64.b64encode(data).decode("ascii"),
        )
        return types.CallToolResult(
            content=[
                _text(f"{shown}: {len(data)} bytes, {mime_type}."),
                types.EmbeddedResource(type="resource", resource=resource),
            ]
        )

    async def _run_quietly(self, code: str) -> None:
        """Run a cell of the server's own (nobody asked for it, nobody sees it): every tool call or
        shell command made while it runs (by a hook or thread the kernel set up) is rejected,
        recorded as made in a hidden cell; it is never approved on anybody's behalf."""
        with contextlib.suppress(CodeExecutionError, TimeoutError):
            async with contextlib.aclosing(self.executor.stream(code, timeout=30)) as items:
                async for item in items:
                    if isinstance(item, ApprovalRequest):
                        with contextlib.suppress(ApprovalError):
                            await decide_for(item, False, Decider.HIDDEN_CELL)


TOOLS.update(SNAPSHOT_TOOLS)


def _shown(path: str) -> str:
    """A path that `_files` accepted, as shown back: forward slashes, no ``.`` components."""
    return "/".join(relative_parts(path))
