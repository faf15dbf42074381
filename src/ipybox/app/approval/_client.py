"""The application's side of tool call approval: receives requests, passes each to a callback."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ipybox.errors import ApprovalConnectionError, ApprovalDecisionError, ApprovalError

__all__ = ["ApprovalCallback", "ApprovalClient", "ApprovalRequest", "abandon", "decide_for"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.tool_exec.approval.client")


class ApprovalRequest:
    """A tool call waiting for the application's decision.

    Call `accept` or `reject` once. A decision that does not take effect raises
    `ApprovalDecisionError`: a second decision, and one for a request that is no longer waiting
    (it expired after the tool server's approval timeout, or the code that made the call is
    gone). ``str()`` and ``repr()`` show every name and value escaped, so what is printed is
    what runs.

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
        respond: Sends the decision (``True`` to accept) to the tool server and returns whether
            it took effect.
    """

    __match_args__ = ("server_name", "tool_name", "tool_args")

    def __init__(
        self,
        server_name: str,
        tool_name: str,
        tool_args: dict[str, Any],
        respond: Callable[..., Awaitable[bool]],
    ) -> None:
        self.server_name = server_name
        self.tool_name = tool_name
        self.tool_args = tool_args
        self._respond = respond
        self._decision: bool | None = None

    @property
    def decided(self) -> bool:
        """Whether `accept` or `reject` was called."""
        return self._decision is not None

    async def accept(self, *, remember: bool = False) -> None:
        """Accept the tool call: it runs and the caller gets its result.

        Args:
            remember: Also allow this tool (a shell command: its programs) for the rest of the
                session: later calls the executor's policy would ask about run unasked. A policy's
                ``deny`` still refuses them.

        Raises:
            ApprovalDecisionError: The request was already decided, or it is no longer waiting
                (it expired, or the call was withdrawn); the call does not run.
            ApprovalConnectionError: The connection to the tool server is gone.
        """
        await self._decide(True, remember=remember)

    async def reject(self) -> None:
        """Reject the tool call: the caller gets an error saying it was rejected.

        Raises:
            ApprovalDecisionError: The request was already decided (after `accept` the call
                runs regardless), or it is no longer waiting.
            ApprovalConnectionError: The connection to the tool server is gone.
        """
        await self._decide(False)

    async def _abandon(self) -> None:
        """Reject because nobody is left to decide (the audit trail records it as abandoned)."""
        await self._decide(False, abandoned=True)

    async def _decide_as(self, accepted: bool, by: str) -> None:
        """Accept or reject on behalf of `by` (an `ipybox.app.approval._server.Decider` value), which
        the audit trail records and the caller's error names instead of the application."""
        await self._decide(accepted, by=by)

    async def _decide(
        self, accepted: bool, *, remember: bool = False, abandoned: bool = False, by: str | None = None
    ) -> None:
        if self._decision is not None:
            earlier = "accepted" if self._decision else "rejected"
            effect = "the call runs" if self._decision else "the call does not run"
            raise ApprovalDecisionError(
                f"The tool call {self._call()} was already {earlier} ({effect}); a request is decided once."
            )
        self._decision = accepted
        extra: dict[str, Any] = {"remember": True} if remember else {"abandoned": True} if abandoned else {}
        if by is not None:
            extra["by"] = by
        if not await self._respond(accepted, **extra):
            raise ApprovalDecisionError(
                f"The tool call {self._call()} is no longer waiting for a decision: it expired (the tool server's "
                "approval timeout) or the code that made it is gone, so the call does not run."
            )

    def _call(self) -> str:
        """The server and tool, for messages and logs: bounded, whatever the arguments' size."""
        return f"{shown_name(self.server_name[:256])}.{shown_name(self.tool_name[:256])}"

    def __str__(self) -> str:
        args = ", ".join(f"{shown_name(name)}={_value(value)}" for name, value in self.tool_args.items())
        return f"{shown_name(self.server_name)}.{shown_name(self.tool_name)}({args})"

    def __repr__(self) -> str:
        return (
            f"ApprovalRequest(server_name={_value(self.server_name)}, tool_name={_value(self.tool_name)}, "
            f"tool_args={_value(self.tool_args)})"
        )


def shown_name(name: str) -> str:
    """A name as it is, if it is a plain identifier; else quoted and escaped like a Python string."""
    return name if name.isidentifier() and name.isprintable() and name.isascii() else ascii(name)


