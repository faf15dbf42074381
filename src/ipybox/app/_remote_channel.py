"""Tool calls from a kernel on another host, answered over the gateway's WebSocket (prototype).

The application side of ``ipybox.kernel._remote_channel``: `RemoteKernel` runs cells on one kernel
of an existing gateway (Jupyter Kernel Gateway 3 or Enterprise Gateway 3.3) with ``allow_stdin``, and
answers each ``input_request`` on the kernel's stdin channel. A request is only ever taken from the
stdin channel of this kernel's own WebSocket: the gateway routes it there, so the kernel it comes
from is known from the connection, never from the message. Everything in the message is written by
code in the kernel, which is hostile: the request is parsed strictly (four fields, capped size) and
handed to the application's `RemoteToolHandler`, which must apply the registry and approval exactly
as the tool server does to ``POST /run``. Nothing in a request can approve a call.

It speaks the gateway's plain JSON WebSocket protocol (no ``v1.kernel.websocket.jupyter.org``
subprotocol), which Enterprise Gateway 3.3's Jupyter Server 1 understands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Protocol, Self

import httpx2
import websockets
from websockets.asyncio.client import ClientConnection

from ipybox.errors import ExecutionError, KernelConnectionError, ToolRunnerError
from ipybox.kernel._remote_channel import MAX_MESSAGE_CHARS, PROMPT_PREFIX, REQUEST_FIELDS

__all__ = ["RemoteKernel", "RemoteToolCall", "RemoteToolHandler"]

_MAX_FRAME = 16 * 1024 * 1024
_PROTOCOL_VERSION = "5.3"
# Stdin requests of one kernel waiting for an answer at once (ipykernel itself has one at a time).
_MAX_WAITING = 4


@dataclass(frozen=True)
class RemoteToolCall:
    """A tool call asked for by code in a remote kernel (every field but `kernel_id` is hostile input).

    Attributes:
        kernel_id: The kernel the request came from, known from the WebSocket it arrived on.
        server_name: The MCP server the kernel names (look it up in the trusted registry).
        tool_name: The tool the kernel names.
        tool_args: The arguments, as a JSON object.
    """

    kernel_id: str
    server_name: str
    tool_name: str
    tool_args: dict[str, Any]


class RemoteToolHandler(Protocol):
    """Runs a tool call from a remote kernel, after the application's approval; returns JSON data."""

    async def __call__(self, call: RemoteToolCall) -> Any:
        """Run `call` and return its result.

        Raises:
            ToolRunnerError: The call was rejected, expired or failed; its message reaches the kernel.
        """
        ...


