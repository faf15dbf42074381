"""The MCP servers of a tool server: which one a call names, its running session, the tool it calls.

Application side only. `ServerSessions` looks a server up in the trusted registry (or, in the
open mode, takes the parameters a request carries), starts or reuses its MCP session (one per
server, started once however many calls wait for it), and checks a call against the tool the
server lists (its name and its arguments' names) before anybody is asked about it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mcp.types import Tool

from ipybox.app.approval import Refused
from ipybox.app.mcp_client import MCPSession, ServerRegistry, StdioParams, confine, resolve_params
from ipybox.app.sandbox import KernelConfinement
from ipybox.app.tools._options import CallSpans
from ipybox.errors import ServerParamsError

__all__ = ["ServerSessions"]

# What an MCP message may carry besides the result itself (JSON-RPC envelope, escapes).
_ENVELOPE_ALLOWANCE = 1024 * 1024


class ServerSessions:
    """The MCP sessions of one tool server, by server name.

    Args:
        registry: The trusted registry servers are looked up in.
        scope: The folders a registered server's API must lie in (``None``: any).
        trust_all_clients: The open mode: a request may carry the parameters of its server.
        connect_timeout: Seconds a server has to start and complete the MCP handshake.
        max_result_size: Bytes one tool result may have (a session reads a little more: the envelope).
        confinement: The kernels' confinement as last given (a stdio server from where they write is refused).
        tracing: Makes a span of each server start; ``None``: no spans.
    """

    def __init__(
        self,
        registry: ServerRegistry,
        scope: Path | Sequence[Path] | None,
        *,
        trust_all_clients: bool,
        connect_timeout: float,
        max_result_size: int,
        confinement: Callable[[], KernelConfinement],
        tracing: CallSpans | None,
    ) -> None:
        self._registry = registry
        self.scope = (scope,) if isinstance(scope, Path) else tuple(scope) if scope is not None else None
        self._trust_all_clients = trust_all_clients
        self._connect_timeout = connect_timeout
        self._max_result_size = max_result_size
        self._confinement = confinement
        self._tracing = tracing
        # Each running session with the parameters it was started with, by server name.
        self.running: dict[str, tuple[MCPSession, dict[str, Any]]] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        # Each session's tools by name, listed before the first call of it that is checked.
        self._tools: weakref.WeakKeyDictionary[MCPSession, dict[str, Tool]] = weakref.WeakKeyDictionary()

    async def close_all(self) -> None:
        """Close every session; each is started again by its next call."""
        sessions = [session for session, _ in self.running.values()]
        self.running.clear()
        if sessions:
            await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)

    async def check(
        self, session: MCPSession, server_name: str, tool_name: str, tool_args: dict[str, Any], call: str
    ) -> Tool:
        """Refuse a call of a tool the server does not list, or with arguments its schema does not declare."""
        tools = self._tools.get(session)
        if tools is None or tool_name not in tools:
            # Listed again when a tool is not found: the server's tool list may have changed.
            tools = {tool.name: tool for tool in await session.list_tools()}
            self._tools[session] = tools
        tool = tools.get(tool_name)
        if tool is None:
            names = ", ".join(repr(name) for name in sorted(tools)[:30])
            raise Refused(
                404,
                "failed",
                f"Tool call {call} failed: MCP server {server_name!r} has no tool {tool_name!r} "
                f"(its tools: {names or 'none'}); nothing was asked or run.",
            )
        problem = _argument_problem(tool.input_schema, tool_args)
        if problem is not None:
            raise Refused(400, "failed", f"Tool call {call} failed: {problem}; nothing was asked or run.")
        return tool

    def params(self, server_name: str, server_params: dict[str, Any] | None, call: str) -> dict[str, Any]:
        """The parameters of the server a call names: from the trusted registry, or (open mode) the request."""
        if server_params:
            if not self._trust_all_clients:
                raise Refused(
                    403,
                    "failed",
                    f"Tool call {call} failed: this tool server runs only MCP servers registered by the "
                    "application, so a request cannot supply server_params; name a registered server instead.",
                )
            return server_params
        registry = self._registry
        try:
            params = registry.lookup_shared(server_name, self.scope)
        except OSError as exc:
            raise Refused(500, "failed", f"The MCP server registry could not be read: {exc}") from exc
        if params is not None:
            return params
        if self._trust_all_clients:
            running = self.running.get(server_name)
            if running is not None:
                return running[1]
            raise Refused(
                400,
                "failed",
                f"Tool call {call} failed: the request has no server_params and MCP server "
                f"{server_name!r} is neither running nor registered in {registry.path}; generate its API "
                "with generate_mcp_sources, or send server_params.",
            )
        where = ""
        if self.scope:
            folders = ", ".join(str(folder) for folder in self.scope)
            where = (
                f" into a folder the kernel imports from ({folders}) or a folder directly in one, such as "
                "mcptools/; CodeExecutor(kernel_env={'PYTHONPATH': folder}) adds a folder"
            )
        raise Refused(
            404,
            "failed",
            f"Tool call {call} failed: MCP server {server_name!r} is not registered for this executor; "
            f"generate its API with generate_mcp_sources(...) from this application{where}.",
        )

    async def session(self, server_name: str, params: dict[str, Any], call: str) -> MCPSession:
        """The running session of the server, started (or started again) when it is not running with `params`."""
        running = self.running.get(server_name)
        if running is not None and running[0].alive and running[1] == params:
            return running[0]
        lock = self._starting.setdefault(server_name, asyncio.Lock())
        async with lock:
            running = self.running.get(server_name)
            if running is not None:
                if running[0].alive and running[1] == params:
                    return running[0]
                del self.running[server_name]
                await running[0].close()
            try:
                resolved = resolve_params(params)
            except ServerParamsError as exc:
                # Parameters from a request are the client's mistake; registered ones the application's.
                status = 400 if self._trust_all_clients else 500
                raise Refused(status, "failed", f"Tool call {call} failed: {exc}") from exc
            confinement = self._confinement()
            if isinstance(resolved, StdioParams) and confinement.writable:
                try:
                    resolved = confine(server_name, resolved, confinement.writable, confinement.readonly)
                except ServerParamsError as exc:
                    raise Refused(403, "failed", f"Tool call {call} failed: {exc}") from exc
            session = MCPSession(
                server_name, resolved, self._connect_timeout, self._max_result_size + _ENVELOPE_ALLOWANCE
            )
            await (
                session.start()
                if self._tracing is None
                else self._tracing.server_start(server_name, session.start())
            )
            self.running[server_name] = (session, params)
            return session


def _argument_problem(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """What is wrong with the arguments' names for the tool's input schema, if anything.

    An argument the schema does not declare is refused unless the schema allows more
    (``additionalProperties`` true or a schema, or ``patternProperties``); a required one must be there.
    """
    properties = schema.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    extra = schema.get("additionalProperties")
    if not (extra is True or isinstance(extra, dict) or schema.get("patternProperties")):
        undeclared = [name for name in args if name not in declared]
        if undeclared:
            known = ", ".join(repr(name) for name in declared) or "none"
            return (
                f"the tool's input schema does not declare the argument(s) "
                f"{', '.join(repr(name) for name in undeclared)} (it declares: {known})"
            )
    required = schema.get("required")
    missing = [name for name in required if name not in args] if isinstance(required, list) else []
    if missing:
        return f"the tool requires the argument(s) {', '.join(repr(name) for name in missing)}"
    return None
