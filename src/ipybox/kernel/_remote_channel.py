"""Tool calls from a kernel on another host, over the kernel's own stdin channel (prototype).

A remote kernel may reach nothing but its gateway, so a tool call cannot open a connection to the
tool server. It asks the application instead the way ``input()`` asks a person: ipykernel sends an
``input_request`` on the stdin channel, the gateway forwards it over the application's WebSocket,
and the application's ``input_reply`` carries the answer back, while the cell is still running, on
every ipykernel (6 and 7). The prompt is `PROMPT_PREFIX` followed by the request as JSON; the reply's
value is the answer as JSON.

The application treats every such request as written by hostile code (any cell can send one, with
any content): it carries no approval and no identity; the application applies its registry and
approval to it exactly as the tool server does to ``POST /run``. One request is in flight per kernel
at a time (ipykernel pairs a reply with whichever request waits), so calls from threads queue here.
"""

from __future__ import annotations

import builtins
import itertools
import json
import threading
from typing import Any

from ipybox.errors import ToolRunnerError

# What the application recognises as a tool call rather than a plain ``input()`` prompt; defined
# here once and imported by the application side.
PROMPT_PREFIX = "\x1b]ipybox-tool-call;"
# The largest request or reply either side accepts (the gateway's WebSocket limit is 10 MiB).
MAX_MESSAGE_CHARS = 8 * 1024 * 1024
# The fields of a request, and nothing else.
REQUEST_FIELDS = frozenset({"id", "server_name", "tool_name", "tool_args"})

_lock = threading.Lock()
_ids = itertools.count(1)


def call(server_name: str, tool_name: str, tool_args: dict[str, Any]) -> Any:
    """Run a tool through the application that started this kernel and return its result.

    Raises:
        ToolRunnerError: The application rejected or failed the call, or no application answers
            tool calls on this kernel's stdin channel.
    """
    request_id = next(_ids)
    prompt = PROMPT_PREFIX + json.dumps(
        {"id": request_id, "server_name": server_name, "tool_name": tool_name, "tool_args": tool_args}
    )
    if len(prompt) > MAX_MESSAGE_CHARS:
        raise ToolRunnerError(
            f"The arguments of {server_name}.{tool_name} are over {MAX_MESSAGE_CHARS} characters as JSON; "
            "pass large data as a file instead.",
            server_name=server_name,
            tool_name=tool_name,
        )
    with _lock:
        try:
            value = builtins.input(prompt)
        except Exception as exc:  # StdinNotImplementedError: the client did not allow stdin.
            raise ToolRunnerError(
                f"No application answers tool calls on this kernel's stdin channel ({exc}); "
                "run the code through the ipybox executor that started the kernel.",
                server_name=server_name,
                tool_name=tool_name,
            ) from exc
    return _result(value, request_id, server_name, tool_name)


def _result(value: str, request_id: int, server_name: str, tool_name: str) -> Any:
    try:
        reply = json.loads(value)
    except ValueError:
        reply = None
    # A request the application could not parse is answered with no id, and only with an error.
    if not isinstance(reply, dict) or reply.get("id") not in (request_id, None) or set(reply) == {"id"}:
        raise ToolRunnerError(
            f"The answer to the call of {server_name}.{tool_name} is not a reply to it; "
            "the stdin channel is used by another request.",
            server_name=server_name,
            tool_name=tool_name,
        )
    if reply.get("error") is not None or reply.get("id") is None:
        kind = reply.get("kind")
        raise ToolRunnerError(
            str(
                reply.get("error")
                or "The application answered the tool call with neither a result nor an error."
            ),
            kind=kind if kind in ("rejected", "expired") else "failed",
            server_name=server_name,
            tool_name=tool_name,
        )
    return reply.get("result")