def _value(value: Any) -> str:
    """A JSON value written as Python writes it: strings quoted, with every character that is not
    printable (controls, terminal escapes, bidirectional and zero-width marks) escaped."""
    return repr(value)


class ApprovalCallback(Protocol):
    """Called with each approval request; it must eventually accept or reject it."""

    def __call__(self, request: ApprovalRequest, /) -> Awaitable[None]: ...


async def abandon(request: ApprovalRequest) -> None:
    """Reject `request` because nobody is left to decide (a stream that ended, no execution running);
    the audit trail records it as abandoned.

    Raises:
        ApprovalDecisionError: As `ApprovalRequest.reject`.
        ApprovalConnectionError: As `ApprovalRequest.reject`.
    """
    await request._abandon()


async def decide_for(request: ApprovalRequest, accepted: bool, by: str) -> None:
    """Accept or reject `request` on behalf of `by` (a `Decider` value: the person at the MCP client,
    or nobody, for a hidden cell's or a too large call), which the audit trail records and the
    caller's error names instead of the application.

    Raises:
        ApprovalDecisionError: As `ApprovalRequest.accept`.
        ApprovalConnectionError: As `ApprovalRequest.accept`.
    """
    await request._decide_as(accepted, by)


class ApprovalClient:
    """Connects to a tool server's approval channel and hands every request to a callback.

    Each request is handled in its own task, so a slow decision does not hold up others. A
    callback that raises rejects its request. If the connection drops while the client is
    connected, it connects again (requests the tool server sent before the drop fail there).

    Example:
        ```python
        async def on_approval_request(request: ApprovalRequest) -> None:
            print(f"Approval request: {request}")
            await request.accept()

        async with ApprovalClient(callback=on_approval_request, port=server.port):
            ...  # run code that calls MCP tools
        ```

    Args:
        callback: Async function called with each :class:`ipybox.ApprovalRequest`.
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
        # Per request id: whether the tool server took the decision sent for it.
        self._taken: dict[int, asyncio.Future[bool]] = {}
        # Whether a message arrived since the channel last dropped (reconnecting starts over quickly).
        self._received = False

    async def connect(self) -> None:
        """Connect to the tool server's approval channel.

        Raises:
            RuntimeError: This client is already connected.
            ApprovalConnectionError: The tool server could not be reached, or it refused the connection
                (wrong secret, or another approval client is connected).
        """
        if self._websocket is not None:
            raise RuntimeError("The approval client is already connected.")
        self._websocket = await self._open()
        self._reader = asyncio.create_task(self._read(), name="approval-client-reader")

    async def _open(self) -> Any:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidHandshake, InvalidStatus

        headers = {"Authorization": f"Bearer {self._secret}"} if self._secret is not None else None
        url = f"ws://{self.host}:{self.port}/approval"
        try:
            # No message size limit: the tool server bounds a request by its own request size limit,
            # and a request this client could not read would take the channel down.
            websocket: Any = await connect(
                url,
                additional_headers=headers,
                open_timeout=10,
                compression=None,
                max_size=None,
                create_connection=_direct_connection(),
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
        websocket.on_text = lambda text: self._dispatch(text, websocket)
        return websocket

    async def disconnect(self) -> None:
        """Disconnect from the approval channel; requests not yet decided fail on the tool server."""
        websocket, self._websocket = self._websocket, None
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        if websocket is not None:
            await websocket.close()
        self._fail_waiting()
        handlers, self._handlers = self._handlers, set()
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def __aenter__(self) -> ApprovalClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.disconnect()

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        delay = _RECONNECT_MIN
        while True:
            websocket = self._websocket
            try:
                # Whole text messages are handled as they arrive (`_dispatch`); only the others
                # (binary, or sent in fragments) come through here.
                async for message in websocket:
                    self._dispatch(message, websocket)
            except ConnectionClosed:
                pass
            if self._received:
                self._received = False
                delay = _RECONNECT_MIN
            # The channel dropped (the tool server closed it, or restarted): decisions on its
            # requests cannot arrive any more; connect again until disconnect().
            logger.warning("The approval channel to the tool server closed; connecting again.")
            self._fail_waiting()
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECONNECT_MAX)
                try:
                    self._websocket = await self._open()
                    break
                except ApprovalConnectionError as exc:
                    logger.debug("Approval channel not back yet: %s", exc)

    def _dispatch(self, message: str | bytes, websocket: Any) -> None:
        """Handle one message of the tool server: a decision's notice, or a request for its own task."""
        self._received = True
        request = self._parse(message, websocket)
        if request is not None:
            handler = asyncio.create_task(self._handle(request))
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)

    def _fail_waiting(self) -> None:
        taken, self._taken = self._taken, {}
        for future in taken.values():
            if not future.done():
                future.set_exception(
                    ApprovalConnectionError("The connection to the tool server's approval channel is closed.")
                )

    def _parse(self, message: str | bytes, websocket: Any) -> ApprovalRequest | None:
        try:
            data = json.loads(message)
            if data.get("method") == "decided":
                # The tool server's answer to a decision: whether it took it.
                future = self._taken.pop(data["params"]["id"], None)
                if future is not None and not future.done():
                    future.set_result(data["params"]["taken"] is True)
                return None
            if data.get("method") != "approve":
                raise ValueError(f"unknown method {data.get('method')!r}")
            request_id = data["id"]
            params = data["params"]
            server_name, tool_name = str(params["server_name"]), str(params["tool_name"])
            tool_args = params.get("tool_args") or {}
            if type(request_id) is not int or not isinstance(tool_args, dict):
                raise ValueError("malformed id or tool_args")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("Ignored a malformed approval request: %s", exc)
            return None

        async def respond(accepted: bool, **extra: Any) -> bool:
            from websockets.exceptions import ConnectionClosed

            if websocket is not self._websocket:
                raise ApprovalConnectionError(
                    "The approval channel this request came through is closed; the request failed on the "
                    "tool server."
                )
            taken = asyncio.get_running_loop().create_future()
            self._taken[request_id] = taken
            flags = "".join(
                f",{json.dumps(name)}:{json.dumps(value)}" for name, value in extra.items() if value
            )
            answer = (
                f'{{"jsonrpc":"2.0","id":{request_id},"result":{"true" if accepted else "false"}{flags}}}'
            )
            try:
                if not websocket.send_now(answer):
                    await websocket.send(answer)
            except ConnectionClosed as exc:
                self._taken.pop(request_id, None)
                raise ApprovalConnectionError(
                    "The connection to the tool server's approval channel is closed."
                ) from exc
            return bool(await taken)

        return ApprovalRequest(server_name, tool_name, tool_args, respond)

    async def _handle(self, request: ApprovalRequest) -> None:
        try:
            await self.callback(request)
        except Exception:  # broad: the application's callback may fail in any way; the call is rejected
            logger.exception("The approval callback failed for %s; the request is rejected.", request._call())
            if not request.decided:
                try:
                    await request.reject()
                except ApprovalError:
                    pass


