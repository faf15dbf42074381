"""The application's side of tool call approval: receives requests, passes each to a callback."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ipybox.errors import ApprovalConnectionError

__all__ = ["ApprovalCallback", "ApprovalClient", "ApprovalRequest"]

logger = logging.getLogger(__name__)


class ApprovalRequest:
    """A tool call waiting for the application's decision.

    Call :meth:`accept` or :meth:`reject` once; later calls are ignored. Without a decision
    the request expires after the tool server's approval timeout.

    Example:
        ```python
        async def on_approval_request(request: ApprovalRequest) -> None:
            if request.tool_name == "delete_everything":
                await request.reject()
            else:
                await request.accept()
        ```

    Args:
        server_name: The MCP server the tool belongs to.
        tool_name: The tool to call.
        tool_args: The arguments it would be called with.
        respond: Sends the decision (``True`` to accept) to the tool server.
    """

    __match_args__ = ("server_name", "tool_name", "tool_args")

    def __init__(
        self,
        server_name: str,
        tool_name: str,
        tool_args: dict[str, Any],
        respond: Callable[[bool], Awaitable[None]],
    ) -> None:
        self.server_name = server_name
        self.tool_name = tool_name
        self.tool_args = tool_args
        self._respond = respond
        self._decided = False

    async def accept(self) -> None:
        """Accept the tool call: it runs and the caller gets its result.

        Raises:
            ApprovalConnectionError: The connection to the tool server is gone.
        """
        await self._decide(True)

    async def reject(self) -> None:
        """Reject the tool call: the caller gets an error saying it was rejected.

        Raises:
            ApprovalConnectionError: The connection to the tool server is gone.
        """
        await self._decide(False)

    async def _decide(self, accepted: bool) -> None:
        if self._decided:
            return
        self._decided = True
        await self._respond(accepted)

    def __str__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in self.tool_args.items())
        return f"{self.server_name}.{self.tool_name}({args})"

    def __repr__(self) -> str:
        return (
            f"ApprovalRequest(server_name={self.server_name!r}, tool_name={self.tool_name!r}, "
            f"tool_args={self.tool_args!r})"
        )


class ApprovalCallback(Protocol):
    """Called with each approval request; it must eventually accept or reject it."""

    def __call__(self, request: ApprovalRequest, /) -> Awaitable[None]: ...


class ApprovalClient:
    """Connects to a tool server's approval channel and hands every request to a callback.

    Each request is handled in its own task, so a slow decision does not hold up others. A
    callback that raises rejects its request.

    Example:
        ```python
        async def on_approval_request(request: ApprovalRequest) -> None:
            print(f"Approval request: {request}")
            await request.accept()

        async with ApprovalClient(callback=on_approval_request, port=server.port):
            ...  # run code that calls MCP tools
        ```

    Args:
        callback: Async function called with each :class:`ApprovalRequest`.
        host: Hostname of the tool server.
        port: Port of the tool server.
        secret: The approval secret of a secured tool server, sent as a bearer token in the
            WebSocket handshake.
    """

    def __init__(
        self,
        callback: ApprovalCallback,
        host: str = "localhost",
        port: int = 8900,
        *,
        secret: str | None = None,
    ) -> None:
        self.callback = callback
        self.host = host
        self.port = port
        self._secret = secret
        self._websocket: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def connect(self) -> None:
        """Connect to the tool server's approval channel.

        Raises:
            RuntimeError: This client is already connected.
            ApprovalConnectionError: The tool server could not be reached, or it refused the connection
                (wrong secret, or another approval client is connected).
        """
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidHandshake, InvalidStatus

        if self._websocket is not None:
            raise RuntimeError("The approval client is already connected.")
        headers = {"Authorization": f"Bearer {self._secret}"} if self._secret is not None else None
        url = f"ws://{self.host}:{self.port}/approval"
        try:
            self._websocket = await connect(
                url, additional_headers=headers, open_timeout=10, compression=None
            )
        except InvalidStatus as exc:
            raise ApprovalConnectionError(
                f"The tool server at {self.host}:{self.port} refused the approval connection "
                f"(HTTP {exc.response.status_code}): the secret is wrong or missing, or another approval "
                "client is already connected."
            ) from exc
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise ApprovalConnectionError(
                f"Could not connect to the tool server's approval channel at {url}: {exc}"
            ) from exc
        self._reader = asyncio.create_task(self._read(self._websocket), name="approval-client-reader")

    async def disconnect(self) -> None:
        """Disconnect from the approval channel; requests not yet decided fail on the tool server."""
        websocket, self._websocket = self._websocket, None
        reader, self._reader = self._reader, None
        if websocket is not None:
            await websocket.close()
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        handlers, self._handlers = self._handlers, set()
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def __aenter__(self) -> ApprovalClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.disconnect()

    async def _read(self, websocket: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for message in websocket:
                request = self._parse(message, websocket)
                if request is not None:
                    handler = asyncio.create_task(self._handle(request))
                    self._handlers.add(handler)
                    handler.add_done_callback(self._handlers.discard)
        except ConnectionClosed:
            logger.debug("The approval channel was closed by the tool server.")

    def _parse(self, message: str | bytes, websocket: Any) -> ApprovalRequest | None:
        try:
            data = json.loads(message)
            if data.get("method") != "approve":
                raise ValueError(f"unknown method {data.get('method')!r}")
            request_id = data["id"]
            params = data["params"]
            server_name, tool_name = str(params["server_name"]), str(params["tool_name"])
            tool_args = params.get("tool_args") or {}
            if not isinstance(request_id, int) or not isinstance(tool_args, dict):
                raise ValueError("malformed id or tool_args")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("Ignored a malformed approval request: %s", exc)
            return None

        async def respond(accepted: bool) -> None:
            from websockets.exceptions import ConnectionClosed

            answer = json.dumps({"jsonrpc": "2.0", "id": request_id, "result": accepted})
            try:
                await websocket.send(answer)
            except ConnectionClosed as exc:
                raise ApprovalConnectionError(
                    "The connection to the tool server's approval channel is closed."
                ) from exc

        return ApprovalRequest(server_name, tool_name, tool_args, respond)

    async def _handle(self, request: ApprovalRequest) -> None:
        try:
            await self.callback(request)
        except Exception:
            logger.exception("The approval callback failed for %s; the request is rejected.", request)
            try:
                await request.reject()
            except ApprovalConnectionError:
                pass
