"""The answers of ``execute_ipython_cell``: output and images shaped for an agent, progress, asking.

In the ``ipybox`` MCP server's process (trusted). `_CellAnswers` is a base of
:class:`ipybox.mcp_server._tools.ToolSession`: it turns a cell's output, error and images into
the tool's result, runs a cell whose tool calls are put to the person at the client
(``--approve-tool-calls``), and reports progress while a cell runs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext

from ipybox.app.executor import CodeExecutionResult, CodeExecutor
from ipybox.app.kernels import DEFAULT_MAX_OUTPUT_CHARS, KeptText
from ipybox.app.sandbox import ConfinedPathError
from ipybox.mcp_server import _elicit, _output

Progress = Callable[[float, str], Awaitable[None]]
"""Reports progress of a running tool: seconds elapsed and the latest output line."""

# Progress is reported at most this often, and at least this often while a cell is silent,
# so that clients that give up on a quiet call keep waiting.
_PROGRESS_INTERVAL = 1.0
_HEARTBEAT_INTERVAL = 5.0


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[_text(text)], is_error=True)


async def _report_progress(progress: Progress, output: KeptText) -> None:
    start = time.monotonic()
    sent_at, sent_line = start, ""
    while True:
        await anyio.sleep(_PROGRESS_INTERVAL)
        now = time.monotonic()
        line = _output.last_line(output.recent()) if output else ""
        if line != sent_line or now - sent_at >= _HEARTBEAT_INTERVAL:
            await progress(round(now - start, 1), line or "running")
            sent_at, sent_line = now, line


_IMAGE_WORKERS = anyio.CapacityLimiter(2)


class _CellAnswers:
    """Turns what a cell did into the answer of ``execute_ipython_cell``."""

    executor: CodeExecutor
    workspace: Path

    async def _cell_answer(
        self, output: KeptText, result: CodeExecutionResult | None, failure: str | None, max_output_chars: int
    ) -> types.CallToolResult:
        if failure is not None:
            text = _output.clean(output.text()).rstrip("\n")
            text = f"{text}\n{_output.clean(failure)}" if text else _output.clean(failure)
            return _error(_output.truncate(text, max_output_chars, self.workspace))
        assert result is not None
        return await self._cell_result(result, max_output_chars)

    async def _execute_asking(
        self,
        approval: _elicit.ClientApproval,
        ctx: ServerRequestContext[Any] | None,
        state: types.CallToolRequestParams | None,
        code: str,
        timeout: float = 120,
        max_output_chars: int = 5000,
        *,
        progress: Progress | None = None,
    ) -> types.CallToolResult | types.InputRequiredResult:
        """`execute_ipython_cell` whose tool calls are put to the person at the client."""
        if ctx is None or not _elicit.can_ask(ctx):
            return _error(_elicit.NO_ELICITATION)
        if state is not None and state.request_state is not None:
            cell, asked = await approval.resume(state)
            if cell is None:
                return _error(_elicit.NOT_WAITING)
        else:
            stream = self.executor.stream(code, timeout=timeout, chunks=True)
            cell = _elicit.Cell(stream, KeptText(DEFAULT_MAX_OUTPUT_CHARS))
            cell.start()
            async with anyio.create_task_group() as tasks:
                if progress is not None:
                    tasks.start_soon(_report_progress, progress, cell.output)
                try:
                    asked = await approval.run(ctx, cell)
                finally:
                    tasks.cancel_scope.cancel()
        if asked is not None:
            return asked
        if cell.error is not None:
            raise cell.error
        return await self._cell_answer(cell.output, cell.result, cell.failure, max_output_chars)

    async def _cell_result(self, result: CodeExecutionResult, max_output_chars: int) -> types.CallToolResult:
        """The answer of `execute_ipython_cell` for a cell that ran: its output, then its images."""
        text = _output.truncate(_output.clean(result.text or ""), max_output_chars, self.workspace)
        # "(no output)" only where there is nothing else to show (not beside images).
        content: list[types.ContentBlock] = [_text(text)] if text else []
        if not text and not result.images:
            content.append(_text("(no output)"))
        images, skipped = await self._image_blocks(result.images)
        content += images
        if result.images:
            paths = ", ".join(str(self._relative(image)) for image in result.images)
            content.append(_text(" ".join([f"Images saved in the workspace: {paths}", *skipped])))
        return types.CallToolResult(content=content)

    async def _image_blocks(self, images: list[Path]) -> tuple[list[types.ContentBlock], list[str]]:
        """The PNGs of a cell's images, and a note for each one that is not shown."""
        blocks: list[types.ContentBlock] = []
        skipped: list[str] = []
        for image in images:
            try:
                data = _output.read_image(image, self.workspace)
            except ConfinedPathError as exc:
                skipped.append(f"[The image {image.name} was not read back: {exc}]")
                continue
            try:
                # Decoding and scaling are CPU work: off the event loop, two at a time at most.
                encoded = await anyio.to_thread.run_sync(_output.scaled_png, data, limiter=_IMAGE_WORKERS)
            except _output.ImageSkipped as exc:
                skipped.append(f"Image {self._relative(image)} is not shown: {exc}.")
                continue
            blocks.append(types.ImageContent(type="image", data=encoded, mime_type="image/png"))
        return blocks, skipped

    def _relative(self, path: Path) -> Path:
        try:
            return path.resolve().relative_to(self.workspace.resolve())
        except ValueError:
            return path
