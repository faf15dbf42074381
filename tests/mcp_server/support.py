"""Running the ipybox MCP server as a real process and talking to it through the SDK's client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import DEFAULT_MAX_SSE_EVENT_SIZE, streamable_http_client


@contextlib.contextmanager
def own_state(workspace: Path) -> Iterator[Path]:
    """`workspace`, with ``IPYBOX_STATE_DIR`` beside it while the block runs: a test module's server
    and tests then share one registry of their own."""
    old_state = os.environ.get("IPYBOX_STATE_DIR")
    os.environ["IPYBOX_STATE_DIR"] = str(workspace.parent / f"{workspace.name}-state")
    try:
        yield workspace
    finally:
        if old_state is None:
            os.environ.pop("IPYBOX_STATE_DIR", None)
        else:
            os.environ["IPYBOX_STATE_DIR"] = old_state


def server_env(**extra: str) -> dict[str, str]:
    """The server's environment: this process's (with the test's IPYBOX_STATE_DIR) plus `extra`."""
    return {**os.environ, **extra}


def stdio_params(
    workspace: Path, *args: str, env: dict[str, str] | None = None, module: str = "ipybox"
) -> StdioServerParameters:
    """Parameters that start ``python -m ipybox --workspace <workspace>`` over stdio."""
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", module, "--workspace", str(workspace), *args],
        env=env if env is not None else server_env(),
    )


@contextlib.asynccontextmanager
async def connected(
    server: Any,
    *,
    url_token: str | None = None,
    headers: dict[str, str] | None = None,
    max_sse_event_size: int | None = None,
    **kwargs: Any,
) -> AsyncIterator[Client]:
    """A connected client, owned by a task of its own.

    The client's anyio scopes must be entered and exited by one task, and pytest-asyncio may
    set a fixture up and tear it down in different tasks; requests reach the client from any task.
    `server` is stdio parameters or a streamable HTTP URL (then `url_token` is sent as the
    bearer token, with `headers`; `max_sse_event_size` raises the SDK client's 1 MiB cap on
    one server-sent event, which a large download needs).
    """
    ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def own() -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                target = server
                if isinstance(server, str):
                    sent = dict(headers or {})
                    if url_token is not None:
                        sent["Authorization"] = f"Bearer {url_token}"
                    http = await stack.enter_async_context(
                        httpx2.AsyncClient(headers=sent, timeout=httpx2.Timeout(30, read=300))
                    )
                    target = streamable_http_client(
                        server,
                        http_client=http,
                        max_sse_event_size=max_sse_event_size or DEFAULT_MAX_SSE_EVENT_SIZE,
                    )
                client = await stack.enter_async_context(Client(target, **kwargs))
                ready.set_result(client)
                await done.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    owner = asyncio.create_task(own())
    try:
        yield await ready
    finally:
        done.set()
        with contextlib.suppress(Exception):
            await owner


def text_of(result: types.CallToolResult) -> str:
    """The text content of a tool result, joined."""
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def run(client: Client, code: str, **arguments: Any) -> types.CallToolResult:
    """Call execute_ipython_cell."""
    return await client.call_tool("execute_ipython_cell", {"code": code, **arguments})


def wait_until(condition: Callable[[], bool], timeout: float = 30) -> bool:
    """Poll `condition` until it holds or `timeout` passes (for process exits and log lines,
    which signal nothing); whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
