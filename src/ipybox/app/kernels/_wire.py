"""One kernel's channels WebSocket on the gateway: the Jupyter messages the kernel client sends
and reads, framed for the gateway's binary protocol, and the router of what the kernel sends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

__all__ = [
    "MAX_MESSAGE_SIZE",
    "WS_PROTOCOL",
    "KernelChannels",
    "RemoteChannels",
    "decode",
    "execute_request",
    "input_reply",
]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")
# Bytes one message from the kernel may have (a larger one would be held whole in memory), and
# the WebSocket close code for a message over it.
MAX_MESSAGE_SIZE = 64 * 1024 * 1024
_MESSAGE_TOO_BIG = 1009


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass
class KernelChannels:
    """One kernel on the gateway with its open channels WebSocket."""

    id: str
    ws: ClientConnection | RemoteChannels
    session: str
    queues: dict[str, asyncio.Queue[dict[str, Any] | None]] = field(default_factory=dict)
    receiver: asyncio.Task[None] | None = None
    dead: bool = False
    # Why the connection ended, when the client itself ended it (a message over the size limit).
    lost_because: str | None = None
    busy: asyncio.Event = field(default_factory=asyncio.Event)
    # Executions submitted and not yet collected; `settled` is set while there are none.
    pending: int = 0
    settled: asyncio.Event = field(default_factory=_set_event)
    # Called once the kernel is closed (a pooled kernel's private folders go with it).
    on_close: Callable[[], None] | None = None
    # Takes each input_request of the stdin channel (the kernel client's, when it answers them).
    on_input: Callable[[KernelChannels, dict[str, Any]], None] | None = None
    # The answer being made to the kernel's one waiting input_request.
    answering: asyncio.Task[None] | None = None

    async def receive(self) -> None:
        """Route every message from the kernel to the execution it belongs to, until the connection ends."""
        try:
            async for raw in self.ws:
                msg = decode(raw)
                if msg["msg_type"] == "status" and msg["content"].get("execution_state") in (
                    "restarting",
                    "dead",
                ):
                    self.died()
                    continue
                if msg["channel"] == "stdin":
                    # Only the stdin channel's input_request is acted on: what the kernel prints or
                    # publishes on iopub is output, whatever it looks like.
                    if msg["msg_type"] == "input_request" and self.on_input is not None:
                        self.on_input(self, msg)
                    continue
                queue = self.queues.get(msg["parent_id"])
                if queue is not None:
                    queue.put_nowait(msg)
        except websockets.ConnectionClosed as exc:
            if exc.rcvd is None and exc.sent is not None and exc.sent.code == _MESSAGE_TOO_BIG:
                self.lost_because = (
                    f"The kernel sent one message over {MAX_MESSAGE_SIZE // (1024 * 1024)} MiB (an output that "
                    "large at once, e.g. one print of it), so ipybox closed its connection to the kernel and "
                    "the kernel's state is lost; print less at once (write large data to a file instead)."
                )
        except Exception:  # broad: see below
            # Without the router no execution can finish: report the kernel as lost.
            logger.exception("Unreadable message from kernel %s; treating it as dead.", self.id)
        finally:
            self.died()

    def died(self) -> None:
        """Mark the kernel dead and end every execution waiting for its messages."""
        self.dead = True
        for queue in self.queues.values():
            queue.put_nowait(None)

    def settle(self) -> None:
        """Count one submitted execution as collected."""
        self.pending -= 1
        if self.pending == 0:
            self.settled.set()


def execute_request(
    session: str,
    msg_id: str,
    code: str,
    allow_stdin: bool = False,
    *,
    silent: bool = False,
    user_expressions: dict[str, str] | None = None,
) -> bytes:
    header = {
        "msg_id": msg_id,
        "msg_type": "execute_request",
        "username": "ipybox",
        "session": session,
        "version": "5.3",
        "date": "",
    }
    content = {
        "code": code,
        # Silent: no execution count, no history, no output broadcast (a kernel's hidden setup).
        "silent": silent,
        "store_history": not silent,
        # Evaluated after the code; their values come in the reply, on the shell channel.
        "user_expressions": user_expressions or {},
        "allow_stdin": allow_stdin,
        # Executions are independent: one that fails must not abort the next one queued.
        "stop_on_error": False,
    }
    return _encode("shell", [header, {}, {}, content])


def input_reply(session: str, parent: dict[str, Any], value: str) -> bytes:
    """The answer to the kernel's `parent` ``input_request``: `value` is what its ``input()`` returns."""
    header = {
        "msg_id": uuid.uuid4().hex,
        "msg_type": "input_reply",
        "username": "ipybox",
        "session": session,
        "version": "5.3",
        "date": "",
    }
    return _encode("stdin", [header, parent, {}, {"status": "ok", "value": value}])


