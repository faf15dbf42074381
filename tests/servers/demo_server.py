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
kills its own process, a tool that echoes an environment variable, and a rendezvous
that answers only once a number of calls are in flight together.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from enum import Enum, StrEnum
from typing import Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
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
async def slow(seconds: float) -> str:
    """Sleep for the given number of seconds, then answer."""
    await asyncio.sleep(seconds)
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


async def _serve_http(transport: str, host: str, port: int) -> None:
    import uvicorn

    if transport == "sse":
        app, path = mcp.sse_app(host=host), "/sse"
    else:
        app, path = mcp.streamable_http_app(host=host), "/mcp"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
