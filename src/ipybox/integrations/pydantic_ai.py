"""ipybox as a pydantic-ai toolset: a model runs Python in a stateful, optionally sandboxed kernel.

Install with ``pip install 'ipybox[pydantic-ai]'``. `IpyboxToolset` is an ``AbstractToolset``
(through ``FunctionToolset``, which derives each tool's schema from its signature) rather than a
capability: what it adds to an agent is tools, their instructions and a lifecycle around the run,
which is a toolset's whole job, and a toolset also works wrapped (``PrefixedToolset``,
``ApprovalRequiredToolset``), passed per run (``agent.run(toolsets=[...])``) or inside the
``Toolset`` capability.

Tool calls that code in a cell makes are decided while the cell waits, by the ``approve`` callback
(or by ipybox policy rules first). pydantic-ai's deferred tool approvals are not used for them: a
deferred approval ends the agent run and resumes it later with the decision, but a call made from
inside a running cell cannot wait for another run, as the kernel is blocked mid-cell with its
state. The model's own call of ``run_cell`` can still be deferred with pydantic-ai's
``ApprovalRequiredToolset`` around this toolset: that asks before a cell starts, not inside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ipybox.integrations._common import Approve, check_version, refuse_options_for_a_given_executor, run_cell

# The range of the ``pydantic-ai`` extra in pyproject.toml (a test keeps the two the same).
SUPPORTED = ">=2.60,<3"
check_version("pydantic-ai-slim", SUPPORTED, "pydantic-ai")

from pydantic_ai import BinaryContent  # noqa: E402  (the version is checked first)
from pydantic_ai.exceptions import ToolFailed  # noqa: E402
from pydantic_ai.toolsets import FunctionToolset  # noqa: E402

from ipybox.app.approval import Policy  # noqa: E402
from ipybox.app.executor import CodeExecutor  # noqa: E402

__all__ = ["SUPPORTED", "IpyboxToolset"]

_INSTRUCTIONS = """\
You can run Python code in a stateful IPython kernel with the `run_cell` tool: variables, imports and \
definitions persist between cells; print what you need to see; figures you show come back as images; \
top-level `await` works. `reset_kernel` starts over with an empty kernel. Typed Python APIs of MCP \
servers are in the `mcptools` package: `search_tools` finds the tool for a need and shows how to import \
and call it (`module.run(module.Params(...))`). A tool call can be rejected by the application: it then \
raises in your code."""

_SEARCH = """\
from ipybox.tool_exec.search import search_tools as __ipybox_search
print("\\n".join(f"{{rank}}. {{match}}" for rank, match in enumerate(__ipybox_search({query!r}, limit={limit!r}), 1)) or "No tool matches; try other words.")
del __ipybox_search
"""


class IpyboxToolset(FunctionToolset[Any]):
    """Tools for a pydantic-ai agent to run Python in an ipybox kernel: `run_cell`,
    `reset_kernel` and `search_tools`.

    Without `executor`, the toolset makes its own `CodeExecutor` and starts it when the agent run
    enters the toolset and stops it when the run ends; enter the toolset yourself
    (``async with toolset:``) to keep one kernel, and its state, across several runs. An executor
    passed in is the application's: it must be started, and the toolset never stops it.

    Example:
        .. code-block:: python

            toolset = IpyboxToolset(sandbox=True, approve=ask_the_user)
            agent = Agent("anthropic:claude-sonnet-4-5", toolsets=[toolset])
            result = await agent.run("Plot the first 20 Fibonacci numbers.")

    Args:
        executor: A started executor to run cells on, or ``None`` to make one from the options below.
        approve: Decides each MCP tool call (and shell command) a cell makes, while the cell waits
            (`ipybox.integrations.Approve`); ``None`` accepts every call the policy lets through.
        policy: ipybox policy rules, applied before `approve` is asked (``allow`` runs a call
            unasked, ``deny`` refuses it); only for an executor the toolset makes.
        sandbox: Run the kernel in the sandbox (see `CodeExecutor`); only for an executor the toolset makes.
        working_dir: The kernel's working directory, where ``mcptools/`` is; only for an executor
            the toolset makes.
        timeout: Seconds a cell may run; past them it is interrupted and the model told so.
        max_output_chars: Longest output the model gets from one cell (its head and tail are kept).
        id: The toolset's id among the agent's toolsets.

    Raises:
        ValueError: If `executor` is given together with options for an executor to make.
    """

    def __init__(
        self,
        executor: CodeExecutor | None = None,
        *,
        approve: Approve | None = None,
        policy: Policy | None = None,
        sandbox: bool = False,
        working_dir: Path | str | None = None,
        timeout: float = 120,
        max_output_chars: int = 20_000,
        id: str | None = "ipybox",
    ) -> None:
        refuse_options_for_a_given_executor("IpyboxToolset", executor, policy, sandbox, working_dir)
        super().__init__(sequential=True, id=id, instructions=_INSTRUCTIONS)
        self._given = executor
        self._executor = executor or CodeExecutor(sandbox=sandbox, working_dir=working_dir, policy=policy)
        self._approve = approve
        self._timeout = timeout
        self._max_output_chars = max_output_chars
        self._entered = 0
        self.add_function(self.run_cell, takes_ctx=False)
        self.add_function(self.reset_kernel, takes_ctx=False)
        self.add_function(self.search_tools, takes_ctx=False)

    @property
    def executor(self) -> CodeExecutor:
        """The executor cells run on."""
        return self._executor

    async def __aenter__(self) -> IpyboxToolset:
        if self._entered == 0 and self._given is None:
            await self._executor.start()
        self._entered += 1
        return self

    async def __aexit__(self, *args: Any) -> bool | None:
        self._entered -= 1
        if self._entered == 0 and self._given is None:
            await self._executor.stop()
        return None

    async def run_cell(self, code: str) -> str | list[str | BinaryContent]:
        """Run Python code in the IPython kernel and return what it printed, and the figures it showed.

        Args:
            code: Python code; variables from earlier cells are defined, top-level `await` works.
        """
        outcome = await run_cell(self._executor, code, self._approve, self._timeout, self._max_output_chars)
        if outcome.error is not None:
            raise ToolFailed(outcome.for_model())
        if not outcome.images:
            return outcome.for_model()
        images = [BinaryContent(data=path.read_bytes(), media_type="image/png") for path in outcome.images]
        return [outcome.for_model(), *images]

    async def reset_kernel(self) -> str:
        """Start over with a fresh, empty kernel: every variable, import and definition is gone."""
        await self._executor.reset()
        return "The kernel was reset: it is empty now."

    async def search_tools(self, query: str, limit: int = 5) -> str:
        """Find the MCP tools in `mcptools` that fit a need, best first, with how to import and call each.

        Args:
            query: What the tool should do, in words, e.g. 'create an issue in a repository'.
            limit: How many matches at most (1 to 50).
        """
        # Through `approve` too: kernel code may have replaced the search with tool calls of its own.
        code = _SEARCH.format(query=query, limit=limit)
        outcome = await run_cell(self._executor, code, self._approve, self._timeout, self._max_output_chars)
        if outcome.error is not None:
            raise ToolFailed(outcome.error.strip().splitlines()[-1])
        return outcome.for_model()