class RemoteKernel:
    """One kernel on an existing gateway, whose tool calls the application answers.

    Args:
        url: The gateway's base URL, e.g. ``http://host:8888``.
        token: The gateway's auth token, if it has one.
        handler: Runs each tool call the kernel asks for.
        kernel_name: The kernel spec to start (the gateway's default when None).
    """

    def __init__(
        self, url: str, handler: RemoteToolHandler, token: str | None = None, kernel_name: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.handler = handler
        self.kernel_name = kernel_name
        self._headers = {"Authorization": f"token {token}"} if token else {}
        self._session = uuid.uuid4().hex
        self._kernel_id: str | None = None
        self._http: httpx2.AsyncClient | None = None
        self._ws: ClientConnection | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[None]] = set()
        self._pending: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        # ipykernel waits for one reply at a time, so one answer at a time is enough, and a cell
        # that floods requests cannot make the application run more than one call at once.
        self._answering = asyncio.Lock()

    @property
    def kernel_id(self) -> str:
        """The kernel's id on the gateway.

        Raises:
            KernelConnectionError: The kernel is not started.
        """
        if self._kernel_id is None:
            raise KernelConnectionError("The remote kernel is not started; call start() first.")
        return self._kernel_id

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start a kernel on the gateway and open its channels.

        Raises:
            KernelConnectionError: The gateway refused or could not be reached.
        """
        http = httpx2.AsyncClient(
            base_url=self.url, headers=self._headers, timeout=httpx2.Timeout(60.0, connect=5.0)
        )
        try:
            body = {"name": self.kernel_name} if self.kernel_name else {}
            response = await http.post("/api/kernels", json=body)
            if response.status_code != 201:
                raise KernelConnectionError(
                    f"The gateway at {self.url} refused to start a kernel (HTTP {response.status_code}): "
                    f"{response.text[:500]}"
                )
            kernel_id = str(response.json()["id"])
            ws_url = self.url.replace("http", "ws", 1)
            self._ws = await websockets.connect(
                f"{ws_url}/api/kernels/{kernel_id}/channels?session_id={self._session}",
                additional_headers=self._headers,
                max_size=_MAX_FRAME,
                compression=None,
                open_timeout=60,
            )
        except (httpx2.HTTPError, OSError, websockets.WebSocketException) as exc:
            await http.aclose()
            raise KernelConnectionError(f"The gateway at {self.url} could not be reached: {exc}") from exc
        self._http, self._kernel_id = http, kernel_id
        self._receiver = asyncio.create_task(self._receive(self._ws))

    async def stop(self) -> None:
        """Close the channels and shut the kernel down."""
        for task in (self._receiver, *self._answers):
            if task is not None:
                task.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            with contextlib.suppress(httpx2.HTTPError):
                await self._http.delete(f"/api/kernels/{self._kernel_id}")
            await self._http.aclose()
        self._ws = self._http = self._receiver = self._kernel_id = None

    async def execute(self, code: str, timeout: float = 120) -> str:
        """Run `code` and return its printed output, answering its tool calls meanwhile.

        Raises:
            ExecutionError: The code raised.
            TimeoutError: It did not finish within `timeout` seconds.
        """
        if self._ws is None:
            raise KernelConnectionError("The remote kernel is not started; call start() first.")
        msg_id = uuid.uuid4().hex
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._pending[msg_id] = queue
        content = {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": True,
            "stop_on_error": True,
        }
        try:
            await self._ws.send(json.dumps(self._message("execute_request", "shell", content, {}, msg_id)))
            async with asyncio.timeout(timeout):
                return await self._collect(queue)
        finally:
            del self._pending[msg_id]

    async def _collect(self, queue: asyncio.Queue[dict[str, Any]]) -> str:
        text: list[str] = []
        error: dict[str, Any] | None = None
        idle = replied = False
        while not (idle and replied):
            msg = await queue.get()
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and isinstance(content.get("text"), str):
                text.append(content["text"])
            elif kind == "error":
                error = content
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
            elif kind == "execute_reply":
                replied = True
        if error is not None:
            raise ExecutionError(
                f"{error['ename']}: {error['evalue']}",
                ename=error["ename"],
                evalue=error["evalue"],
                traceback="\n".join(error["traceback"]),
            )
        return "".join(text)

    async def _receive(self, ws: ClientConnection) -> None:
        async for frame in ws:
            # The gateway relays what the kernel wrote: a message of another shape is dropped, never
            # allowed to end the receiver (every later cell of this kernel would wait for nothing).
            try:
                msg = json.loads(frame)
            except (ValueError, RecursionError):
                continue
            if isinstance(msg, dict) and isinstance(msg.get("content"), dict):
                await self._dispatch(ws, msg)

    async def _dispatch(self, ws: ClientConnection, msg: dict[str, Any]) -> None:
        if msg.get("channel") == "stdin" and msg.get("msg_type") == "input_request":
            if len(self._answers) >= _MAX_WAITING:
                # ipykernel sends one request and waits for its reply; more are code in the kernel
                # sending its own, each holding up to a frame here: dropped, unanswered.
                return
            task = asyncio.create_task(self._answer(ws, msg))
            self._answers.add(task)
            task.add_done_callback(self._answers.discard)
            return
        parent = msg.get("parent_header")
        msg_id = parent.get("msg_id") if isinstance(parent, dict) else None
        queue = self._pending.get(msg_id) if isinstance(msg_id, str) else None
        if queue is not None:
            queue.put_nowait(msg)

    async def _answer(self, ws: ClientConnection, request: dict[str, Any]) -> None:
        prompt = request["content"].get("prompt", "")
        async with self._answering:
            # A plain input() gets an empty line: nobody sits at a remote kernel's stdin.
            is_call = isinstance(prompt, str) and prompt.startswith(PROMPT_PREFIX)
            value = await self._tool_reply(prompt) if is_call else ""
            content = {"status": "ok", "value": value}
            reply = self._message("input_reply", "stdin", content, request.get("header", {}))
            await ws.send(json.dumps(reply))

    async def _tool_reply(self, prompt: str) -> str:
        request_id: Any = None
        try:
            fields = parse_request(prompt)
            request_id = fields["id"]
            call = RemoteToolCall(
                self.kernel_id, fields["server_name"], fields["tool_name"], fields["tool_args"]
            )
            result = await self.handler(call)
            answer = json.dumps({"id": request_id, "result": result})
        except ToolRunnerError as exc:
            return json.dumps({"id": request_id, "error": str(exc), "kind": exc.kind})
        except ValueError as exc:
            return json.dumps({"id": request_id, "error": str(exc), "kind": "failed"})
        if len(answer) > MAX_MESSAGE_CHARS:
            return json.dumps(
                {"id": request_id, "error": "The tool's result is too large to send.", "kind": "failed"}
            )
        return answer

    def _message(
        self, msg_type: str, channel: str, content: dict[str, Any], parent: dict[str, Any], msg_id: str = ""
    ) -> dict[str, Any]:
        header = {
            "msg_id": msg_id or uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": self._session,
            "username": "ipybox",
            "date": datetime.now(UTC).isoformat(),
            "version": _PROTOCOL_VERSION,
        }
        return {
            "header": header,
            "parent_header": parent,
            "metadata": {},
            "content": content,
            "channel": channel,
            "buffers": [],
        }


def parse_request(prompt: str) -> dict[str, Any]:
    """The fields of a tool call request that code in the kernel wrote, checked strictly.

    Raises:
        ValueError: The request is too large, not JSON, has other fields than the four it may
            have, or a field of the wrong type.
    """
    body = prompt.removeprefix(PROMPT_PREFIX)
    if len(body) > MAX_MESSAGE_CHARS:
        raise ValueError(
            f"The tool call request is over {MAX_MESSAGE_CHARS} characters; pass large data as a file."
        )
    try:
        fields = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"The tool call request is not JSON: {exc}.") from None
    if not isinstance(fields, dict) or set(fields) != REQUEST_FIELDS:
        found = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise ValueError(f"A tool call request has exactly the fields {sorted(REQUEST_FIELDS)}, not {found}.")
    if not (
        isinstance(fields["id"], int)
        and isinstance(fields["server_name"], str)
        and isinstance(fields["tool_name"], str)
        and isinstance(fields["tool_args"], dict)
    ):
        raise ValueError(
            "A tool call request has an integer id, string server and tool names and an object of arguments."
        )
    return fields
