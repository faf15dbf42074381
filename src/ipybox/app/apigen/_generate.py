"""Generate a typed Python API (one module per tool) from the tool schemas of an MCP server.

:func:`~ipybox.generate_mcp_sources` lists a server's tools and writes ``root_dir/<server_name>/``:
an ``__init__.py`` whose docstring lists the tools, and one module per tool with

- ``Params``: a Pydantic v2 model of the tool's input schema (nested models for nested
  objects, ``Literal`` for enums, ``X | None`` for optional and nullable values, field aliases
  for property names that are not Python identifiers);
- ``Result``: a model of the tool's output schema, when the tool declares one (nested classes
  of the output side are prefixed ``Result`` so they never collide with the input side's);
- ``run(params: Params) -> Result | str``: calls the tool through the tool server, documented
  with the tool's description.

``run`` sends ``params.model_dump(mode="json", by_alias=True, exclude_none=True)``: agents pass
``None`` to mean "not given" far more often than they mean an explicit JSON ``null``, and most
servers reject ``null`` for a parameter that is merely optional. The price is that an explicit
``null`` cannot be sent; schema defaults are sent explicitly (so an approver sees them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from ipybox.app.apigen import _codegen, _search_index
from ipybox.app.mcp_client import ServerRegistry, default_registry
from ipybox.app.sandbox import Confined, ConfinedPathError, write_new
from ipybox.errors import ApiGenerationError, ServerParamsError

if TYPE_CHECKING:
    from mcp.types import Tool

__all__ = ["generate_mcp_sources", "kernel_writable_warning"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.mcp_apigen")


async def generate_mcp_sources(
    server_name: str,
    server_params: dict[str, Any],
    root_dir: Path | str,
    *,
    connect_timeout: float = 30,
    registry: ServerRegistry | None = None,
) -> list[str]:
    """Generate a typed Python tool API for an MCP server.

    Connects to the server (stdio, streamable HTTP or SSE, with ``${VAR}`` placeholders
    replaced from the environment or ``.env``), lists its tools, removes
    ``root_dir/<server_name>/`` if it exists and writes the package anew. The server is
    recorded in the tool server's trusted registry under ``server_name`` and ``root_dir``
    (placeholders unresolved): a `CodeExecutor` runs it only when ``root_dir`` is a folder the
    application put on its kernel's import path (its working directory, an absolute entry of
    ``kernel_env``'s ``PYTHONPATH``) or a folder directly in one (`mcptools/`). The generated
    files hold neither the parameters nor any secret. A stdio server whose command, arguments,
    working directory or ``env`` name a path in ``root_dir``'s parent (the working directory of
    a kernel that imports ``mcptools/``, which it can write) gets a warning logged: a sandboxed
    executor refuses to start such a server.

    A tool whose schema cannot be compiled is left out and named in a warning logged on
    ``ipybox.app.apigen._generate``; the other tools are generated. A module is named after its
    tool: characters outside ``[a-zA-Z0-9_]`` become ``_``, the name is lower-cased, a keyword
    gets a trailing ``_`` and a leading digit a leading ``_``; names that collide get a suffix
    ``_2``, ``_3``, ...

    Args:
        server_name: Name of the generated package and of the server for the tool server;
            must be an ASCII Python identifier that is not a keyword.
        server_params: MCP server parameters: ``{"command", "args", "env", "cwd"}`` for a
            stdio server, ``{"url", "headers", "type"}`` for an HTTP server.
        root_dir: Directory the package is written into (created if missing). It and everything
            in it are walked without following symbolic links (kernel code may write there), so
            ``root_dir`` itself must not be a link; its parent is taken as given.
        connect_timeout: Seconds the server has to start and answer the listing.
        registry: The trusted registry to record the server in; by default this user's
            (``default_registry()``), which a ``CodeExecutor`` given none reads too.

    Returns:
        The names of the generated tool modules, sorted (``[]`` if the server has no tools).

    Raises:
        ServerParamsError: ``server_name`` is not a valid package name, or the parameters are
            malformed or name an environment variable that is not set.
        MCPServerError: The server could not be started or reached, or did not answer in time.
        ApiGenerationError: The package could not be written, or the server could not be recorded
            in the registry.
    """
    if not isinstance(server_name, str) or not _codegen.is_identifier(server_name):
        raise ServerParamsError(
            f"server_name {server_name!r} cannot name a Python package: use ASCII letters, digits and "
            "underscores, not starting with a digit and not a Python keyword (e.g. 'brave_search')."
        )
    # Imported on first use: the MCP SDK is a heavy import, and `import ipybox` stays cheap.
    from ipybox.app.mcp_client import list_tools

    tools = await list_tools(server_name, server_params, connect_timeout=connect_timeout)
    if registry is None:
        registry = default_registry()
    try:
        await anyio.to_thread.run_sync(registry.register, server_name, server_params, Path(root_dir))
    except OSError as exc:
        raise ApiGenerationError(
            f"Could not record MCP server {server_name!r} in the tool server's registry: {exc}"
        ) from exc
    except ValueError as exc:
        raise ServerParamsError(str(exc)) from exc
    warning = await anyio.to_thread.run_sync(
        lambda: kernel_writable_warning(server_name, server_params, Path(os.path.abspath(root_dir)).parent)
    )
    if warning is not None:
        logger.warning("%s", warning)
    try:
        key = await anyio.to_thread.run_sync(_search_index.catalogue_key, registry.path.parent)
    except OSError as exc:
        raise ApiGenerationError(
            f"Could not read or make the tool search's key in {registry.path.parent}: {exc}"
        ) from exc
    return await anyio.to_thread.run_sync(_write_package, server_name, tools, Path(root_dir), key)


def kernel_writable_warning(server_name: str, server_params: dict[str, Any], folder: Path) -> str | None:
    """Why a sandboxed executor working in `folder` would refuse to start this stdio server (a
    path of it lies in `folder`, which the kernel can write), or ``None``."""
    from ipybox.app.mcp_client import StdioParams, confine, resolve_params

    try:
        resolved = resolve_params(server_params)
        if isinstance(resolved, StdioParams):
            confine(server_name, resolved, (folder,))
    except ServerParamsError as exc:
        return (
            f"MCP server {server_name!r} was registered, but a kernel working in {folder} can write "
            f"what it names, and with sandbox=True it is refused at its first call. {exc}"
        )
    return None


def _write_package(server_name: str, tools: Sequence[Tool], root_dir: Path, key: bytes) -> list[str]:
    sources = render_sources(server_name, tools)
    root_dir = Path(os.path.normpath(root_dir.absolute()))
    target = root_dir / server_name
    root = (root_dir.name,) if root_dir.name else ()
    # The tool search: this package's entries, then the index of every package in root_dir.
    generated = [
        (tool, module)
        for tool, module in zip(tools, _codegen.module_names([t.name for t in tools]), strict=True)
        if module in sources
    ]
    search_entries = _search_index.catalogue(
        root_dir.name, server_name, [tool for tool, _ in generated], [module for _, module in generated], key
    )

    def fill(package: int) -> None:
        for module, code in sources.items():
            write_new(package, f"{module}.py", code)
        write_new(package, _search_index.CATALOGUE_FILE, search_entries)

    try:
        # root_dir's parent is taken as the application names it; root_dir and everything in it
        # are walked without following links, which kernel code may have put there.
        root_dir.parent.mkdir(parents=True, exist_ok=True)
        with Confined(root_dir.parent, label=repr(str(root_dir.parent))) as base:
            base.replace_folder((*root, server_name), fill)
            _search_index.update_index(base, root, key, first=server_name)
    except (OSError, ConfinedPathError) as exc:
        raise ApiGenerationError(
            f"Could not write the package for MCP server {server_name!r} to {target}: {exc}"
        ) from exc
    return sorted(module for module in sources if module != "__init__")


def render_sources(server_name: str, tools: Sequence[Tool]) -> dict[str, str]:
    """Source code of a server's package, without touching the file system.

    Args:
        server_name: The package name (already checked to be an identifier).
        tools: The server's tools as the MCP SDK lists them.

    Returns:
        A mapping of module name (``"__init__"`` included) to source code; tools whose schema
        cannot be compiled are missing, and each is named in a logged warning.
    """
    names = _codegen.module_names([tool.name for tool in tools])
    sources: dict[str, str] = {}
    entries: list[tuple[str, str, str | None]] = []
    for module, tool in zip(names, tools, strict=True):
        try:
            sources[module] = _codegen.render_tool_module(
                server_name, tool.name, tool.description, tool.input_schema, tool.output_schema, tool.title
            )
        except _codegen.SchemaError as exc:
            # The reason quotes schema text: escaped, so a hostile server cannot forge log lines.
            reason = str(exc).encode("unicode_escape").decode("ascii")
            logger.warning("Tool %r of MCP server %r was not generated: %s.", tool.name, server_name, reason)
            continue
        entries.append((module, tool.name, tool.description))
    sources["__init__"] = _codegen.render_package_init(server_name, entries)
    return sources
