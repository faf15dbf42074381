"""The text of the question the person at the MCP client is asked about one call, built in bounded time.

In the ``ipybox`` MCP server's process (trusted); the call's names and arguments come from the
kernel (untrusted), so they can be of any size (tens of MiB) and hold anything. The question shows
the call as `ApprovalRequest` prints it (every name and value escaped: what is shown is what runs),
but of a call longer than `WHOLE_CHARS` only its head and tail, with how many characters were left
out between them and the SHA-256 of those characters (as UTF-8). A piece repeated 16 times or more in what is shown is counted
(``[5000 times ' ']``), so that padding cannot push the rest out of sight.

The call's text is made piece by piece (a long string in slices of `_SLICE` characters, nested
values without recursion), so that no single step holds the interpreter for long, and `question`
runs in a worker thread: the event loop goes on serving every other session meanwhile. A call
longer than `MAX_CALL_CHARS` as text is not asked about at all (``None``): it is rejected.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from typing import Any

import anyio

from ipybox.app.approval import ApprovalRequest, is_shell, read_shell, shown_name

__all__ = ["HEAD_CHARS", "MAX_CALL_CHARS", "TAIL_CHARS", "WHOLE_CHARS", "question", "shown_call"]

HEAD_CHARS = 2000
"""How much of the start of a long call the person is shown."""
TAIL_CHARS = 1000
"""How much of its end."""
WHOLE_CHARS = 64 * 1024
"""The longest call shown whole (as escaped text, before runs are counted)."""
MAX_CALL_CHARS = 8 * 1024 * 1024
"""The longest call, as escaped text, put to the person; a longer one is rejected without asking."""
_SLICE = 64 * 1024
# A shell command shown longer than this starts with the programs it runs (read up to _READ_CHARS).
_SUMMARY_ABOVE = 200
_READ_CHARS = 1024 * 1024

# A piece repeated (spaces, escaped tabs, blank-looking U+2800) long enough to push the rest of a
# call beyond what a dialog shows of its start.
_RUN = re.compile(r"(.{1,8}?)\1{15,}", re.DOTALL)


def _counted(run: re.Match[str]) -> str:
    unit = run.group(1).encode("ascii", "backslashreplace").decode()
    return f"[{len(run.group(0)) // len(run.group(1))} times '{unit}']"


def _string(text: str) -> Iterator[str]:
    """`repr(text)`, for a long `text` in slices (always in single quotes)."""
    if len(text) <= _SLICE:
        yield repr(text)
        return
    yield "'"
    for start in range(0, len(text), _SLICE):
        # A string holding both quote characters is shown in single quotes with ' escaped, whatever
        # it holds: every slice is escaped alike, and the 4 characters of the added \'" and ' go.
        yield repr(text[start : start + _SLICE] + "'\"")[1:-4]
    yield "'"


def _value(value: Any) -> Iterator[str]:
    """`repr(value)` of a JSON value, in pieces, nested values walked without recursion."""
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, _Text):
            yield item
        elif isinstance(item, str):
            yield from _string(item)
        elif isinstance(item, dict):
            stack.append(_dict_items(item))
        elif isinstance(item, list):
            stack.append(_list_items(item))
        else:
            yield repr(item)


class _Text(str):
    """Punctuation among a container's items: shown as it is, not as a string value."""


_END = object()


def _dict_items(value: dict[Any, Any]) -> Iterator[Any]:
    yield _Text("{")
    for index, (key, item) in enumerate(value.items()):
        yield _Text(", ") if index else _Text("")
        yield key
        yield _Text(": ")
        yield item
    yield _Text("}")


def _list_items(value: list[Any]) -> Iterator[Any]:
    yield _Text("[")
    for index, item in enumerate(value):
        if index:
            yield _Text(", ")
        yield item
    yield _Text("]")


def _call(request: ApprovalRequest) -> Iterator[str]:
    """``str(request)``, in pieces."""
    yield f"{shown_name(request.server_name)}.{shown_name(request.tool_name)}("
    for index, (name, value) in enumerate(request.tool_args.items()):
        yield f"{', ' if index else ''}{shown_name(name)}="
        yield from _value(value)
    yield ")"


def shown_call(request: ApprovalRequest) -> str | None:
    """The call as the person is shown it (see the module docstring); ``None`` above `MAX_CALL_CHARS`.
    A long shell command starts with the programs it runs, as far as they can be read, so that
    distinct padding cannot push a program out of what a dialog shows first."""
    text = _shown_call(request)
    if text is None or len(text) <= _SUMMARY_ABOVE or not is_shell(request.server_name, request.tool_name):
        return text
    return f"{_programs(request)} {text}"


def _programs(request: ApprovalRequest) -> str:
    cmd = request.tool_args.get("cmd")
    if isinstance(cmd, str) and len(cmd) > _READ_CHARS:
        return "[runs: too long to read]"
    seen = read_shell(request.tool_name, request.tool_args).seen
    if seen is None:
        return "[runs: cannot be read]"
    return f"[runs: {', '.join(shown_name(program) for program in dict.fromkeys(seen)) or 'nothing'}]"


def _shown_call(request: ApprovalRequest) -> str | None:
    pieces = _call(request)
    whole: list[str] = []
    total = 0
    for piece in pieces:
        whole.append(piece)
        total += len(piece)
        if total > WHOLE_CHARS:
            break
    else:
        return _RUN.sub(_counted, "".join(whole))
    # Too long to show whole: its head, then its tail as it goes by, the rest only hashed.
    text = "".join(whole)
    head, tail = text[:HEAD_CHARS], text[HEAD_CHARS:]
    left_out = hashlib.sha256()
    left_out_length = 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_CALL_CHARS:
            return None
        tail += piece
        if len(tail) > TAIL_CHARS + _SLICE:
            spill, tail = tail[:-TAIL_CHARS], tail[-TAIL_CHARS:]
            left_out.update(spill.encode("utf-8", "surrogatepass"))
            left_out_length += len(spill)
    spill, tail = tail[:-TAIL_CHARS], tail[-TAIL_CHARS:]
    left_out.update(spill.encode("utf-8", "surrogatepass"))
    left_out_length += len(spill)
    return (
        f"{_RUN.sub(_counted, head)} [... {left_out_length} characters left out of {total}, SHA-256 of "
        f"those as UTF-8: {left_out.hexdigest()} ...] {_RUN.sub(_counted, tail)}"
    )


def _sentence(request: ApprovalRequest, call: str) -> str:
    if request.server_name == "ipybox" and request.tool_name in ("shell", "shell_magic"):
        return f"Allow the shell command a cell wants to run? {call}"
    return f"Allow the tool call a cell wants to make? {call}"


async def question(request: ApprovalRequest) -> str | None:
    """What the person reads about `request`, built in a worker thread; ``None``: too large to ask."""
    call = await anyio.to_thread.run_sync(shown_call, request)
    return None if call is None else _sentence(request, call)
