"""ipybox as a smolagents code executor: ``CodeAgent(executor=IpyboxExecutor(...))``.

Install with ``pip install 'ipybox[smolagents]'``. Each step's code runs in a stateful IPython kernel
(full CPython, any installed package, optionally in the sandbox), not in smolagents' restricted
interpreter. The agent's tools are not copied into the kernel as source, as smolagents' own remote
executors do (which would run them unwatched inside the sandbox): they stay in the application and
are served to the executor's tool server as an MCP server, so a call from kernel code goes through
policy rules and the ``approve`` callback, and runs here. ``final_answer`` ends the step with its
value (sent as JSON: a value JSON cannot hold arrives as its ``str``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from ipybox.integrations._common import (
    Approve,
    CellOutcome,
    check_version,
    refuse_options_for_a_given_executor,
    run_cell,
)

# The range of the ``smolagents`` extra in pyproject.toml (a test keeps the two the same).
SUPPORTED = ">=1.24,<2"
check_version("smolagents", SUPPORTED, "smolagents")

from smolagents.local_python_executor import CodeOutput, PythonExecutor  # noqa: E402
from smolagents.serialization import SafeSerializer  # noqa: E402

from ipybox.app.approval import Policy  # noqa: E402
from ipybox.app.executor import CodeExecutor  # noqa: E402
from ipybox.app.mcp_client import ServerRegistry  # noqa: E402
from ipybox.errors import CodeExecutionError  # noqa: E402
from ipybox.integrations._app_tools import AppTool, AppToolServer  # noqa: E402
from ipybox.integrations._smolagents_kernel import FINAL_ANSWER, prelude, tool_definition  # noqa: E402

__all__ = ["SUPPORTED", "IpyboxExecutor"]

_T = TypeVar("_T")

# JSON schema types a smolagents input type maps to; others ("any", "image", "audio") take any value.
_JSON_TYPES = frozenset({"string", "boolean", "integer", "number", "array", "object", "null"})


async def _cancel_the_rest() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _input_schema(inputs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for name, spec in inputs.items():
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        kept = [kind for kind in kinds if kind in _JSON_TYPES]
        prop: dict[str, Any] = {"description": str(spec.get("description", ""))}
        if kept and len(kept) == len(kinds):
            prop["type"] = kept[0] if len(kept) == 1 and not spec.get("nullable") else [*kept, "null"]
        if "enum" in spec:
            prop["enum"] = list(spec["enum"])
        properties[name] = prop
    required = [name for name, spec in inputs.items() if not spec.get("nullable")]
    return {"type": "object", "properties": properties, "required": required}


class IpyboxExecutor(PythonExecutor):  # type: ignore[misc]  # smolagents ships no type information
    """A smolagents ``PythonExecutor`` that runs each step in an ipybox kernel.

    The executor starts when it is made (a kernel gateway, a kernel and a tool server; with
    ``sandbox=True`` the kernel runs in srt) and stops with `cleanup()`, which ``CodeAgent.cleanup()``
    and leaving ``with agent:`` call. Variables persist across steps and across runs of the agent.
    Each step gives smolagents what its other executors give: the printed output as logs, the value
    passed to ``final_answer`` as the output, and for a step that showed figures, the last one as a PIL
    image. An error in a step raises `CodeExecutionError` with the output before it and the
    traceback, which smolagents shows the model in the next step.

    Example:
        .. code-block:: python

            with CodeAgent(tools=[get_weather], model=model, executor=IpyboxExecutor(sandbox=True)) as agent:
                agent.run("Is it warmer in Paris or in Rome?")

    Args:
        executor: A `CodeExecutor` that is not started yet, for options beyond those below (it is started
            on the executor's own event loop, smolagents being synchronous, and stopped by `cleanup()`),
            or ``None`` to make one from the options below.
        approve: Decides each tool call a step makes, the agent's tools' too, while the step waits
            (`ipybox.integrations.Approve`; a plain function runs in a worker thread and may block);
            ``None`` accepts every call the policy lets through.
        policy: ipybox policy rules, applied before `approve` is asked; only for an executor made here.
        sandbox: Run the kernel in the sandbox; only for an executor made here.
        working_dir: The kernel's working directory; only for an executor made here.
        timeout: Seconds a step may run; past them it is interrupted and fails.
        max_output_chars: Longest output of one step kept for the model (its head and tail).

    Raises:
        ValueError: If `executor` is given together with options for an executor to make, or is
            already started.
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
        max_output_chars: int = 50_000,
    ) -> None:
        refuse_options_for_a_given_executor("IpyboxExecutor", executor, policy, sandbox, working_dir)
        self._approve = approve
        self._timeout = timeout
        self._max_output_chars = max_output_chars
        self._final_answer: Any = None
        self._registry_dir: Path | None = None
        if executor is None:
            # A registry of its own: the served tools' entry (with its token) is for this executor only.
            self._registry_dir = Path(tempfile.mkdtemp(prefix="ipybox-smolagents-"))
            registry = ServerRegistry(self._registry_dir / "servers.json")
            executor = CodeExecutor(
                sandbox=sandbox, working_dir=working_dir, policy=policy, registry=registry
            )
            self._tools = AppToolServer("smolagents")
        else:
            self._tools = AppToolServer(f"smolagents_{id(self):x}")
        # The executor's own state, as CodeExecutor has no public flag for it: a started one runs on
        # another event loop, which this one cannot drive.
        if executor._kernels is not None:
            raise ValueError(
                "IpyboxExecutor got a CodeExecutor that is already started, on another event loop; pass one "
                "that is not started: IpyboxExecutor starts it on its own loop and stops it at cleanup()."
            )
        self.executor = executor
        # smolagents is synchronous: the executor runs on an event loop of its own, in a daemon
        # thread (a worker thread would hold the interpreter at exit when cleanup() was forgotten;
        # then the atexit hook stops it, and the gateway also ends with this process).
        self._loop: asyncio.AbstractEventLoop | None = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ipybox-smolagents", daemon=True)
        self._thread.start()
        try:
            self._on_loop(self._start())
        except BaseException:
            self._close_loop()
            raise
        atexit.register(self.cleanup)

    @property
    def tools_server_name(self) -> str:
        """The MCP server name the agent's tools have in approval requests and policy rules."""
        return self._tools.server_name

    async def _start(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await self.executor.start()
            stack.push_async_callback(self.executor.stop)
            scope = self.executor.settings.working_dir or Path.cwd().resolve()
            await self._tools.start(self.executor.registry, scope)
            stack.push_async_callback(self._tools.stop)
            await self._run(prelude())
            stack.pop_all()

    async def _stop(self) -> None:
        # The executor first: its tool server then closes its session with the served tools.
        try:
            await self.executor.stop()
        finally:
            await self._tools.stop()

    def _on_loop(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("The IpyboxExecutor was cleaned up; make a new one.")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _close_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            # What the served tools' server left running (a session's watcher) ends with the loop.
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join()
            loop.close()
        if self._registry_dir is not None:
            shutil.rmtree(self._registry_dir, ignore_errors=True)

    def cleanup(self) -> None:
        """Stop the executor (kernel, tool server) and the served tools; calling it again does nothing."""
        if self._loop is None:
            return
        atexit.unregister(self.cleanup)
        try:
            self._on_loop(self._stop())
        finally:
            self._close_loop()

    def __enter__(self) -> IpyboxExecutor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()

    def _call(self, code: str) -> CellOutcome:
        return self._on_loop(
            run_cell(self.executor, code, self._approve, self._timeout, self._max_output_chars)
        )

    async def _run(self, code: str) -> None:
        outcome = await run_cell(self.executor, code, None, self._timeout, self._max_output_chars)
        if outcome.error is not None:
            raise CodeExecutionError(f"ipybox could not set up the kernel for smolagents:\n{outcome.error}")

    def send_tools(self, tools: dict[str, Any]) -> None:
        """Serve the agent's tools from the application and define a caller of each in the kernel.

        ``final_answer`` is kept in the application: the kernel's ``final_answer`` ends the step, and
        the agent's ``final_answer`` tool then runs here on the value.

        Raises:
            ValueError: A tool's name is not a Python identifier.
        """
        self._final_answer = tools.get("final_answer")
        served = {name: tool for name, tool in tools.items() if name != "final_answer"}
        definitions = "".join(
            tool_definition(self._tools.server_name, name, list(getattr(tool, "inputs", {}) or {}))
            for name, tool in served.items()
        )
        self._tools.set_tools(
            [
                AppTool(
                    name=name,
                    description=str(getattr(tool, "description", "")),
                    input_schema=_input_schema(getattr(tool, "inputs", {}) or {}),
                    call=tool,
                )
                for name, tool in served.items()
            ]
        )
        self._check(self._call(prelude() + definitions))

    def send_variables(self, variables: dict[str, Any]) -> None:
        """Define `variables` in the kernel (serialised as JSON with smolagents' safe serializer, never pickled)."""
        if not variables:
            return
        serialized = SafeSerializer.dumps(variables, allow_pickle=False)
        code = (
            f"{SafeSerializer.get_deserializer_code(False)}\n"
            f"globals().update(_deserialize({serialized!r}))\n"
            "del _deserialize, _from_json_safe, SerializationError\n"
        )
        self._check(self._call(code))

    def __call__(self, code_action: str) -> CodeOutput:
        """Run one step's code.

        Raises:
            CodeExecutionError: The code raised (or ran over `timeout`); the message holds the output
                before the error and the traceback.
        """
        outcome = self._call(code_action)
        if outcome.ename == FINAL_ANSWER:
            # The kernel's JSON: parsed, never unpickled (the kernel is untrusted).
            answer = json.loads(outcome.evalue or "null")
            if self._final_answer is not None:
                answer = self._final_answer(answer)
            return CodeOutput(output=answer, logs=outcome.text, is_final_answer=True)
        self._check(outcome)
        return CodeOutput(output=self._image(outcome), logs=outcome.text, is_final_answer=False)

    @staticmethod
    def _check(outcome: CellOutcome) -> None:
        if outcome.error is not None:
            logs = outcome.text.rstrip("\n")
            raise CodeExecutionError(
                f"{logs}\nExecuting code yielded an error:\n{outcome.error}" if logs else outcome.error,
                ename=outcome.ename or "",
            )

    @staticmethod
    def _image(outcome: CellOutcome) -> Any:
        if not outcome.images:
            return None
        from PIL import Image

        with Image.open(outcome.images[-1]) as image:
            image.load()
            return image.copy()
