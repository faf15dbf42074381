"""`Cells`: running cells on an executor's kernel (`execute`, `stream`, `cancel`), one at a time.

Application side only. A `CodeExecutor` holds one `Cells`: it runs one cell at a time on the
executor's kernel, hands the tool server's approval requests to the running cell's stream (and
rejects those that come while no cell runs), turns the kernel's output into chunks and the result,
has a kernel that died mid-cell replaced by its `KernelSource`, and refuses the requests nobody
decided once the stream ends. Its lock is the executor's: a reset or a snapshot waits for the cell.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncGenerator

import anyio

from ipybox.app.approval import ApprovalRequest, abandon
from ipybox.app.executor._oversight import Oversight
from ipybox.app.executor._results import CodeExecutionChunk, CodeExecutionResult
from ipybox.app.kernels import ExecutionResult, KernelSource
from ipybox.errors import (
    ApprovalError,
    CodeExecutionError,
    ExecutionError,
    KernelConnectionError,
    KernelDiedError,
)

__all__ = ["Cells", "Item"]

Item = ApprovalRequest | CodeExecutionChunk | CodeExecutionResult
"""What `CodeExecutor.stream` yields."""


class Cells:
    """Runs one cell at a time on an executor's kernels; the cells' approval requests come out of `stream`.

    Args:
        oversight: The executor's spans (one per cell).
    """

    def __init__(self, oversight: Oversight) -> None:
        self._oversight = oversight
        # Held while a cell runs; whatever else needs the kernel to itself (reset, snapshots) takes it.
        self.lock = asyncio.Lock()
        self._requests: asyncio.Queue[Item | None] | None = None
        self._runner: asyncio.Task[None] | None = None

    async def cancel(self, kernels: KernelSource) -> None:
        """Interrupt the running cell, if any (see `CodeExecutor.cancel`)."""
        runner = self._runner
        if self.lock.locked() and runner is not None and not runner.done():
            # Sent once the kernel has started the code, however long that takes, unless the
            # execution ends first.
            await kernels.client.interrupt(wait_until_started=True, ended=runner)

    async def stream(
        self, kernels: KernelSource, code: str, timeout: float, chunks: bool
    ) -> AsyncGenerator[Item, None]:
        """Run `code` on `kernels`' kernel (see `CodeExecutor.stream`)."""
        async with self.lock:
            kernel = kernels.client
            cell_span = self._oversight.start_cell(code)
            items: asyncio.Queue[Item | None] = asyncio.Queue()  # None ends the stream
            self._requests = items
            runner = asyncio.create_task(
                self._run(kernel.stream(code, timeout=timeout), kernels, chunks, items)
            )
            self._runner = runner
            handed: list[ApprovalRequest] = []
            try:
                while (item := await items.get()) is not None:
                    if isinstance(item, ApprovalRequest):
                        # Only undecided requests are kept (a request holds its arguments): a
                        # cell making many calls does not keep them all until it ends.
                        handed = [request for request in handed if not request.decided]
                        handed.append(item)
                    yield item
                await runner
            finally:
                self._requests = None
                # Nobody is left to decide on calls still waiting, whether handed out or not:
                # refuse them now, so that a decision arriving later runs nothing.
                while not items.empty():
                    if isinstance(pending := items.get_nowait(), ApprovalRequest):
                        handed.append(pending)
                # Shielded: a caller cancelled through an anyio scope (an MCP client's cancel)
                # is cancelled again at every await, which would skip the interrupt.
                with anyio.CancelScope(shield=True):
                    for request in handed:
                        if not request.decided:
                            with contextlib.suppress(ApprovalError):
                                await abandon(request)
                    if not runner.done():
                        runner.cancel()
                        await asyncio.wait({runner})
                        with contextlib.suppress(KernelConnectionError):
                            await kernel.interrupt()
                    self._oversight.end_cell(cell_span, sys.exc_info()[1])

    async def _run(
        self,
        outputs: AsyncGenerator[str | ExecutionResult, None],
        kernels: KernelSource,
        chunks: bool,
        items: asyncio.Queue[Item | None],
    ) -> None:
        try:
            async for item in outputs:
                if isinstance(item, ExecutionResult):
                    items.put_nowait(CodeExecutionResult(text=item.text, images=item.images))
                elif chunks:
                    items.put_nowait(CodeExecutionChunk(text=item))
        except KernelDiedError as exc:
            message = await kernels.recover()
            if exc.ename == "KernelOutputTooLarge":
                message = f"{exc.evalue} {message}"
            raise CodeExecutionError(
                message, ename=exc.ename, evalue=exc.evalue, traceback=exc.traceback
            ) from exc
        except ExecutionError as exc:
            raise CodeExecutionError(
                str(exc), ename=exc.ename, evalue=exc.evalue, traceback=exc.traceback
            ) from exc
        finally:
            items.put_nowait(None)

    async def on_approval_request(self, request: ApprovalRequest) -> None:
        """Hand a tool call's approval request to the running cell's stream, or refuse it if none runs."""
        if self._requests is None:
            # No execution is running (e.g. a thread the code left behind): nobody can decide.
            await abandon(request)
        else:
            self._requests.put_nowait(request)
