"""A tool call of the tool server once its request is read: server, session, approval, answer.

Application side only. `_ToolCalls` is a base of :class:`ipybox.app.tools._server.ToolServer`:
it finds the server's parameters (from the trusted registry, or from the request in the open
mode), starts or reuses its MCP session, checks the call against the tool's schema, asks the
application for approval, calls the tool and makes the answer within the size limits.
"""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp.types import (
    AudioContent,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    TextContent,
    TextResourceContents,
    Tool,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Receive

from ipybox._wire import AnswerFields
from ipybox.app.approval import (
    ApprovalChannel,
    ApprovalClientDisconnected,
    Asked,
    Decider,
    Gate,
    GateDenied,
    NoApprovalClientError,
    Ticket,
)
from ipybox.app.mcp_client import MCPSession, ServerRegistry, StdioParams, confine, resolve_params
from ipybox.app.sandbox import KernelConfinement
from ipybox.app.tools._http import _Charge, _error, _json, _RequestBodies, _size, _summarise
from ipybox.errors import MCPServerError, ServerParamsError, ToolCallOutcome

if TYPE_CHECKING:
    from ipybox.app._tracing import Tracing

# How a rejection reads to the caller, by who decided (`Decider`).
_REJECTED_BY_APP = "was rejected by the application."
_REJECTED = {
    Decider.APPLICATION: _REJECTED_BY_APP,
    Decider.PERSON: "was rejected by the person at the MCP client.",
    Decider.HIDDEN_CELL: (
        "was rejected: it was made while a cell the application runs on its own was running (the refresh "
        "after register_mcp_server or install_package); nobody approves or is asked about a call then, "
        "so it does not run. Make the call from a cell of your own."
    ),
    Decider.TOO_LARGE: (
        "was rejected without asking: its arguments are too large to show to the person who approves "
        "calls. Pass less data per call (write large data to a file and pass its path)."
    ),
}
# What an MCP message may carry besides the result itself (JSON-RPC envelope, escapes).
_ENVELOPE_ALLOWANCE = 1024 * 1024


class _RunRequest(BaseModel):
    """The body of ``POST /run``."""

    model_config = ConfigDict(extra="forbid")

    server_name: str = Field(min_length=1)
    tool_name: str = Field(min_length=1)
    tool_args: dict[str, Any] = Field(default_factory=dict)
    server_params: dict[str, Any] | None = None
    # Whether the answer carries every content part and the structured content (``run_content``).
    content: bool = False


MAX_NAME_CHARS = 256
"""The longest server or tool name a call may carry (MCP names tools in at most 128 characters)."""


def name_problem(field: str, name: str) -> str | None:
    """Why `name` (a call's `field`) is refused, or ``None``: longer than `MAX_NAME_CHARS`, or holding a
    character that is not printable (control characters and terminal escapes, line breaks,
    invisible format marks such as right-to-left overrides, separators other than the space)."""
    if len(name) > MAX_NAME_CHARS:
        return (
            f"The tool call was refused before anything was asked, run or recorded: its {field} is {len(name)} "
            f"characters long, over the limit of {MAX_NAME_CHARS}. Call a tool by the names its server lists."
        )
    if not name.isprintable():
        return (
            f"The tool call was refused before anything was asked, run or recorded: its {field} {name!a} "
            "holds characters that cannot be shown as they are (control characters, terminal escapes, line "
            "breaks or invisible marks). Call a tool by the names its server lists."
        )
    return None


class _ToolCallError(Exception):
    """A ``/run`` request ends with this HTTP status, outcome kind and message."""

    def __init__(self, status: int, kind: ToolCallOutcome, message: str, by: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        # Who decided, for the audit trail, where the kind does not say it (an abandoned request).
        self.by = by


class _ToolCalls(_RequestBodies):
    """Runs the tool calls of ``POST /run`` (and asks approval for ``/approve`` and ``/shell``)."""

    approval_required: bool
    approval_timeout: float
    connect_timeout: float
    approve_tool_calls: bool
    max_result_size: int
    _confinement: KernelConfinement
    scope: tuple[Path, ...] | None
    trust_all_clients: bool
    # The policy and audit trail (set by CodeExecutor); None: every call asks, none is recorded.
    gate: Gate | None
    # Spans of calls, approval waits and server starts (the executor's, when tracing is on).
    tracing: Tracing | None
    _registry: ServerRegistry
    _channel: ApprovalChannel
    _sessions: dict[str, tuple[MCPSession, dict[str, Any]]]
    _starting: dict[str, asyncio.Lock]
    _tools: weakref.WeakKeyDictionary[MCPSession, dict[str, Tool]]

    async def _run(self, length: bytes | None, receive: Receive, charge: _Charge) -> tuple[int, bytes] | None:
        """The answer to a ``/run`` request whose token was checked; ``None`` if the client left."""
        raw = await self._read_body(length, receive, charge)
        if raw is None or isinstance(raw, tuple):
            return raw
        try:
            body = _RunRequest.model_validate_json(raw)
        except ValidationError as exc:
            return _error(400, "failed", f"The tool call request is malformed: {_summarise(exc)}")
        del raw  # the parsed request is all that is kept of it
        return await self.run_call(body, charge)

    async def run_call(self, body: _RunRequest, charge: _Charge) -> tuple[int, bytes]:
        """The answer to one tool call, whichever way its request came (``POST /run``, a kernel's stdin).

        Everything a call goes through is here, once: its span, the policy and audit trail, the
        registry lookup, the check against the tool's schema, the approval, the call itself and the
        size limits. The caller has parsed the request and authenticated where it came from;
        `charge` holds the request's bytes of the in-flight budget and, on success, the answer's.

        Returns:
            The HTTP status and the JSON answer, as ``POST /run`` sends them.
        """
        if self.tracing is not None:
            return await self.tracing.tool_call(
                body.server_name, body.tool_name, self._handle_run(body, charge)
            )
        return await self._handle_run(body, charge)

    async def _handle_run(self, body: _RunRequest, charge: _Charge) -> tuple[int, bytes]:
        # Names are shown to people (questions, the audit trail, logs): refused before anything of
        # the call is decided or recorded when they are too long or hold what a terminal acts on.
        problem = name_problem("server_name", body.server_name) or name_problem("tool_name", body.tool_name)
        if problem is not None:
            return _error(400, "failed", problem)
        # ---- policy and audit hook (ipybox.app.approval._gate): the ticket decides and records the call ----
        if self.gate is None:
            return await self._call(body, charge, None)
        ticket = self.gate.ticket(body.server_name, body.tool_name, body.tool_args)
        answer: tuple[int, bytes] | None = None
        try:
            answer = await self._call(body, charge, ticket)
            return answer
        finally:
            ticket.finish(*(answer or (None, None)))

    async def _admit(self, ticket: Ticket, session: MCPSession, body: _RunRequest, call: str) -> None:
        """Decide a call by the policy (and the application, when it says ask) and record it."""
        tool = await self._check_call(session, body, call)
        asks = self.approve_tool_calls and self.approval_required
        try:
            await ticket.admit(
                annotations=tool.annotations,
                ask=(lambda: self._approve(body, call)) if asks else None,
                secrets=session.params.secrets,
            )
        except GateDenied as exc:
            raise _ToolCallError(exc.status, exc.kind, f"Tool call {call} {exc.reason}.") from None
        # ---- end of the policy and audit hook ----

    async def _call(self, body: _RunRequest, charge: _Charge, ticket: Ticket | None) -> tuple[int, bytes]:
        call = f"{body.server_name}.{body.tool_name}"
        try:
            params = self._server_params(body)
            if ticket is not None:
                session = await self._session(body.server_name, params, call)
                await self._admit(ticket, session, body, call)
            elif self.approve_tool_calls and self.approval_required:
                # What the person is asked about must be a call the server can take as shown.
                session = await self._session(body.server_name, params, call)
                await self._check_call(session, body, call)
                await self._approve(body, call)
            else:
                session = await self._session(body.server_name, params, call)
            result = await session.call_tool_content(body.tool_name, body.tool_args)
            body.tool_args = {}  # no longer needed: not held while the answer is made
        except _ToolCallError as exc:
            return _error(exc.status, exc.kind, exc.message)
        except MCPServerError as exc:
            return _error(502, "failed", f"Tool call {call} failed: {exc}")
        if body.content and (least := _least_size(result.content)) > self.max_result_size:
            # Refused before it is serialised: no copies of a blob far over the limit.
            return self._too_large(call, least, "at least ")
        if body.content:
            answer = _json(
                {
                    AnswerFields.CONTENT: [
                        block.model_dump(mode="json", by_alias=True, exclude_none=True)
                        for block in result.content
                    ],
                    AnswerFields.STRUCTURED: result.structured_content,
                }
            )
        elif result.structured_content is not None:
            answer = _json({AnswerFields.RESULT: result.structured_content})
        else:
            texts = [block.text for block in result.content if isinstance(block, TextContent)]
            answer = _json({AnswerFields.RESULT: "\n".join(texts) if texts else None})
        if len(answer) > self.max_result_size:
            return self._too_large(call, len(answer))
        del result
        # The answer is counted instead of the request from here until it is sent.
        if not charge.swap(len(answer)):
            return _error(
                503,
                "failed",
                f"Tool call {call} failed: its result of {_size(len(answer))} did not fit in the tool server's "
                f"limit of {_size(self.max_inflight_size)} for the requests and answers of all calls in flight "
                "(ToolServer max_inflight_size) while other calls held it; make fewer large calls at once, "
                "or ask the tool for less at a time.",
            )
        return 200, answer

    async def _check_call(self, session: MCPSession, body: _RunRequest, call: str) -> Tool:
        """Refuse a call of a tool the server does not list, or with arguments its schema does not declare."""
        tools = self._tools.get(session)
        if tools is None or body.tool_name not in tools:
            # Listed again when a tool is not found: the server's tool list may have changed.
            tools = {tool.name: tool for tool in await session.list_tools()}
            self._tools[session] = tools
        tool = tools.get(body.tool_name)
        if tool is None:
            names = ", ".join(repr(name) for name in sorted(tools)[:30])
            raise _ToolCallError(
                404,
                "failed",
                f"Tool call {call} failed: MCP server {body.server_name!r} has no tool {body.tool_name!r} "
                f"(its tools: {names or 'none'}); nothing was asked or run.",
            )
        problem = _argument_problem(tool.input_schema, body.tool_args)
        if problem is not None:
            raise _ToolCallError(
                400, "failed", f"Tool call {call} failed: {problem}; nothing was asked or run."
            )
        return tool

    def _too_large(self, call: str, size: int, qualifier: str = "") -> tuple[int, bytes]:
        return _error(
            502,
            "failed",
            f"Tool call {call} failed: its result is {qualifier}{_size(size)}, over the tool server's limit "
            f"of {_size(self.max_result_size)} per result (ToolServer max_result_size); ask the tool for "
            "less at a time (a smaller page, image or file).",
        )

    def _server_params(self, body: _RunRequest) -> dict[str, Any]:
        call = f"{body.server_name}.{body.tool_name}"
        if body.server_params:
            if not self.trust_all_clients:
                raise _ToolCallError(
                    403,
                    "failed",
                    f"Tool call {call} failed: this tool server runs only MCP servers registered by the "
                    "application, so a request cannot supply server_params; name a registered server instead.",
                )
            return body.server_params
        registry = self._registry
        try:
            params = registry.lookup_shared(body.server_name, self.scope)
        except OSError as exc:
            raise _ToolCallError(500, "failed", f"The MCP server registry could not be read: {exc}") from exc
        if params is not None:
            return params
        if self.trust_all_clients:
            running = self._sessions.get(body.server_name)
            if running is not None:
                return running[1]
            raise _ToolCallError(
                400,
                "failed",
                f"Tool call {call} failed: the request has no server_params and MCP server "
                f"{body.server_name!r} is neither running nor registered in {registry.path}; generate its API "
                "with generate_mcp_sources, or send server_params.",
            )
        where = ""
        if self.scope:
            folders = ", ".join(str(folder) for folder in self.scope)
            where = (
                f" into a folder the kernel imports from ({folders}) or a folder directly in one, such as "
                "mcptools/; CodeExecutor(kernel_env={'PYTHONPATH': folder}) adds a folder"
            )
        raise _ToolCallError(
            404,
            "failed",
            f"Tool call {call} failed: MCP server {body.server_name!r} is not registered for this executor; "
            f"generate its API with generate_mcp_sources(...) from this application{where}.",
        )

    async def _approve(self, body: _RunRequest, call: str) -> Asked:
        try:
            decision = self._channel.ask(body.server_name, body.tool_name, body.tool_args)
            if self.tracing is not None:
                decision = self.tracing.approval(body.server_name, body.tool_name, decision)
            accepted, remember, abandoned, by = await decision
        except NoApprovalClientError:
            raise _ToolCallError(
                503,
                "failed",
                f"Tool call {call} failed: it needs approval, but the application's approval client is not "
                "connected to the tool server; connect an ApprovalClient before running code that calls tools.",
            ) from None
        except ApprovalClientDisconnected:
            raise _ToolCallError(
                503, "failed", f"Tool call {call} failed: the approval client disconnected before it decided."
            ) from None
        except TimeoutError:
            raise _ToolCallError(
                504,
                "expired",
                f"Tool call {call} expired: the application made no approval decision within "
                f"{self.approval_timeout:g} s.",
            ) from None
        if abandoned:
            raise _ToolCallError(
                403,
                "rejected",
                f"Tool call {call} was rejected: the application's stream ended before anybody decided.",
                by="abandoned",
            )
        if not accepted:
            raise _ToolCallError(
                403, "rejected", f"Tool call {call} {_REJECTED.get(by, _REJECTED_BY_APP)}", by=by
            )
        return Asked(accepted, remember, by=by)

    async def _session(self, server_name: str, params: dict[str, Any], call: str) -> MCPSession:
        running = self._sessions.get(server_name)
        if running is not None and running[0].alive and running[1] == params:
            return running[0]
        lock = self._starting.setdefault(server_name, asyncio.Lock())
        async with lock:
            running = self._sessions.get(server_name)
            if running is not None:
                if running[0].alive and running[1] == params:
                    return running[0]
                del self._sessions[server_name]
                await running[0].close()
            try:
                resolved = resolve_params(params)
            except ServerParamsError as exc:
                # Parameters from a request are the client's mistake; registered ones the application's.
                status = 400 if self.trust_all_clients else 500
                raise _ToolCallError(status, "failed", f"Tool call {call} failed: {exc}") from exc
            confinement = self._confinement
            if isinstance(resolved, StdioParams) and confinement.writable:
                try:
                    resolved = confine(server_name, resolved, confinement.writable, confinement.readonly)
                except ServerParamsError as exc:
                    raise _ToolCallError(403, "failed", f"Tool call {call} failed: {exc}") from exc
            session = MCPSession(
                server_name, resolved, self.connect_timeout, self.max_result_size + _ENVELOPE_ALLOWANCE
            )
            await (
                session.start()
                if self.tracing is None
                else self.tracing.server_start(server_name, session.start())
            )
            self._sessions[server_name] = (session, params)
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


def _least_size(content: list[ContentBlock]) -> int:
    """A lower bound of the content's size as JSON: its texts and base64 data alone."""
    size = 0
    for block in content:
        if isinstance(block, TextContent):
            size += len(block.text)
        elif isinstance(block, ImageContent | AudioContent):
            size += len(block.data)
        elif isinstance(block, EmbeddedResource):
            resource = block.resource
            size += len(resource.text if isinstance(resource, TextResourceContents) else resource.blob)
    return size
