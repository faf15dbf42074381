"""Running cells on a `CodeExecutor`'s kernel: `execute`, `stream` and `cancel`, one at a time.

Application side only. `_Cells` is a base of :class:`ipybox.app.executor._executor.CodeExecutor`: it runs
one cell at a time on the executor's kernel, hands the tool server's approval requests to the
running cell's stream (and rejects those that come while no cell runs), turns the kernel's output
into chunks and the result, has a kernel that died mid-cell replaced, and refuses the requests
nobody decided once the stream ends. The executor (``_executor.py``) holds the lifecycle.
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
from ipybox.app.kernels import ExecutionResult, KernelHost, RemoteKernelHost
from ipybox.app.pool import PooledKernels
from ipybox.app.tools import ToolServer
from ipybox.errors import (
    ApprovalError,
    CodeExecutionError,
    ExecutionError,
    KernelConnectionError,
    KernelDiedError,
)

_Item = ApprovalRequest | CodeExecutionChunk | CodeExecutionResult


class _Cells:
    """`CodeExecutor`'s cells: `execute`, `stream`, `cancel` and the approval requests they surface."""

    _oversight: Oversight
    # The parts `CodeExecutor.start()` makes and `stop()` drops.
    _tool_server: ToolServer | None
    _kernels: KernelHost | PooledKernels | RemoteKernelHost | None
    # The running execution: one at a time.
    _lock: asyncio.Lock
    _requests: asyncio.Queue[_Item | None] | None
    _runner: asyncio.Task[None] | None

    async def cancel(self) -> None:
        """Interrupt the running execution, if any, from another task.

        The interrupted `stream()` or `execute()` raises `CodeExecutionError` with
        ``ename == "KeyboardInterrupt"``; the kernel keeps its state.

        Raises:
            RuntimeError: If the executor is not started.
        """
        kernels, _ = self._require_started()
        runner = self._runner
        if self._lock.locked() and runner is not None and not runner.done():
            # Sent once the kernel has started the code, however long that takes, unless the
            # execution ends first.
            await kernels.client.interrupt(wait_until_started=True, ended=runner)

    async def execute(self, code: str, timeout: float = 120) -> CodeExecutionResult:
        """Run code, approving every tool call it makes, and return the result.

        Args:
            code: Python code; top-level ``await`` works.
            timeout: Seconds the whole execution may take.

        Returns:
            The complete output text and images.

        Raises:
            CodeExecutionError: If the code raised, including a failed tool call.
            TimeoutError: If the execution took longer than `timeout`; the kernel keeps
                its state and the executor stays usable.
            RuntimeError: If the executor is not started.
        """
        async with contextlib.aclosing(self.stream(code, timeout=timeout)) as items:
            async for item in items:
                if isinstance(item, ApprovalRequest):
                    await item.accept()
                elif isinstance(item, CodeExecutionResult):
                    return item
        raise AssertionError("stream() always ends with a CodeExecutionResult")  # pragma: no cover

    async def stream(
        self, code: str, timeout: float = 120, chunks: bool = False
    ) -> AsyncGenerator[_Item, None]:
        """Run code, yielding approval requests, output chunks and the final result.

        Every tool call the code makes is yielded as an `ApprovalRequest`, and waits until
        it is accepted or rejected (or `approval_timeout` passes). A rejected call raises
        inside the kernel. A second `stream()` on the same executor waits for the first.

        Args:
            code: Python code; top-level ``await`` works.
            timeout: Seconds the whole execution may take, approval waits included.
            chunks: Also yield `CodeExecutionChunk` items as output arrives.

        Yields:
            `ApprovalRequest` and (with ``chunks=True``) `CodeExecutionChunk` items, then
            one `CodeExecutionResult`.

        Raises:
            CodeExecutionError: If the code raised, a tool call was rejected or failed, or
                the kernel died (it is replaced by a fresh one; state is lost).
            TimeoutError: If the execution took longer than `timeout`; the kernel keeps
                its state and the executor stays usable.
            RuntimeError: If the executor is not started.
        """
        kernels, _ = self._require_started()
        async with self._lock:
            kernel = kernels.client
            cell_span = self._oversight.start_cell(code)
            items: asyncio.Queue[_Item | None] = asyncio.Queue()  # None ends the stream
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
        kernels: KernelHost | PooledKernels | RemoteKernelHost,
        chunks: bool,
        items: asyncio.Queue[_Item | None],
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

    async def _on_approval_request(self, request: ApprovalRequest) -> None:
        if self._requests is None:
            # No execution is running (e.g. a thread the code left behind): nobody can decide.
            await abandon(request)
        else:
            self._requests.put_nowait(request)

    def _require_started(self) -> tuple[KernelHost | PooledKernels | RemoteKernelHost, ToolServer]:
        if self._kernels is None or self._tool_server is None:
            raise RuntimeError("The code executor is not started; call start() or use 'async with'.")
        return self._kernels, self._tool_server
