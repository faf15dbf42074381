"""A small MCP server for ipybox's tests, built with the MCP Python SDK.

Run it as::

    python tests/servers/demo_server.py --transport stdio
    python tests/servers/demo_server.py --transport streamable-http --port 0
    python tests/servers/demo_server.py --transport sse --port 0

Over HTTP it binds the port itself (``0`` picks a free one) and prints one line
``READY <url>`` to stdout once it accepts connections, so tests can wait for that line.

Tools cover the shapes the tool execution layer and the code generator must handle:
unstructured text, structured output, nested structured output, enums with optional and
nullable fields and a ``$ref``'d nested input model, a slow tool, a failing tool, a tool that
kills its own process, a tool that echoes an environment variable, a rendezvous
that answers only once a number of calls are in flight together, and media: an image, audio,
a resource link, embedded text and binary resources, text mixed with an image, structured
content beside an image, and a blob of any size.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import socket
import struct
import sys
import zlib
from enum import Enum, StrEnum
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)
from pydantic import BaseModel, Field

mcp = MCPServer("demo", log_level="WARNING")


@mcp.tool(structured_output=False)
def echo(text: str) -> str:
    """Return the text unchanged (unstructured output)."""
    return text


@mcp.tool(structured_output=False)
def greet(name: str, punctuation: str = "!") -> str:
    """Greet someone by name (unstructured output)."""
    return f"Hello, {name}{punctuation}"


class Sum(BaseModel):
    sum: int


@mcp.tool()
def add(a: int, b: int) -> Sum:
    """Add two integers (structured output)."""
    return Sum(sum=a + b)


class Address(BaseModel):
    street: str
    city: str
    tags: list[str] = Field(default_factory=list)


class Person(BaseModel):
    name: str
    age: int
    addresses: list[Address]


class Directory(BaseModel):
    people: list[Person]
    count: int
    meta: dict[str, int]


@mcp.tool()
def directory(names: list[str], city: str = "Berlin") -> Directory:
    """Build a directory of people (nested structured output: objects in lists in objects)."""
    people = [
        Person(
            name=name,
            age=20 + i,
            addresses=[Address(street=f"{i} Main St", city=city, tags=["home", name.lower()])],
        )
        for i, name in enumerate(names)
    ]
    return Directory(people=people, count=len(people), meta={"version": 1})


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Size(int, Enum):
    SMALL = 1
    MEDIUM = 2
    LARGE = 3


class Dimensions(BaseModel):
    """A nested input model, referenced from the input schema with ``$ref``."""

    width: float
    height: float
    unit: Literal["cm", "in"] = "cm"


class Order(BaseModel):
    item: str
    color: Color
    size: Size
    quantity: int
    dimensions: Dimensions | None
    note: str | None


@mcp.tool()
def order(
    item: str,
    color: Color,
    size: Size = Size.MEDIUM,
    quantity: int = 1,
    dimensions: Dimensions | None = None,
    note: str | None = None,
    shipping: Literal["standard", "express"] = "standard",
) -> Order:
    """Place an order (enums, optional and nullable fields, defaults, a $ref'd nested model)."""
    return Order(item=item, color=color, size=size, quantity=quantity, dimensions=dimensions, note=note)


@mcp.tool(structured_output=False)
async def slow(seconds: float, started: str = "") -> str:
    """Sleep for the given number of seconds, then answer.

    If `started` names a file, it is created first: a test waits for it to know that the call
    has reached the server.
    """
    if started:
        os.close(os.open(started, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    await asyncio.sleep(seconds)  # sleep: a tool that takes time is what the caller asked for
    return f"slept {seconds}"


@mcp.tool()
def fail(message: str = "this tool always fails") -> str:
    """Fail with the given message (an ``isError`` result)."""
    raise ToolError(message)


@mcp.tool()
def crash(exit_code: int = 3) -> str:
    """Kill the server process immediately, without answering."""
    os._exit(exit_code)


@mcp.tool(structured_output=False)
def getenv(name: str) -> str:
    """Return the value of an environment variable of the server process ('' if unset)."""
    return os.environ.get(name, "")


@mcp.tool()
def pid() -> int:
    """Return the server's process id."""
    return os.getpid()


_arrived: dict[str, int] = {}
_complete: dict[str, asyncio.Event] = {}


@mcp.tool(structured_output=False)
async def rendezvous(key: str, count: int, timeout: float = 60) -> str:
    """Wait until `count` calls with this `key` are in flight at once, then answer all of them.

    Proves concurrency: run one by one, the calls could never all be waiting together.
    """
    _arrived[key] = _arrived.get(key, 0) + 1
    event = _complete.setdefault(key, asyncio.Event())
    if _arrived[key] >= count:
        event.set()
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        raise ToolError(f"only {_arrived[key]} of {count} calls with key {key!r} arrived") from None
    return f"{count} together"


def png_bytes(width: int = 4, height: int = 3) -> bytes:
    """A small, valid PNG (an RGB gradient): what the image tools return, byte for byte."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (x * 60 % 256, y * 80 % 256, 200))
        for y in range(height)
    )
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def wav_bytes() -> bytes:
    """A short, valid WAV file (8-bit mono silence with a blip): what the audio tool returns."""
    samples = bytes([128] * 50 + [255, 0] * 5 + [128] * 40)
    fmt = struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 8)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(samples))
        + samples
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


BLOB = bytes(range(256)) * 4  # every byte value, for the embedded binary resource


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@mcp.tool(structured_output=False)
def image() -> ImageContent:
    """Return a small PNG image."""
    return ImageContent(type="image", data=_b64(png_bytes()), mime_type="image/png")


@mcp.tool(structured_output=False)
def audio() -> AudioContent:
    """Return a short WAV sound."""
    return AudioContent(type="audio", data=_b64(wav_bytes()), mime_type="audio/wav")


@mcp.tool(structured_output=False)
def link() -> ResourceLink:
    """Return a link to a resource."""
    return ResourceLink(
        type="resource_link",
        uri="file:///data/report.csv",
        name="report.csv",
        mime_type="text/csv",
        description="The quarterly report",
        size=1234,
    )


@mcp.tool(structured_output=False)
def embedded_text() -> EmbeddedResource:
    """Return an embedded text resource."""
    return EmbeddedResource(
        type="resource",
        resource=TextResourceContents(
            uri="memo://notes/1", text="line one\nline two ✓", mime_type="text/markdown"
        ),
    )


@mcp.tool(structured_output=False)
def embedded_blob() -> EmbeddedResource:
    """Return an embedded binary resource."""
    return EmbeddedResource(
        type="resource",
        resource=BlobResourceContents(
            uri="blob://bytes/all", blob=_b64(BLOB), mime_type="application/octet-stream"
        ),
    )


@mcp.tool(structured_output=False)
def text_and_image(caption: str) -> list[ContentBlock]:
    """Return a caption, an image and a second text."""
    return [
        TextContent(type="text", text=caption),
        ImageContent(type="image", data=_b64(png_bytes(8, 8)), mime_type="image/png"),
        TextContent(type="text", text="end"),
    ]


@mcp.tool()
def chart(points: int) -> CallToolResult:
    """Return structured content (the point count) beside an image."""
    return CallToolResult(
        content=[ImageContent(type="image", data=_b64(png_bytes(points, 2)), mime_type="image/png")],
        structured_content={"points": points},
    )


@mcp.tool(structured_output=False)
def blob(size: int) -> ImageContent:
    """Return an 'image' of `size` bytes (for size limits)."""
    return ImageContent(type="image", data=_b64(b"\xab" * size), mime_type="application/octet-stream")


async def _serve_http(transport: str, host: str, port: int) -> None:
    import uvicorn

    if transport == "sse":
        app, path = mcp.sse_app(host=host), "/sse"
    else:
        app, path = mcp.streamable_http_app(host=host), "/mcp"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # A test that restarts the server on its port keeps the port bound meanwhile (with this
    # option too), so that no other process can take it while the server is down.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(128)
    bound_port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    # The socket already listens: connections made from now on wait in its backlog until
    # uvicorn (after the app's lifespan startup) accepts them, so "ready" needs no polling.
    print(f"READY http://{host}:{bound_port}{path}", flush=True)
    await server.serve(sockets=[sock])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--transport", choices=["stdio", "streamable-http", "sse"], default="stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.transport == "stdio":
        mcp.run("stdio")
    else:
        asyncio.run(_serve_http(args.transport, args.host, args.port))
    sys.exit(0)


if __name__ == "__main__":
    main()
