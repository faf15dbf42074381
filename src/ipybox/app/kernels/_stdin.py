"""Runs in the application. Answering a kernel's stdin channel: the kernel's ``input_request``
messages (written by code in the kernel, so hostile) go to the `StdinHandler` that makes the tool
calls of a kernel on another host; anything else gets end of input."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

import websockets

from ipybox._wire import PROMPT_PREFIX
from ipybox.app.kernels._wire import KernelChannels, input_reply

__all__ = ["InputAnswerer", "StdinHandler"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")
# What ipykernel's input() takes for end of input: it raises EOFError.
_EOF = "\x04"


class StdinHandler(Protocol):
    """Answers the tool call requests a kernel makes on its stdin channel (``ipybox._wire.StdinChannel``)."""

    async def input_request(self, kernel_id: str, prompt: str) -> str:
        """The reply to `prompt` (which starts with ``PROMPT_PREFIX``) from the kernel `kernel_id`.

        The kernel is known from the connection the request came on, never from the request.
        """
        ...

    def execution_ended(self, kernel_id: str) -> None:
        """An execution of the kernel `kernel_id` ended: answer a held request, drop what nobody takes."""
        ...


class InputAnswerer:
    """A kernel's `KernelChannels.on_input`: answers each ``input_request`` through `handler`."""

    def __init__(self, handler: StdinHandler) -> None:
        self._handler = handler

    def __call__(self, kernel: KernelChannels, msg: dict[str, Any]) -> None:
        """Answer an input_request of the kernel's stdin channel (written by code in the kernel: hostile)."""
        # ipykernel waits for one reply at a time: a new request means nobody reads the answer to
        # the one before any more. So at most one answer is made per kernel, however many come.
        if kernel.answering is not None:
            kernel.answering.cancel()
        kernel.answering = asyncio.create_task(self._answer(kernel, msg))

    async def _answer(self, kernel: KernelChannels, msg: dict[str, Any]) -> None:
        content = msg["content"]
        prompt = content.get("prompt") if isinstance(content, dict) else None
        value = _EOF
        # Only while an execution runs: a request made between executions (by a thread a cell
        # left behind) would hold results and budget that no execution's end ever frees.
        running = kernel.pending > 0
        if running and isinstance(prompt, str) and prompt.startswith(PROMPT_PREFIX):
            try:
                value = await self._handler.input_request(kernel.id, prompt)
            except Exception:  # broad: a failed answer must still end the kernel's wait (as end of input)
                logger.exception("Answering a tool call request of kernel %s failed.", kernel.id)
        with contextlib.suppress(websockets.ConnectionClosed):
            await kernel.ws.send(input_reply(kernel.session, msg["header"], value))
