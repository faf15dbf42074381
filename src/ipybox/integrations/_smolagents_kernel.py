"""The kernel-side code of the smolagents executor, as text sent to the kernel: the tools as thin
callers of the tool server, ``final_answer``, and the variables an agent run sends in.

Names and strings go into the code only through ``repr`` (and tool names must be identifiers), so no
tool name, description or value is ever executed as code.
"""

from __future__ import annotations

import keyword
from collections.abc import Sequence

__all__ = ["FINAL_ANSWER", "prelude", "tool_definition"]

FINAL_ANSWER = "IpyboxFinalAnswer"
"""The exception ``final_answer`` raises in the kernel, its value's JSON as its message."""

_PRELUDE = f'''
import json as __ipybox_json


class {FINAL_ANSWER}(BaseException):
    """Ends the step with the agent's final answer (not an Exception, so that `except Exception` lets it through)."""


def final_answer(answer):
    try:
        text = __ipybox_json.dumps(answer)
    except (TypeError, ValueError):
        text = __ipybox_json.dumps(str(answer))
    raise {FINAL_ANSWER}(text)


def __ipybox_tool(server, name, inputs):
    from ipybox.tool_exec.client import run_tool_content

    def call(*args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], dict) and set(args[0]) <= set(inputs):
            args, kwargs = (), dict(args[0])
        if len(args) > len(inputs):
            raise TypeError(f"{{name}}() takes at most {{len(inputs)}} arguments ({{len(args)}} given)")
        for key, value in zip(inputs, args):
            if key in kwargs:
                raise TypeError(f"{{name}}() got multiple values for argument {{key!r}}")
            kwargs[key] = value
        content = run_tool_content(server, name, kwargs)
        if content.images:
            data = content.images[0].data
            try:
                import io
                from PIL import Image
            except ImportError:
                return data
            return Image.open(io.BytesIO(data))
        if content.structured is not None and "result" in content.structured:
            return content.structured["result"]
        return content.text

    call.__name__ = call.__qualname__ = name
    return call
'''


def prelude() -> str:
    """Kernel code that defines ``final_answer`` and the helper the tool definitions use."""
    return _PRELUDE


def tool_definition(server: str, name: str, inputs: Sequence[str]) -> str:
    """Kernel code that binds `name` to a caller of tool `name` of MCP server `server`.

    Raises:
        ValueError: `name` is not a Python identifier, or is a keyword.
    """
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(
            f"Tool name {name!r} is not a Python identifier, so code cannot call it; rename the tool."
        )
    return f"{name} = __ipybox_tool({server!r}, {name!r}, {list(inputs)!r})\n"
