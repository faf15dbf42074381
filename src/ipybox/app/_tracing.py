"""OpenTelemetry traces of cells, tool calls, approval waits and MCP server starts (opt-in).

Imported only when tracing is on (``CodeExecutor(tracing=...)``, ``ipybox --otel``): with tracing
off, no part of ipybox imports OpenTelemetry for it, and the executor and tool server skip every
span behind one ``is None`` check.

A trace shows which cell made which calls: the executor records the span of the cell it runs, one
at a time per kernel, and the tool server makes each call's span a child of that span. Nothing the
kernel sends is used to place a span, so code in the kernel cannot attach its calls to another
executor's (or session's) trace.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

if TYPE_CHECKING:
    from opentelemetry.trace import Span, TracerProvider

__all__ = ["Tracing", "configure_otlp"]

T = TypeVar("T")

CELL = "ipybox.execute"
TOOL_CALL = "ipybox.tool_call"
APPROVAL = "ipybox.approval"
SERVER_START = "ipybox.mcp_server.start"
_CODE_CHARS = 2000
# Server and tool names come from the kernel's request before they are checked, and an error's
# message from the cell: a span keeps this much of each, whatever the kernel sends.
_NAME_CHARS = 200
_ERROR_CHARS = 2000


class Tracing:
    """The spans of one executor.

    Args:
        provider: Where spans go; ``None`` for OpenTelemetry's global tracer provider.
    """

    def __init__(self, provider: TracerProvider | None = None) -> None:
        from importlib.metadata import version

        self._tracer = trace.get_tracer("ipybox", version("ipybox"), tracer_provider=provider)
        self.cell: Span | None = None

    def start_cell(self, code: str) -> Span:
        """Start the span of a cell (a child of the caller's current span) and make it the parent of
        the tool calls that arrive until `end_cell`."""
        span = self._tracer.start_span(
            CELL,
            attributes={"ipybox.code": code[:_CODE_CHARS], "ipybox.code.length": len(code)},
        )
        self.cell = span
        return span

    def end_cell(self, span: Span, error: BaseException | None) -> None:
        if self.cell is span:
            self.cell = None
        # GeneratorExit: the caller stopped reading after the result (execute() does).
        if error is not None and not isinstance(error, GeneratorExit):
            # The message may be the cell's whole traceback: kept in part, and out of the stack trace
            # (the application's frames only).
            text = str(error)
            frames = "".join(traceback.format_tb(error.__traceback__))[-4 * _ERROR_CHARS :]
            span.record_exception(
                error,
                attributes={
                    "exception.message": text[:_ERROR_CHARS],
                    "exception.stacktrace": f"{frames}{type(error).__qualname__}",
                },
            )
            span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {text[:500]}")
        span.end()

    async def tool_call(
        self, server_name: str, tool_name: str, call: Awaitable[tuple[int, bytes]]
    ) -> tuple[int, bytes]:
        """Run a tool call (its status and answer) in a span under the running cell's."""
        parent = trace.set_span_in_context(self.cell) if self.cell is not None else otel_context.Context()
        attributes = _names(server_name, tool_name)
        with self._tracer.start_as_current_span(TOOL_CALL, context=parent, attributes=attributes) as span:
            status, answer = await call
            span.set_attribute("ipybox.status", status)
            if status >= 400:
                span.set_status(trace.StatusCode.ERROR, f"HTTP {status}")
            return status, answer

    async def approval(
        self, server_name: str, tool_name: str, decision: Awaitable[tuple[bool, bool, bool, str]]
    ) -> tuple[bool, bool, bool, str]:
        """Wait for an approval decision (``(accepted, remember, abandoned, by)``) in a span of its own
        (under the tool call's, or the cell's for a shell command)."""
        with self._span(APPROVAL, _names(server_name, tool_name)) as span:
            outcome = await decision
            span.set_attribute("ipybox.accepted", outcome[0])
            return outcome

    async def server_start(self, server_name: str, start: Awaitable[T]) -> T:
        """Start an MCP server in a span (under the tool call that needed it)."""
        with self._span(SERVER_START, {"ipybox.server": server_name[:_NAME_CHARS]}):
            return await start

    @contextmanager
    def _span(self, name: str, attributes: dict[str, Any]) -> Iterator[Span]:
        current = trace.get_current_span()
        parent = None
        if not current.get_span_context().is_valid:
            parent = trace.set_span_in_context(self.cell) if self.cell is not None else otel_context.Context()
        with self._tracer.start_as_current_span(name, context=parent, attributes=attributes) as span:
            yield span


def _names(server_name: str, tool_name: str) -> dict[str, str]:
    return {"ipybox.server": server_name[:_NAME_CHARS], "ipybox.tool": tool_name[:_NAME_CHARS]}


def configure_otlp(service_name: str = "ipybox") -> TracerProvider:
    """Send spans over OTLP/HTTP as OpenTelemetry's ``OTEL_EXPORTER_OTLP_*`` variables say (default
    ``http://localhost:4318``), from a tracer provider made the global one.

    Raises:
        ImportError: The OpenTelemetry SDK is not installed (``pip install 'ipybox[otel]'``).
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = SdkTracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider
