"""The kernel's side of the tool server's protocol, without I/O: what to send, and what an answer means.

One `ToolCalls` per ``ToolRunner`` writes the requests (``/run``, ``/approve``, ``/shell``,
``/reset``) from the wire contract (``ipybox._wire``), walks each request through its steps
(`ToolCalls.exchange`) and turns the answer into the tool's result or a `ToolRunnerError` of
the right outcome kind. A shell (``kernel/_io.py``: one on a plain socket, one on asyncio
streams) does each step it is asked for and hands back what came of it, a value or an
exception. Which failures send a request again, when a request counts as sent, and what a
timeout, an interrupt or a cancellation does to the connection is decided here, once for both.
Standard library only.
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Callable, Generator
from functools import partial
from typing import Any, get_args

from ipybox._wire import AnswerFields, RunFields, ShellFields, ToolServerPaths, run_head
from ipybox.errors import ToolCallOutcome, ToolRunnerError
from ipybox.kernel._content import ToolContent, from_json
from ipybox.kernel._http import (
    ConnectionClosed,
    HttpLimits,
    ProtocolError,
    Response,
    ResponseReader,
    request_head,
)

__all__ = ["Exchange", "Step", "Steps", "ToolCalls", "proxy_address"]


class Step(enum.Enum):
    """What an exchange asks of its shell, besides sending and receiving.

    An exchange yields a `Step`; or bytes: send them, all of them; or an ``int``: receive the
    next bytes the tool server sent, as many as have arrived (``b""`` once it closed the
    connection). The ``int`` is how many bytes the answer is known to still have (0 while
    unknown): a shell may wait for all of them at once.
    """

    ACQUIRE = "acquire"
    """A connection to the tool server: the exchange's own or a kept one, if still open (answer ``True``), else a new one (``False``)."""
    DROP = "drop"
    """The connection cannot serve another request: close it now, whatever it still holds."""


Exchange = Generator[Step | bytes | int, Any, Response]
"""One request's steps; it returns the response (the shell keeps the connection if it allows)."""

# Module globals: a member looked up on the enum class costs more, on every step of every call.
_ACQUIRE, _DROP = Step.ACQUIRE, Step.DROP


class Steps:
    """Walks a shell through an exchange: the next step it asks for, given what came of the last.

    Example:
        ```python
        steps = Steps(exchange)
        while (step := steps.next()) is not None:
            try:
                steps.value = do(step)
            except BaseException as exc:  # the exchange decides what it means
                steps.error = exc
        response = steps.response
        ```
    """

    __slots__ = ("_exchange", "error", "response", "value")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self.value: Any = None
        """What came of the last step, handed to the exchange."""
        self.error: BaseException | None = None
        """What the last step raised instead, thrown into the exchange."""
        self.response: Response | None = None
        """The response, once the exchange has ended."""

    def next(self) -> Step | bytes | int | None:
        """The next step, or ``None`` once the exchange has its response.

        Raises:
            ToolRunnerError: The request failed (what else the exchange raises goes on too).
        """
        __tracebackhide__ = True
        error = self.error
        try:
            if error is None:
                return self._exchange.send(self.value)
            self.error = None
            return self._exchange.throw(error)
        except StopIteration as done:
            self.response = done.value
            return None


# Where an exchange stopped, for what its error says (reconnect: asking again for a connection,
# holding one that may be dropped).
_CONNECT, _RECONNECT, _SEND, _RECEIVE = "connect", "reconnect", "send", "receive"
# What a connection the other side closed raises on a send or a receive.
_GONE = BrokenPipeError | ConnectionResetError

_KINDS: frozenset[str] = frozenset(get_args(ToolCallOutcome))
# The parts of a ``/run`` body after the tool name, written once.
_ARGS_KEY = f', "{RunFields.TOOL_ARGS}": '
_CONTENT_TAIL = f', "{RunFields.CONTENT}": true}}'
# The tool names whose start of a body is kept (a runner calls a few tools, many times each).
_MAX_STARTS = 256