_RECONNECT_MIN = 0.05
_RECONNECT_MAX = 2.0


@functools.cache
def _direct_connection() -> type[Any]:
    """The client connection class that hands whole text messages to ``on_text`` as they arrive.

    websockets queues every message for a reader task to take; here a message that arrives in one
    frame (the tool server sends each in one) is handled in ``data_received`` already, which saves
    a task hand-off per message on the approval path. Others take the queue as before.
    ``send_now`` writes a decision without `send`'s context and drain when nothing holds it up.
    """
    from websockets.asyncio.client import ClientConnection
    from websockets.frames import Frame, Opcode
    from websockets.protocol import State

    class DirectConnection(ClientConnection):
        on_text: Callable[[str], None] | None = None

        def send_now(self, text: str) -> bool:
            """Write a text message at once, if the connection is open, no other message is being
            sent and writes are not paused; whether it was (if not, `send` waits its turn)."""
            if self.send_in_progress is not None or self.paused or self.protocol.state is not State.OPEN:
                return False
            self.protocol.send_text(text.encode())
            self.send_data()
            return True

        def process_event(self, event: Any) -> None:
            on_text = self.on_text
            if (
                on_text is None
                or not isinstance(event, Frame)
                or event.opcode is not Opcode.TEXT
                or not event.fin
            ):
                super().process_event(event)
                return
            try:
                text = bytes(event.data).decode()
            except UnicodeDecodeError:
                logger.warning("Ignored an approval message that is not UTF-8.")
                return
            try:
                on_text(text)
            except Exception:  # broad: data_received must not fail; the message is lost, the channel stays
                logger.exception("Could not handle a message of the approval channel.")

    return DirectConnection
