"""The tool server's endpoints for what the kernel runs itself: ``POST /approve`` and ``POST /shell``.

Application side only. `ShellRoutes` is a part of :class:`ipybox.app.tools._server.ToolServer`:
``/approve`` only has the decision chain decide a shell command the kernel runs (`approve_only`,
which the stdin channel's ask-only calls take too); ``/shell`` has it decided, then runs the
command with the confinement's ``shell_runner``, with the chain's permit, while the kernel stays
connected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from ipybox._wire import (
    ASK_ONLY_RULE,
    SHELL_SERVER_NAME,
    AnswerFields,
    ShellAnswerFields,
    ShellFields,
    asks_about_shell,
)
from ipybox.app.approval import Decision, DecisionChain, Permit, Refused
from ipybox.app.sandbox import (
    KernelConfinement,
    ShellProgramError,
    ShellRequest,
    ShellRunner,
    run_while_connected,
    shell_call,
)
from ipybox.app.tools._calls import _RunRequest
from ipybox.app.tools._http import (
    _UNAUTHORIZED,
    BodyReader,
    _Charge,
    _error,
    _error_response,
    _InflightBudget,
    _json,
    _summarise,
)

logger = logging.getLogger("ipybox.tool_exec.server")

# The model a request body is read as.
_Body = TypeVar("_Body", bound=BaseModel)


class ShellRoutes:
    """Serves ``POST /approve`` and ``POST /shell`` (the shell commands of a kernel).

    Args:
        chain: Decides each command; a command runs only with its permit.
        reader: Reads a request's body within the limits.
        inflight: The in-flight budget a request's body counts toward while it is read.
        authorized: Whether an ``Authorization`` header carries the tool server's token.
        confinement: The kernels' confinement as last given (its ``shell_runner`` runs ``/shell``).
    """

    def __init__(
        self,
        chain: DecisionChain,
        reader: BodyReader,
        inflight: _InflightBudget,
        authorized: Callable[[bytes], bool],
        confinement: Callable[[], KernelConfinement],
    ) -> None:
        self._chain = chain
        self._reader = reader
        self._inflight = inflight
        self._authorized = authorized
        self._confinement = confinement

    async def approve_endpoint(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization", "").encode()):
            return _error_response(401, "failed", _UNAUTHORIZED)
        charge = _Charge(self._inflight)
        try:
            return await self._approve_body(request, charge)
        finally:
            charge.release()

    async def _parsed_body(
        self, request: Request, charge: _Charge, model: type[_Body], what: str
    ) -> _Body | Response:
        """The request's body as `model`; else the answer to give (client gone, too large, malformed)."""
        raw = await self._reader.read(request.headers.get("content-length"), request.receive, charge)
        if raw is None:
            return Response(status_code=400)  # the client left; nobody reads this
        if isinstance(raw, tuple):
            status, content = raw
            return Response(content, status_code=status, media_type="application/json")
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            return _error_response(400, "failed", f"The {what} request is malformed: {_summarise(exc)}")

    async def _approve_body(self, request: Request, charge: _Charge) -> Response:
        body = await self._parsed_body(request, charge, _RunRequest, "approval")
        if isinstance(body, Response):
            return body
        status, content = await self.approve_only(body)
        return Response(content, status_code=status, media_type="application/json")

    async def approve_only(self, body: _RunRequest) -> tuple[int, bytes]:
        """Have the decision chain decide what the kernel runs itself; the answer's status and body.

        What ``POST /approve`` and an ask-only call over the kernel's stdin channel
        (``app/tools/_stdin_channel.py``) both answer with: nothing runs here, the kernel runs it once allowed.
        """
        if body.server_params:
            return _error(400, "failed", "An approval request cannot carry server_params.")
        if not asks_about_shell(body.server_name, body.tool_name) or body.content:
            # Nothing runs for it here: a tool's name would have the application asked about a
            # call that never runs (and "accept for the session" primed by it). Only kernel code
            # written by hand sends one: worth a line in the log.
            logger.warning(
                "Refused an approval-only request for %s.%s: it may ask about shell commands only.",
                body.server_name,
                body.tool_name,
            )
            return _error(400, "failed", f"Refused: {ASK_ONLY_RULE}; tool calls go to POST /run.")
        try:
            decision, _ = await self._decide(body, f"{body.server_name}.{body.tool_name}")
        except Refused as exc:
            return _error(exc.status, exc.kind, exc.message)
        decision.finish(200, b"", outcome="approved")  # the kernel runs it: no outcome is seen here
        return 200, _json({AnswerFields.RESULT: None})

    async def shell_endpoint(self, request: Request) -> Response:
        if not self._authorized(request.headers.get("authorization", "").encode()):
            return _error_response(401, "failed", _UNAUTHORIZED)
        # The body (a command line) counts toward the in-flight budget only while it is read.
        charge = _Charge(self._inflight)
        try:
            body = await self._parsed_body(request, charge, ShellRequest, "shell command")
        finally:
            charge.release()
        if isinstance(body, Response):
            return body
        runner = self._confinement().shell_runner
        if runner is None:
            return _error_response(
                400,
                "failed",
                "This tool server runs no shell commands: only a sandboxed kernel whose shell commands need "
                "approval sends them here (CodeExecutor(sandbox=True, approve_shell_cmds=True)).",
            )
        if body.kind == ShellFields.SHELL_MAGIC and not body.argv:
            return _error_response(400, "failed", "A shell_magic request needs argv, the program to run.")
        tool_args, argv = shell_call(body)
        try:
            runner.resolve(argv, body.cmd.encode() if body.kind == ShellFields.SHELL_MAGIC else None)
        except ShellProgramError as exc:  # refused before anyone is asked
            return _error_response(400, "failed", str(exc))
        approval = _RunRequest(server_name=SHELL_SERVER_NAME, tool_name=body.kind, tool_args=tool_args)
        try:
            decision, permit = await self._decide(approval, f"ipybox.{body.kind}")
        except Refused as exc:
            return _error_response(exc.status, exc.kind, exc.message)
        response: Response | None = None
        try:
            response = await self._run_shell(permit, runner, body, argv, request.receive)
            return response
        finally:
            decision.finish(*((response.status_code, bytes(response.body)) if response else (None, None)))

    async def _decide(self, approval: _RunRequest, call: str) -> tuple[Decision, Permit]:
        """Have the chain decide a shell command (or another ``/approve`` request); its decision and permit.

        Raises:
            Refused: The chain did not allow it (its record has the outcome already).
        """
        decision = self._chain.begin(approval.server_name, approval.tool_name, approval.tool_args, call)
        try:
            permit = await decision.permit(ask=True)
        except Refused as exc:
            decision.finish(exc.status, _error(exc.status, exc.kind, exc.message)[1])
            raise
        return decision, permit

    async def _run_shell(
        self, permit: Permit, runner: ShellRunner, body: ShellRequest, argv: list[str], receive: Receive
    ) -> Response:
        """Run the command the permit allows while the kernel stays connected."""
        if permit.tool_name != body.kind:
            return _error_response(403, "rejected", f"ipybox.{body.kind} has no permit.")
        running = await run_while_connected(runner, body, argv, receive)
        if running.cancelled():
            return Response(status_code=400)  # the client left; nobody reads this
        try:
            result = running.result()
        except ShellProgramError as exc:
            return _error_response(400, "failed", str(exc))
        except OSError as exc:
            return _error_response(502, "failed", f"The shell command could not be started: {exc}")
        return Response(
            _json(
                {
                    ShellAnswerFields.STDOUT: result.stdout.decode(errors="replace"),
                    ShellAnswerFields.STDERR: result.stderr.decode(errors="replace"),
                    ShellAnswerFields.EXIT_CODE: result.exit_code,
                    ShellAnswerFields.STOPPED: result.stopped,
                }
            ),
            media_type="application/json",
        )