class ToolCalls:
    """Requests to one tool server for one MCP server, and what their answers mean (no I/O).

    Args:
        server_name: Name of the MCP server.
        server_params: Its parameters, for a tool server in trusted local use; empty for a
            secured tool server.
        host: Hostname of the tool server.
        port: Port of the tool server.
        token: The tool server's bearer token, or ``None``.
        proxy: An ``http://host:port`` proxy the requests go through, or ``None``.
        socket_path: A Unix socket the tool server listens on, or ``None``.
        connect_timeout: Seconds a connection may take (for the error message).
        read_timeout: Seconds an answer may take (for the error message).
        limits: What a response may hold at most.
    """

    def __init__(
        self,
        server_name: str,
        server_params: dict[str, Any],
        host: str,
        port: int,
        *,
        token: str | None,
        proxy: str | None,
        socket_path: str | None,
        connect_timeout: float,
        read_timeout: float,
        limits: HttpLimits | None = None,
    ) -> None:
        self.server_name = server_name
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.limits = limits or HttpLimits()
        self._target = f"http://{host}:{port}" if proxy and not socket_path else ""
        self._headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._heads: dict[str, bytes] = {}
        # The ``/run`` body up to the tool name, encoded once.
        head = run_head(server_name, server_params)
        self._body_head = json.dumps(head)[:-1] + f', "{RunFields.TOOL_NAME}": '
        # The body up to the arguments, for each tool name called.
        self._starts: dict[str, str] = {}

    def run(self, tool_name: str, tool_args: dict[str, Any], content: bool = False) -> Exchange:
        """The steps of a ``/run`` request (``content``: the answer carries every content part)."""
        return self.exchange(
            partial(self._tool_request, ToolServerPaths.RUN, tool_name, tool_args, content), tool_name
        )

    def approve(self, tool_name: str, tool_args: dict[str, Any]) -> Exchange:
        """The steps of an ``/approve`` request."""
        return self.exchange(
            partial(self._tool_request, ToolServerPaths.APPROVE, tool_name, tool_args, False), tool_name
        )

    def _tool_request(self, path: str, tool_name: str, tool_args: dict[str, Any], content: bool) -> bytes:
        __tracebackhide__ = True  # IPython leaves ipybox's own frames out of the agent's traceback
        return self.request("POST", path, self.body(tool_name, tool_args, content))

    def shell(self, kind: str, cmd: str, cwd: str, argv: list[str] | None) -> Exchange:
        """The steps of a ``/shell`` request."""
        fields: dict[str, Any] = {ShellFields.KIND: kind, ShellFields.CMD: cmd, ShellFields.CWD: cwd}
        if argv is not None:
            fields[ShellFields.ARGV] = argv
        return self.exchange(
            lambda: self.request("POST", ToolServerPaths.SHELL, json.dumps(fields).encode()), kind
        )

    def reset(self) -> Exchange:
        """The steps of a ``/reset`` request."""
        return self.exchange(lambda: self.request("PUT", ToolServerPaths.RESET, b""), "")

    def body(self, tool_name: str, tool_args: dict[str, Any], content: bool = False) -> bytes:
        """The JSON body of a ``/run`` (or ``/approve``) request.

        Raises:
            ToolRunnerError: The arguments cannot be sent as JSON.
        """
        __tracebackhide__ = True
        try:
            args = _encode(tool_args)
        except (TypeError, ValueError) as exc:
            raise ToolRunnerError(
                f"Tool call {self.server_name}.{tool_name} failed: its arguments cannot be sent as JSON ({exc}).",
                "failed",
                self.server_name,
                tool_name,
            ) from exc
        start = self._starts.get(tool_name)
        if start is None:
            start = f"{self._body_head}{json.dumps(tool_name)}{_ARGS_KEY}"
            if len(self._starts) < _MAX_STARTS:
                self._starts[tool_name] = start
        return f"{start}{args}{_CONTENT_TAIL if content else '}'}".encode()

    def request(self, method: str, path: str, body: bytes) -> bytes:
        """The bytes of a request with `body`."""
        key = method + path
        head = self._heads.get(key)
        if head is None:
            host = f"{self.host}:{self.port}"
            head = self._heads[key] = request_head(method, self._target + path, host, self._headers)
        return head + str(len(body)).encode() + b"\r\n\r\n" + body

    def exchange(self, build: Callable[[], bytes], tool_name: str) -> Exchange:
        """The steps of one request: get a connection, send the request `build` makes, read the answer.

        The request is made once there is a connection: calls gathered in the kernel all ask for
        theirs before any encodes its arguments (a large body takes a while), so encoding one
        does not count against another's ``connect_timeout``. Meanwhile the connection sits
        unused, and the tool server closes one whose request head has not come within its head
        timeout, as it closes an idle kept one: once the request is made, the shell is asked for
        a connection again (the same one if it is still open). A request whose send fails on a
        connection that waited so (the tool server closed it just then) is sent once more, on a
        new connection. Once a request is sent, it is never sent again (a tool call runs at most
        once). Whatever stops an exchange after it has a connection, an interrupt or a
        cancellation too, has the shell drop that connection.
        """
        __tracebackhide__ = True
        request: bytes | None = None
        for attempt in (1, 2):
            stage = _CONNECT
            try:
                reused = yield _ACQUIRE
                stage = _SEND
                if request is None:
                    request = build()
                    stage = _RECONNECT
                    reused = yield _ACQUIRE
                    stage = _SEND
                yield request
                stage = _RECEIVE
                reader = ResponseReader(self.limits)
                while (response := reader.feed((yield reader.wanted))) is None:
                    pass
                return response
            except BaseException as exc:  # broad: an interrupt or cancellation must drop the connection too
                if isinstance(exc, GeneratorExit):  # the exchange was closed: no step can be asked for
                    raise
                if stage != _CONNECT:
                    yield _DROP
                if stage == _SEND and reused and attempt == 1 and isinstance(exc, _GONE):
                    continue  # a connection that waited closed just now: the request did not get through
                error = self._failure(tool_name, exc, stage)
                if error is None:
                    raise  # an interrupt, a cancellation or arguments that are not JSON go on as they are
                raise error from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _failure(self, tool_name: str, exc: BaseException, stage: str) -> ToolRunnerError | None:
        """The error a request that `exc` stopped at `stage` fails with, or ``None`` to let `exc` go on."""
        if stage == _RECEIVE and isinstance(exc, _GONE | ConnectionClosed | ProtocolError):
            # The request was sent and may have run: a tool call runs at most once.
            cause = (
                str(exc)  # what is wrong with the answer: "the tool server's answer has ..."
                if isinstance(exc, ProtocolError)
                else f"the tool server at {self.host}:{self.port} closed the connection after the request "
                f"was sent ({exc})"
            )
            return ToolRunnerError(
                f"{self._what(tool_name)} failed: {cause}; it may or may not have run, so it was not sent "
                "again. Check its effect before calling it again.",
                "failed",
                self.server_name,
                tool_name,
            )
        if stage == _RECEIVE and isinstance(exc, TimeoutError):
            return ToolRunnerError(
                f"{self._what(tool_name)} failed: the tool server did not answer within {self.read_timeout:g} s.",
                "failed",
                self.server_name,
                tool_name,
            )
        if stage in (_CONNECT, _RECONNECT) and isinstance(exc, TimeoutError):
            return self._unreachable(
                tool_name, TimeoutError(f"no connection within {self.connect_timeout:g} s")
            )
        if isinstance(exc, OSError):
            return self._unreachable(tool_name, exc)
        return None

    def result(self, response: Response, tool_name: str) -> dict[str, Any] | str | None:
        """The tool's result in an answer to ``/run``.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed.
        """
        __tracebackhide__ = True
        if response.status == 200:
            try:
                result: dict[str, Any] | str | None = _decode(response.body.decode())[AnswerFields.RESULT]
            except (ValueError, KeyError, TypeError) as exc:
                raise self._invalid(response, tool_name, exc) from exc
            return result
        raise self.error(response, tool_name)

    def content(self, response: Response, tool_name: str) -> ToolContent:
        """Every content part, and the structured content, in an answer to ``/run``.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed.
        """
        __tracebackhide__ = True
        if response.status == 200:
            try:
                answer = _decode(response.body.decode())
                return from_json(answer[AnswerFields.CONTENT], answer.get(AnswerFields.STRUCTURED))
            except (ValueError, KeyError, TypeError) as exc:
                raise self._invalid(response, tool_name, exc) from exc
        raise self.error(response, tool_name)

    def shell_result(self, response: Response, kind: str) -> dict[str, Any]:
        """The answer to ``/shell``: what the command wrote and how it ended.

        Raises:
            ToolRunnerError: The command was rejected, expired or could not run.
        """
        __tracebackhide__ = True
        self.check(response, kind)
        try:
            result = _decode(response.body.decode())
            if not isinstance(result, dict):
                raise TypeError("not a JSON object")
        except (ValueError, TypeError) as exc:
            raise self._invalid(response, kind, exc) from exc
        return result

    def check(self, response: Response, tool_name: str) -> None:
        """Raise the error of an answer that is not a success.

        Raises:
            ToolRunnerError: The request was rejected, expired or failed.
        """
        __tracebackhide__ = True
        if response.status != 200:
            raise self.error(response, tool_name)

    def error(self, response: Response, tool_name: str) -> ToolRunnerError:
        """The error an answer other than 200 stands for, with the outcome kind it names."""
        try:
            answer = _decode(response.body.decode())
        except ValueError:
            answer = None
        return self.error_of(response.status, answer, response.body, tool_name)

    def error_of(self, status: int, answer: Any, raw: bytes, tool_name: str) -> ToolRunnerError:
        """The error of an answer with `status` other than 200, decoded (`raw`: its text, for a message)."""
        kind: ToolCallOutcome = "failed"
        try:
            error = answer[AnswerFields.ERROR]
            message = str(error[AnswerFields.MESSAGE])
            if error.get(AnswerFields.KIND) in _KINDS:
                kind = error[AnswerFields.KIND]
        except (KeyError, TypeError, AttributeError):
            text = raw[:500].decode("utf-8", "replace")
            message = f"{self._what(tool_name)} failed: the tool server answered HTTP {status}: {text}"
        return ToolRunnerError(message, kind, self.server_name, tool_name)

    def answered(self, status: int, answer: Any, tool_name: str, content: bool) -> Any:
        """The tool's result (`content`: every content part) in a decoded answer, as `result` and `content` give.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed.
        """
        __tracebackhide__ = True
        if status != 200:
            raise self.error_of(status, answer, json.dumps(answer).encode(), tool_name)
        try:
            if content:
                return from_json(answer[AnswerFields.CONTENT], answer.get(AnswerFields.STRUCTURED))
            return answer[AnswerFields.RESULT]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ToolRunnerError(
                f"{self._what(tool_name)} failed: the application's answer is not valid ({exc}).",
                "failed",
                self.server_name,
                tool_name,
            ) from exc

    def unanswered(self, tool_name: str, why: str) -> ToolRunnerError:
        """The error of a call that could not be sent or answered over the kernel's stdin channel."""
        return ToolRunnerError(
            f"{self._what(tool_name)} failed: {why}.", "failed", self.server_name, tool_name
        )

    def _invalid(self, response: Response, tool_name: str, exc: Exception) -> ToolRunnerError:
        return ToolRunnerError(
            f"{self._what(tool_name)} failed: the tool server's answer is not valid ({exc}; {response.body[:200]!r}).",
            "failed",
            self.server_name,
            tool_name,
        )

    def _unreachable(self, tool_name: str, exc: BaseException) -> ToolRunnerError:
        return ToolRunnerError(
            f"{self._what(tool_name)} failed: the tool server at {self.host}:{self.port} could not be reached "
            f"({exc!r}).",
            "failed",
            self.server_name,
            tool_name,
        )

    def _what(self, tool_name: str) -> str:
        return f"Tool call {self.server_name}.{tool_name}" if tool_name else "Resetting the tool server"