# The gateway's binary WebSocket protocol passes the kernel's message parts through
# untouched; the JSON one makes the gateway decode and re-encode every message.
# Frame: count of offsets, the offsets (8-byte little-endian each), then the channel
# name and the header, parent header, metadata and content parts they delimit.
WS_PROTOCOL = "v1.kernel.websocket.jupyter.org"


def _encode(channel: str, parts: list[dict[str, Any]]) -> bytes:
    chunks = [channel.encode(), *(json.dumps(part).encode() for part in parts)]
    offsets = [8 * (len(chunks) + 2)]
    for chunk in chunks:
        offsets.append(offsets[-1] + len(chunk))
    head = len(offsets).to_bytes(8, "little") + b"".join(o.to_bytes(8, "little") for o in offsets)
    return head + b"".join(chunks)


def decode(frame: str | bytes) -> dict[str, Any]:
    """Decode the parts of a kernel message that the client routes on and reads."""
    if isinstance(frame, str):
        return _decode_json(frame)
    count = int.from_bytes(frame[:8], "little")
    offsets = [int.from_bytes(frame[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]
    header = json.loads(frame[offsets[1] : offsets[2]])
    parent = json.loads(frame[offsets[2] : offsets[3]])
    # The parent header is whatever code in the kernel put there: one of another shape routes nowhere.
    parent_id = parent.get("msg_id") if isinstance(parent, dict) else None
    return {
        "channel": frame[offsets[0] : offsets[1]].decode(),
        "header": header,
        "msg_type": header["msg_type"],
        "parent_id": parent_id if isinstance(parent_id, str) else None,
        "content": json.loads(frame[offsets[4] : offsets[5]]),
    }


class RemoteChannels:
    """A channels WebSocket to a gateway elsewhere, behind the interface of a local one.

    Two things differ from the local gateway ipybox starts:

    - A gateway on Jupyter Server 1 (Enterprise Gateway 3.3) does not offer `WS_PROTOCOL`; it takes
      and sends each message as one JSON text (`json_protocol`). What the client sends (binary
      frames) is rewritten here; what it receives arrives as text, which `decode` reads as JSON.
    - A stock gateway leaves Nagle's algorithm on for its WebSockets: each of the several small
      messages of an execution after the first waits for the client's ACK, which Linux delays by
      up to 40 ms. The client ACKs at once instead (``TCP_QUICKACK``, which Linux drops after a
      while, so it is set again after every message): a trivial execution then takes a few ms
      instead of about 50 (see benchmarks/remote.py).
    """

    def __init__(self, ws: ClientConnection, *, json_protocol: bool) -> None:
        self._ws = ws
        self._json = json_protocol
        sock = ws.transport.get_extra_info("socket")
        quickack = getattr(socket, "TCP_QUICKACK", None)  # Linux only
        self._sock = (
            sock if quickack is not None and sock is not None and sock.family != socket.AF_UNIX else None
        )

    async def send(self, frame: bytes) -> None:
        """Send one binary-protocol frame (as the JSON message it holds, with `json_protocol`)."""
        if not self._json:
            await self._ws.send(frame)
            return
        count = int.from_bytes(frame[:8], "little")
        offsets = [int.from_bytes(frame[8 * (i + 1) : 8 * (i + 2)], "little") for i in range(count)]
        channel, header, parent, metadata, content = (
            frame[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)
        )
        # The parts are JSON already: spliced, not decoded and encoded again.
        await self._ws.send(
            b'{"channel":%s,"header":%s,"parent_header":%s,"metadata":%s,"content":%s,"buffers":[]}'
            % (json.dumps(channel.decode()).encode(), header, parent, metadata, content),
            text=True,
        )

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[str | bytes]:
        sock = self._sock
        async for frame in self._ws:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            yield frame

    async def close(self) -> None:
        await self._ws.close()


def _decode_json(text: str) -> dict[str, Any]:
    """Decode a plain-JSON-protocol message, with the same fields as `decode` (and the whole header)."""
    msg = json.loads(text)
    header = msg["header"]
    parent = msg.get("parent_header") or {}
    # The parent header is whatever code in the kernel put there: one of another shape routes nowhere.
    parent_id = parent.get("msg_id") if isinstance(parent, dict) else None
    return {
        "msg_type": header["msg_type"],
        "parent_id": parent_id if isinstance(parent_id, str) else None,
        "content": msg.get("content") or {},
        "channel": msg.get("channel"),
        "header": header,
        "parent_header": parent,
    }
