"""The tool calls of the tool server once a request is read: server, session, decision, call, answer.

Application side only. `ToolCalls` is the part of :class:`ipybox.app.tools._server.ToolServer`
that serves ``POST /run`` (and the stdin channel's tool calls): it finds the server's session
(`ServerSessions`), has the decision chain (`ipybox.app.approval._chain`) decide the call, runs it
with the permit the chain gave, and makes the answer within the size limits.
"""

from __future__ import annotations

from typing import Any

from mcp.types import (
    AudioContent,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    TextContent,
    TextResourceContents,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Receive

from ipybox._wire import AnswerFields
from ipybox.app.approval import Decision, DecisionChain, Permit, Refused
from ipybox.app.mcp_client import MCPSession
from ipybox.app.tools._http import BodyReader, _Charge, _error, _json, _size, _summarise
from ipybox.app.tools._options import CallSpans, Limits
from ipybox.app.tools._sessions import ServerSessions
from ipybox.errors import MCPServerError


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


class ToolCalls:
    """Runs the tool calls of ``POST /run`` and of the kernels' stdin channels.

    Args:
        chain: Decides each call; a call runs only with its permit.
        sessions: The MCP servers' sessions.
        limits: The size limits of requests and answers.
        reader: Reads a request's body within the limits.
        ask: Whether a call the rules do not decide is put to the application (else it runs unasked).
        tracing: Makes a span of each call; ``None``: no spans.
    """

    def __init__(
        self,
        chain: DecisionChain,
        sessions: ServerSessions,
        limits: Limits,
        reader: BodyReader,
        *,
        ask: bool,
        tracing: CallSpans | None,
    ) -> None:
        self._chain = chain
        self._sessions = sessions
        self.max_result_size = limits.max_result_size
        self._max_inflight_size = limits.max_inflight_size
        self._reader = reader
        self._ask = ask
        self._tracing = tracing

    async def run(self, length: bytes | None, receive: Receive, charge: _Charge) -> tuple[int, bytes] | None:
        """The answer to a ``/run`` request whose token was checked; ``None`` if the client left."""
        raw = await self._reader.read(length, receive, charge)
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

        Everything a call goes through is here, once: its span, the registry lookup, the check
        against the tool's schema, the decision chain, the call itself and the size limits. The
        caller has parsed the request and authenticated where it came from; `charge` holds the
        request's bytes of the in-flight budget and, on success, the answer's.

        Returns:
            The HTTP status and the JSON answer, as ``POST /run`` sends them.
        """
        if self._tracing is not None:
            return await self._tracing.tool_call(
                body.server_name, body.tool_name, self._handle_run(body, charge)
            )
        return await self._handle_run(body, charge)

    async def _handle_run(self, body: _RunRequest, charge: _Charge) -> tuple[int, bytes]:
        # Names are shown to people (questions, the audit trail, logs): refused before anything of
        # the call is decided or recorded when they are too long or hold what a terminal acts on.
        problem = name_problem("server_name", body.server_name) or name_problem("tool_name", body.tool_name)
        if problem is not None:
            return _error(400, "failed", problem)
        call = f"{body.server_name}.{body.tool_name}"
        decision = self._chain.begin(body.server_name, body.tool_name, body.tool_args, f"Tool call {call}")
        answer: tuple[int, bytes] | None = None
        try:
            answer = await self._call(body, charge, decision, call)
            return answer
        finally:
            decision.finish(*(answer or (None, None)))

    async def _call(
        self, body: _RunRequest, charge: _Charge, decision: Decision, call: str
    ) -> tuple[int, bytes]:
        sessions = self._sessions
        try:
            params = sessions.params(body.server_name, body.server_params, call)
            session = await sessions.session(body.server_name, params, call)
            annotations = None
            # What the person is asked about (or the rules read) must be a call the server can take as shown.
            if self._ask or self._chain.checks_calls:
                tool = await sessions.check(session, body.server_name, body.tool_name, body.tool_args, call)
                annotations = tool.annotations
            permit = await decision.permit(
                ask=self._ask, annotations=annotations, secrets=session.params.secrets
            )
            result = await self._execute(permit, session, body)
        except Refused as exc:
            return _error(exc.status, exc.kind, exc.message)
        except MCPServerError as exc:
            return _error(502, "failed", f"Tool call {call} failed: {exc}")
        return self._answer(body, result, charge, call)

    async def _execute(self, permit: Permit, session: MCPSession, body: _RunRequest) -> CallToolResult:
        """Call the tool the permit allows."""
        if (permit.server_name, permit.tool_name) != (body.server_name, body.tool_name):
            raise Refused(403, "rejected", f"Tool call {body.server_name}.{body.tool_name} has no permit.")
        result = await session.call_tool_content(body.tool_name, body.tool_args)
        body.tool_args = {}  # no longer needed: not held while the answer is made
        return result

    def _answer(
        self, body: _RunRequest, result: CallToolResult, charge: _Charge, call: str
    ) -> tuple[int, bytes]:
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
                f"limit of {_size(self._max_inflight_size)} for the requests and answers of all calls in flight "
                "(ToolServer max_inflight_size) while other calls held it; make fewer large calls at once, "
                "or ask the tool for less at a time.",
            )
        return 200, answer

    def _too_large(self, call: str, size: int, qualifier: str = "") -> tuple[int, bytes]:
        return _error(
            502,
            "failed",
            f"Tool call {call} failed: its result is {qualifier}{_size(size)}, over the tool server's limit "
            f"of {_size(self.max_result_size)} per result (ToolServer max_result_size); ask the tool for "
            "less at a time (a smaller page, image or file).",
        )


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