def proxy_address(proxy: str) -> tuple[str, int]:
    """The ``(host, port)`` of an ``http://`` proxy URL.

    Raises:
        ValueError: `proxy` is not an ``http://`` URL.
    """
    if not proxy.startswith("http://"):
        raise ValueError(f"Only http:// proxies can reach the tool server, not {proxy!r}.")
    netloc = proxy.removeprefix("http://").split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = netloc.rpartition(":") if netloc.rpartition(":")[2].isdigit() else (netloc, "", "80")
    return host.strip("[]"), int(port)


def _to_json(value: Any) -> Any:
    """JSON form of argument values ``json`` does not know (checked only for loaded modules)."""
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):
        return model_dump(mode="json")
    modules = sys.modules
    datetime = modules.get("datetime")
    if datetime is not None and isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    uuid = modules.get("uuid")
    if uuid is not None and isinstance(value, uuid.UUID):
        return str(value)
    decimal = modules.get("decimal")
    if decimal is not None and isinstance(value, decimal.Decimal):
        return str(value)
    pathlib = modules.get("pathlib")
    if pathlib is not None and isinstance(value, pathlib.PurePath):
        return str(value)
    enum_module = modules.get("enum")
    if enum_module is not None and isinstance(value, enum_module.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# One encoder for every call (``json.dumps(..., default=...)`` makes a new one each time).
_encode = json.JSONEncoder(default=_to_json).encode
# The tool server answers in UTF-8 (``json.loads`` of bytes would first guess the encoding).
_decode = json.JSONDecoder().decode
