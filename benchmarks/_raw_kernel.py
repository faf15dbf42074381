"""A bare client of one kernel on an existing gateway, for benchmarks/remote_channel.py only.

It speaks the gateway's plain JSON WebSocket protocol (no ``v1.kernel.websocket.jupyter.org``
subprotocol, which Enterprise Gateway 3.3's Jupyter Server 1 lacks) and answers nothing on the
kernel's stdin channel: the benchmark subclasses it to answer comm messages. ipybox's own client is
``ipybox.app.kernels._client.KernelClient``; its tool calls over stdin are measured by
benchmarks/stdin_channel.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

import httpx2
import websockets
from websockets.asyncio.client import ClientConnection

from ipybox.errors import ExecutionError, KernelConnectionError

__all__ = ["RemoteKernel"]

_MAX_FRAME = 16 * 1024 * 1024
_PROTOCOL_VERSION = "5.3"


class RemoteKernel:
    """One kernel on an existing gateway.

    Args:
        url: The gateway's base URL, e.g. ``http://host:8888``.
        token: The gateway's auth token, if it has one.
        kernel_name: The kernel spec to start (the gateway's default when None).
    """

    def __init__(self, url: str, token: str | None = None, kernel_name: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.kernel_name = kernel_name
        self._headers = {"Authorization": f"token {token}"} if token else {}
        self._session = uuid.uuid4().hex
        self._kernel_id: str | None = None
        self._http: httpx2.AsyncClient | None = None
        self._ws: ClientConnection | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Queue[dict[str, Any]]] = {}

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
        if self._receiver is not None:
            self._receiver.cancel()
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
            "allow_stdin": False,
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
        parent = msg.get("parent_header")
        msg_id = parent.get("msg_id") if isinstance(parent, dict) else None
        queue = self._pending.get(msg_id) if isinstance(msg_id, str) else None
        if queue is not None:
            queue.put_nowait(msg)

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
