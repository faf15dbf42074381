"""CodeExecutor end to end: real gateway, kernels, tool server and MCP servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from ipybox import (
    ApprovalRequest,
    CodeExecutionChunk,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)
from ipybox.app.kernels import KernelHost
from ipybox.errors import ApprovalDecisionError, KernelConnectionError
from tests.conftest import DEMO_SERVER, TOOL_SERVER_CLIENT, command_line
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[3]
DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=[
        "unsandboxed",
        pytest.param("sandboxed", marks=pytest.mark.slow),  # a sandboxed start is slow
        pytest.param("stdin", marks=pytest.mark.slow),
    ],
)
async def executor(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[CodeExecutor]:
    """Every test that takes it runs three times: with the kernel as the application's user, in srt,
    and with tool calls over the kernel's stdin channel (as a kernel on another host makes them)."""
    sandbox = request.param == "sandboxed"
    if sandbox:
        require_sandbox()
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(
        images_dir=workdir / "images",
        kernel_env={"GREETING": "hello"},
        sandbox=sandbox,
        tool_channel="stdin" if request.param == "stdin" else "http",
    ) as ex:
        yield ex


async def collect(ex: CodeExecutor, code: str, decide: bool | None = True, **kwargs: object) -> list[object]:
    items: list[object] = []
    async for item in ex.stream(code, **kwargs):  # type: ignore[arg-type]
        items.append(item)
        if isinstance(item, ApprovalRequest) and decide is not None:
            await (item.accept() if decide else item.reject())
    return items


async def test_execute_returns_output_and_state_persists(executor: CodeExecutor) -> None:
    await executor.execute("counter = 41")
    result = await executor.execute("counter += 1\nprint(counter)")
    assert result == CodeExecutionResult(text="42", images=[])


@pytest.mark.slow
async def test_tool_calls_surface_as_approval_requests_and_return_typed_results(
    executor: CodeExecutor,
) -> None:
    code = """
from mcptools.demo import add, echo
total = add.run(add.Params(a=2, b=3))
print(type(total).__name__, total.sum)
print(echo.run(echo.Params(text="hi")))
"""
    items = await collect(executor, code)
    requests = [i for i in items if isinstance(i, ApprovalRequest)]
    assert [(r.server_name, r.tool_name, r.tool_args) for r in requests] == [
        ("demo", "add", {"a": 2, "b": 3}),
        ("demo", "echo", {"text": "hi"}),
    ]
    assert items[-1] == CodeExecutionResult(text="Result 5\nhi", images=[])


async def test_tool_calls_compose_in_loops_and_conditionals(executor: CodeExecutor) -> None:
    code = """
from mcptools.demo import add
total = 0
for n in range(5):
    if n % 2 == 0:
        total = add.run(add.Params(a=total, b=n)).sum
print(total)
"""
    result = await executor.execute(code)
    assert result.text == "6"


async def test_a_rejected_call_ends_the_code_with_an_error_saying_rejected(executor: CodeExecutor) -> None:
    code = "from mcptools.demo import echo\necho.run(echo.Params(text='no'))"
    with pytest.raises(CodeExecutionError, match="rejected") as info:
        await collect(executor, code, decide=False)
    assert info.value.ename == "ToolRunnerError"


async def test_a_rejected_call_shows_the_agents_line_and_the_error_not_ipyboxs_frames(
    executor: CodeExecutor,
) -> None:
    code = "from mcptools.demo import echo\nx = 1\necho.run(echo.Params(text='no'))"
    with pytest.raises(CodeExecutionError) as info:
        await collect(executor, code, decide=False)
    traceback = info.value.traceback
    assert "echo.run(echo.Params(text='no'))" in traceback
    assert "ToolRunnerError: Tool call demo.echo was rejected by the application." in traceback
    for internal in ("run_tool", "run_sync", "_result", "ipybox/tool_exec", "mcptools/demo/echo.py"):
        assert internal not in traceback
    assert len(traceback.splitlines()) <= 12, traceback
    assert (info.value.ename, info.value.evalue) == (
        "ToolRunnerError",
        "Tool call demo.echo was rejected by the application.",
    )


async def test_params_that_do_not_validate_show_the_agents_line_and_the_error_not_pydantics_frames(
    executor: CodeExecutor,
) -> None:
    with pytest.raises(CodeExecutionError) as info:
        await executor.execute("from mcptools.demo import add\nadd.Params(a='x', b=2)")
    traceback = info.value.traceback
    assert "add.Params(a='x', b=2)" in traceback and "int_parsing" in traceback
    assert "pydantic" not in traceback.split("ValidationError:")[0], traceback
    assert info.value.ename == "ValidationError"


async def test_run_takes_a_dict_of_the_params_fields_and_refuses_unknown_ones(executor: CodeExecutor) -> None:
    result = await executor.execute("from mcptools.demo import add\nprint(add.run({'a': 1, 'b': 2}))")
    assert result.text == "sum=3"
    with pytest.raises(CodeExecutionError) as info:
        await executor.execute("add.run({'a': 1, 'b': 2, 'c': 3})")
    assert info.value.ename == "ValidationError" and "extra_forbidden" in info.value.traceback
    assert "pydantic" not in info.value.traceback.split("ValidationError:")[0], info.value.traceback
    with pytest.raises(CodeExecutionError) as info:
        await executor.execute("await add.arun([1, 2])")
    assert info.value.ename == "TypeError"
    assert info.value.evalue == (
        "arun() takes a mcptools.demo.add.Params, or a dict of its fields, not list: call it as arun(Params(...))."
    )


async def test_a_traceback_inside_a_comprehension_shows_the_comprehensions_lines(
    executor: CodeExecutor,
) -> None:
    code = "def inverse(x):\n    return 1 / x\n\nvalues = [\n    inverse(i)\n    for i in [1, 0]\n]"
    with pytest.raises(CodeExecutionError) as info:
        await executor.execute(code)
    frames = info.value.traceback.split("\n\n")
    (comprehension,) = [frame for frame in frames if "<listcomp>" in frame or "<genexpr>" in frame]
    assert "----> 5     inverse(i)" in comprehension, info.value.traceback


async def test_a_server_that_fails_to_start_tells_the_kernel_why_without_its_secrets(
    executor: CodeExecutor, workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Registered while it works; later it fails at start, printing its ${VAR}-filled key to stderr.
    # Its flag lies outside the working directory: a sandboxed kernel's server may name nothing there.
    monkeypatch.setenv("IPYBOX_TEST_FLAKY_KEY", "sk-flaky-secret-value")
    flag = tmp_path / "flaky-works"
    flag.touch()
    script = (
        "import os, sys\n"
        f"if os.path.exists({str(flag)!r}):\n"
        f"    os.execv(sys.executable, [sys.executable, {str(DEMO_SERVER)!r}])\n"
        "print('refused key', os.environ['KEY'], file=sys.stderr)\n"
        "sys.exit(2)\n"
    )
    params = {"command": sys.executable, "args": ["-c", script], "env": {"KEY": "${IPYBOX_TEST_FLAKY_KEY}"}}
    await generate_mcp_sources("flaky", params, workdir / "mcptools")
    flag.unlink()
    with pytest.raises(CodeExecutionError) as info:
        await executor.execute("from mcptools.flaky import echo\necho.run(echo.Params(text='x'))")
    assert info.value.ename == "ToolRunnerError"
    assert "exited with code 2" in info.value.evalue and "refused key ***" in info.value.evalue
    assert "sk-flaky-secret-value" not in str(info.value) + info.value.traceback


async def test_kernel_env_with_a_value_that_is_not_a_string_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match=r"kernel_env\['DEBUG'\] is 1 \(int\).*\{'DEBUG': '1'\}"):
        CodeExecutor(kernel_env={"DEBUG": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="kernel_env has the name 'A=B'"):
        CodeExecutor(kernel_env={"A=B": "x"})


async def test_a_rejected_call_can_be_caught_by_the_code(executor: CodeExecutor) -> None:
    code = """
from mcptools.demo import echo
from ipybox.tool_exec.client import ToolRunnerError
try:
    echo.run(echo.Params(text="no"))
except ToolRunnerError as e:
    print("caught", e.kind)
"""
    items = await collect(executor, code, decide=False)
    assert items[-1] == CodeExecutionResult(text="caught rejected", images=[])


async def test_a_failing_tool_reports_the_servers_message(executor: CodeExecutor) -> None:
    code = "from mcptools.demo import fail\nfail.run(fail.Params(message='disk full'))"
    with pytest.raises(CodeExecutionError, match="disk full"):
        await executor.execute(code)


async def test_chunks_arrive_while_output_is_produced(executor: CodeExecutor) -> None:
    items = await collect(executor, "print('chunk 1')\nprint('chunk 2')", chunks=True)
    chunks = [i.text for i in items if isinstance(i, CodeExecutionChunk)]
    assert "".join(chunks) == "chunk 1\nchunk 2\n"
    assert items[-1] == CodeExecutionResult(text="chunk 1\nchunk 2", images=[])


async def test_plots_come_back_as_png_files(executor: CodeExecutor, workdir: Path) -> None:
    result = await executor.execute(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert len(result.images) == 1
    assert result.images[0].parent == workdir / "images"
    assert result.images[0].read_bytes().startswith(b"\x89PNG")


async def test_a_figure_shown_under_a_backend_that_only_draws_to_files_comes_back(
    executor: CodeExecutor,
) -> None:
    code = (
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\nplt.show()\nprint('shown')"
    )
    try:
        result = await executor.execute(code)
        assert result.text == "shown"
        assert len(result.images) == 1 and result.images[0].read_bytes().startswith(b"\x89PNG")
        after = await executor.execute("print(len(plt.get_fignums()))")
        assert (after.text, after.images) == ("0", [])
    finally:
        await executor.execute("matplotlib.use('module://matplotlib_inline.backend_inline')")


async def test_kernel_env_reaches_the_kernel(executor: CodeExecutor) -> None:
    result = await executor.execute("import os\nprint(os.environ['GREETING'], os.getcwd())")
    assert result.text == f"hello {Path.cwd()}"


async def test_timeout_interrupts_and_the_executor_keeps_its_state(executor: CodeExecutor) -> None:
    await executor.execute("survivor = 'yes'")
    with pytest.raises(TimeoutError):
        await executor.execute("import time\ntime.sleep(30)", timeout=1)
    assert (await executor.execute("print(survivor)")).text == "yes"


async def test_timeout_covers_time_spent_waiting_for_approval(executor: CodeExecutor) -> None:
    code = "from mcptools.demo import echo\necho.run(echo.Params(text='slow decision'))"
    with pytest.raises(TimeoutError):
        await collect(executor, code, decide=None, timeout=1)
    assert (await executor.execute("print('usable')")).text == "usable"


async def test_cancel_stops_a_running_execution_from_another_task(executor: CodeExecutor) -> None:
    await executor.execute("kept_after_cancel = 1")
    running = asyncio.Event()

    async def run() -> list[object]:
        items: list[object] = []
        async for item in executor.stream(
            "import time\nprint('started', flush=True)\ntime.sleep(30)", chunks=True
        ):
            items.append(item)
            running.set()
        return items

    execution = asyncio.create_task(run())
    await running.wait()
    await executor.cancel()
    with pytest.raises(CodeExecutionError) as info:
        await execution
    assert info.value.ename == "KeyboardInterrupt"
    assert (await executor.execute("print(kept_after_cancel)")).text == "1"


async def test_cancel_right_after_the_execution_was_submitted_still_lands(executor: CodeExecutor) -> None:
    execution = asyncio.create_task(executor.execute("import time\ntime.sleep(30)"))
    # Private: the lock, taken on the task's first step, is the only sign the execution began.
    while not executor.busy:  # noqa: ASYNC110
        await asyncio.sleep(0)
    await executor.cancel()
    with pytest.raises(CodeExecutionError, match="KeyboardInterrupt"):
        await execution


async def test_a_cancel_landing_in_an_ipython_hook_still_stops_the_cell(executor: CodeExecutor) -> None:
    """IPython runs its pre-execution hooks after the request was announced and swallows a
    KeyboardInterrupt raised in one ("Error in callback"), then ran the cell anyway: a cancel
    that landed there was lost (about 1 in 50 cancels right after submitting, under load).
    The hook here returns once the interrupt has arrived, so the interrupt always lands in it."""
    # private: an interrupt that lands in the hook before its spy is installed is held by ipybox's
    # handler (`_InterruptReplies.held`, the owner of the wrapped `events.trigger`); it has arrived
    # too, or the hook would wait for a second one for ever (seen once in 10 runs under load). One
    # that lands before the hooks stops the cell there, and the hook must not wait in the next one.
    await executor.execute(
        "import signal, time\n"
        "def _until_interrupted(info):\n"
        "    get_ipython().events.unregister('pre_run_cell', _until_interrupted)\n"
        "    if info.raw_cell != 'cell_ran = True':\n"
        "        return  # the interrupt stopped that cell before its hooks: this is the next one\n"
        "    replies = get_ipython().events.trigger.__self__\n"
        "    arrived, handler = [], signal.getsignal(signal.SIGINT)\n"
        "    def spy(signum, frame):\n"
        "        arrived.append(signum)\n"
        "        handler(signum, frame)\n"
        "    signal.signal(signal.SIGINT, spy)\n"
        "    try:\n"
        "        while not arrived and not replies.held:\n"
        "            time.sleep(0.01)\n"
        "    finally:\n"
        "        signal.signal(signal.SIGINT, handler)\n"
        "get_ipython().events.register('pre_run_cell', _until_interrupted)"
    )
    execution = asyncio.create_task(executor.execute("cell_ran = True"))
    # Private: the lock, taken on the task's first step, is the only sign the execution began.
    while not executor.busy:  # noqa: ASYNC110
        await asyncio.sleep(0)
    await executor.cancel()
    with pytest.raises(CodeExecutionError, match="KeyboardInterrupt"):
        await execution
    assert (await executor.execute("print('cell_ran' in globals())")).text == "False"


async def test_cancels_landing_anywhere_in_an_execution_always_end_it(executor: CodeExecutor) -> None:
    """An interrupt that lands before the cell's code runs or after it ends still ends the
    execution: ipykernel dropped such a request's reply, and the execution hung (seen under load)."""
    for round_ in range(40):
        execution = asyncio.create_task(executor.execute(f"x = {round_}"))
        # Private: the lock, taken on the task's first step, is the only sign the execution began.
        while not executor.busy:  # noqa: ASYNC110
            await asyncio.sleep(0)
        # Spread over the whole execution: some before the kernel starts it, some during, some after.
        for _ in range(round_ % 8):
            await asyncio.sleep(0)
        await executor.cancel()
        try:
            result = await asyncio.wait_for(execution, 60)
        except CodeExecutionError as exc:
            assert exc.ename == "KeyboardInterrupt", exc
        else:
            assert result.text is None
    assert (await executor.execute("print('next')")).text == "next"


async def test_a_second_stream_waits_for_the_first(executor: CodeExecutor) -> None:
    first = asyncio.create_task(executor.execute("import time\ntime.sleep(0.5)\nprint('first')"))
    second = asyncio.create_task(executor.execute("print('second')"))
    assert [r.text for r in await asyncio.gather(first, second)] == ["first", "second"]


@pytest.mark.slow
async def test_reset_clears_state_and_restarts_mcp_servers(executor: CodeExecutor) -> None:
    code = "from mcptools.demo import pid\nprint(pid.run(pid.Params()))"
    before = (await executor.execute(code)).text
    await executor.execute("doomed = 1")
    await executor.reset()
    after = (await executor.execute(code)).text
    assert before != after
    assert (await executor.execute("print('doomed' in dir())")).text == "False"


async def test_a_dead_kernel_is_reported_and_replaced(executor: CodeExecutor) -> None:
    with pytest.raises(CodeExecutionError, match="kernel died"):
        await executor.execute("import os\nos._exit(1)")
    assert (await executor.execute("print('replaced')")).text == "replaced"


async def test_the_kernel_cannot_run_unregistered_servers_or_approve_calls(
    executor: CodeExecutor, workdir: Path
) -> None:
    """S1, S2, S4 attacked from real kernel code."""
    marker = workdir / "pwned"
    code = (
        TOOL_SERVER_CLIENT
        + f"""
forged = {{"server_name": "demo", "tool_name": "echo", "tool_args": {{"text": "x"}},
          "server_params": {{"command": "touch", "args": [{str(marker)!r}]}}}}
unknown = {{"server_name": "evil", "tool_name": "echo", "tool_args": {{}}}}
print(send("POST", "/run", forged)[0], send("POST", "/run", unknown)[0], send("POST", "/run", unknown, token=False)[0])
"""
    )
    result = await executor.execute(code)
    statuses = [int(s) for s in (result.text or "").split()]
    assert statuses[0] == 403
    assert statuses[1] == 404
    assert statuses[2] == 401
    assert not marker.exists()

    rogue = """
import asyncio, os
import websockets
async def attempt():
    url = f"ws://{os.environ['TOOL_SERVER_HOST']}:{os.environ['TOOL_SERVER_PORT']}/approval"
    headers = {"Authorization": "Bearer " + os.environ["TOOL_SERVER_TOKEN"]}
    unix = os.environ.get("TOOL_SERVER_SOCKET")
    connect = websockets.unix_connect(unix, url, additional_headers=headers) if unix else websockets.connect(url, additional_headers=headers)
    try:
        async with connect as ws:
            await ws.recv()
            return "connected"
    except websockets.InvalidStatus as e:
        return f"refused {e.response.status_code}"
print(await attempt())
"""
    assert (await executor.execute(rogue)).text == "refused 403"
    # The executor's own approval channel still works.
    assert (
        await executor.execute("from mcptools.demo import echo\nprint(echo.run(echo.Params(text='ok')))")
    ).text == "ok"


async def test_kernel_code_cannot_have_the_application_asked_about_a_tool_call_that_never_runs(
    executor: CodeExecutor,
) -> None:
    """``POST /approve`` runs nothing: it asks about the kernel's own shell commands. Naming a tool
    there would show the application a request for a call that never runs (and could prime
    "accept for the session" for it); it is refused before anyone is asked."""
    code = (
        TOOL_SERVER_CLIENT
        + """
import json
body = {"server_name": "demo", "tool_name": "echo", "tool_args": {"text": "forged"}}
status, text = send("POST", "/approve", body)
print(json.dumps([status, json.loads(text)]))
"""
    )
    asked: list[ApprovalRequest] = []
    text = None
    async for item in executor.stream(code, timeout=60):
        if isinstance(item, ApprovalRequest):
            asked.append(item)
            await item.accept()
        elif isinstance(item, CodeExecutionResult):
            text = item.text
    status, answer = json.loads(text or "null")
    assert [(r.server_name, r.tool_name) for r in asked] == []
    assert status == 400 and "asks about a shell command only" in answer["error"]["message"]


@pytest.mark.slow
async def test_secrets_in_server_params_never_reach_the_kernel(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3: a ${VAR} secret reaches the MCP server, not the kernel, the generated files or the registry."""
    secret = "s3cr3t-value-for-test"
    monkeypatch.setenv("DEMO_SECRET", secret)
    params = {**DEMO, "env": {"DEMO_SECRET": "${DEMO_SECRET}"}}
    await generate_mcp_sources("secretive", params, workdir / "mcptools")
    async with CodeExecutor() as ex:
        code = """
import os
from mcptools.secretive import getenv
print(getenv.run(getenv.Params(name="DEMO_SECRET")))
print("DEMO_SECRET" in os.environ)
"""
        result = await ex.execute(code)
    assert result.text == f"{secret}\nFalse"
    if sys.platform == "linux":
        async with CodeExecutor() as ex:
            code = (
                "import os\nprint(open(f'/proc/{os.getppid()}/environ', 'rb').read().count(b'DEMO_SECRET'))"
            )
            assert (await ex.execute(code)).text == "0"  # not even the gateway process has it
    for path in (workdir / "mcptools" / "secretive").rglob("*.py"):
        assert secret not in path.read_text()
    for path in (workdir / "state").rglob("*"):
        if path.is_file():  # the tool search's key there is binary
            assert secret.encode() not in path.read_bytes()


@pytest.mark.slow
async def test_dotenv_of_the_working_directory_is_loaded_on_start(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workdir / ".env").write_text("DOTENV_ONLY_VALUE=from-dotenv\n")
    monkeypatch.delenv("DOTENV_ONLY_VALUE", raising=False)
    params = {**DEMO, "env": {"DOTENV_ONLY_VALUE": "${DOTENV_ONLY_VALUE}"}}
    try:
        await generate_mcp_sources("dotenvdemo", params, workdir / "mcptools")
        async with CodeExecutor() as ex:
            code = "from mcptools.dotenvdemo import getenv\nprint(getenv.run(getenv.Params(name='DOTENV_ONLY_VALUE')))"
            assert (await ex.execute(code)).text == "from-dotenv"
    finally:
        (workdir / ".env").unlink()
        os.environ.pop("DOTENV_ONLY_VALUE", None)


@pytest.mark.slow
async def test_an_unanswered_approval_expires(workdir: Path) -> None:
    async with CodeExecutor(approval_timeout=0.5) as ex:
        code = "from mcptools.demo import echo\necho.run(echo.Params(text='x'))"
        with pytest.raises(CodeExecutionError, match="expired"):
            await collect(ex, code, decide=None)


@pytest.mark.slow
async def test_executors_are_independent(workdir: Path) -> None:
    async with CodeExecutor() as one, CodeExecutor() as two:
        await asyncio.gather(one.execute("who = 'one'"), two.execute("who = 'two'"))
        texts = await asyncio.gather(one.execute("print(who)"), two.execute("print(who)"))
        assert [t.text for t in texts] == ["one", "two"]
        await one.reset()
        assert (await two.execute("print(who)")).text == "two"


@pytest.mark.slow
async def test_eight_executors_started_at_once_each_get_their_own_ports(workdir: Path) -> None:
    executors = [CodeExecutor() for _ in range(8)]
    try:
        await asyncio.gather(*(ex.start() for ex in executors))
        results = await asyncio.gather(*(ex.execute(f"print({i})") for i, ex in enumerate(executors)))
        assert [r.text for r in results] == [str(i) for i in range(8)]
    finally:
        await asyncio.gather(*(ex.stop() for ex in executors))


@pytest.mark.slow
async def test_code_generated_in_another_process_works_without_configuration(workdir: Path) -> None:
    script = (
        "import asyncio, sys\nfrom pathlib import Path\nfrom ipybox import generate_mcp_sources\n"
        f"asyncio.run(generate_mcp_sources('elsewhere', {json.dumps(DEMO)}, Path('mcptools')))\n"
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", script, cwd=workdir)
    assert await asyncio.wait_for(process.wait(), 60) == 0
    async with CodeExecutor() as ex:
        code = "from mcptools.elsewhere import add\nprint(add.run(add.Params(a=1, b=1)).sum)"
        assert (await ex.execute(code)).text == "2"


@pytest.mark.slow
async def test_a_failed_start_leaves_no_process_behind(workdir: Path) -> None:
    import socket

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with socket.socket() as blocker:
        blocker.bind(("localhost", 0))
        blocker.listen()
        ex = CodeExecutor(kernel_gateway_port=blocker.getsockname()[1])
        with pytest.raises(RuntimeError, match="gateway"):
            await ex.start()
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before
    with pytest.raises(RuntimeError, match="not started"):
        await ex.execute("1")


@pytest.mark.slow
async def test_stop_leaves_no_process_behind_not_even_one_the_code_started(executor: CodeExecutor) -> None:
    # Private: the executor does not expose its gateway, whose process tree is what is checked.
    assert isinstance(executor._kernels, KernelHost) and executor._kernels.gateway.pid is not None
    fixture_gateway = psutil.Process(executor._kernels.gateway.pid)

    def running() -> set[int]:
        # The module's executor keeps its own processes coming and going (spare kernels; srt's
        # socat bridges, one per connection): only this test's executor is counted.
        theirs = {p.pid for p in fixture_gateway.children(recursive=True)} | {fixture_gateway.pid}
        return {
            p.pid
            for p in psutil.Process().children(recursive=True)
            if p.pid not in theirs and p.status() != psutil.STATUS_ZOMBIE
        }

    before = running()
    ex = CodeExecutor(sandbox=executor.settings.sandbox)
    await ex.start()
    await ex.execute("from mcptools.demo import pid\npid.run(pid.Params())")  # an MCP server runs too
    await ex.execute("import subprocess\nsleeper = subprocess.Popen(['sleep', '60'])")
    assert len(running() - before) >= 4  # gateway, kernel, MCP server, sleep
    await ex.stop()
    assert running() <= before


@pytest.mark.slow
async def test_the_quickstart_runs_offline(workdir: Path, tmp_path: Path) -> None:
    # PYTHONFAULTHANDLER: if it hangs, SIGABRT makes it print every thread's stack (below).
    env = {**os.environ, "IPYBOX_STATE_DIR": str(tmp_path / "state"), "PYTHONFAULTHANDLER": "1"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "quickstart.py"),
        "--yes",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 90)
    text = out.decode()
    assert process.returncode == 0, text
    assert "best rated: Fluent Python" in text
    assert "lent to Ada" in text


# Runs a Python program with Ctrl-C at its default, as a terminal starts it, whatever this test
# process inherited: a shell ignores SIGINT for a job it puts in the background, the ignore is
# inherited through exec, and Python then installs no KeyboardInterrupt for it (the program went on
# at its prompt: the test failed each time the suite ran as a background job).
AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
]


async def test_ctrl_c_at_the_quickstarts_prompt_ends_it(tmp_path: Path) -> None:
    # Found in a newcomer's trial: Ctrl-C at "Approve? (Y/n)" did nothing (the prompt's thread
    # held the exit until Enter was pressed), nor did a second one.
    # PYTHONFAULTHANDLER: if it hangs, SIGABRT makes it print every thread's stack (below).
    env = {**os.environ, "IPYBOX_STATE_DIR": str(tmp_path / "state"), "PYTHONFAULTHANDLER": "1"}
    process = await asyncio.create_subprocess_exec(
        *AS_FROM_A_TERMINAL,
        str(ROOT / "examples" / "quickstart.py"),
        cwd=tmp_path,
        env=env,
        stdin=asyncio.subprocess.PIPE,  # open, never written: nobody answers
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    try:
        seen = await asyncio.wait_for(process.stdout.readuntil(b"Approve? (Y/n): "), 90)
        assert b"Tool call: library.search_books" in seen
        tree = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGINT)
        try:
            rest = await asyncio.wait_for(process.stdout.read(), 60)
        except TimeoutError:
            pytest.fail(await _hung(process, tree))
        assert await process.wait() == 130, rest.decode()
        assert b"interrupted" in rest
        _, alive = await asyncio.to_thread(psutil.wait_procs, tree, timeout=60)
        assert alive == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _hung(process: asyncio.subprocess.Process, tree: list[psutil.Process]) -> str:
    """What a program that did not end after Ctrl-C was doing: the processes of its tree still
    running, and its threads' stacks (faulthandler prints them on SIGABRT)."""
    alive = [f"{p.pid} {command_line(p)[:160]}" for p in tree if p.is_running()]
    said = b""
    if process.returncode is None:
        process.send_signal(signal.SIGABRT)
        assert process.stdout is not None
        with contextlib.suppress(TimeoutError):
            said = await asyncio.wait_for(process.stdout.read(64 * 1024), 10)
    return (
        f"no end of output 60 s after Ctrl-C; quickstart running: {process.returncode is None}; "
        f"its processes still running: {alive}; it printed:\n{said.decode(errors='replace')}"
    )


async def test_the_gateway_refuses_requests_without_its_token(executor: CodeExecutor) -> None:
    import httpx2

    # Private: the gateway's port is not public; the attack needs it to talk to the gateway directly.
    assert isinstance(executor._kernels, KernelHost)
    async with httpx2.AsyncClient() as http:
        response = await http.post(f"http://localhost:{executor._kernels.gateway.port}/api/kernels", json={})
    assert response.status_code in (401, 403)


async def wait_for(predicate: Callable[[], bool], timeout: float = 20) -> None:
    """Wait on a condition that has no event of its own, under a deadline."""
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110  # polls state owned by another component
            await asyncio.sleep(0.01)


async def test_closing_a_stream_early_rejects_the_call_waiting_for_approval(executor: CodeExecutor) -> None:
    # Private: whether the tool server still holds the request is visible nowhere else.
    assert executor._tool_server is not None
    channel = executor._tool_server._channel
    code = "from mcptools.demo import echo\necho.run(echo.Params(text='abandoned'))"
    async with contextlib.aclosing(executor.stream(code)) as items:
        async for item in items:
            assert isinstance(item, ApprovalRequest)
            request = item
            break  # walk away without deciding
    await wait_for(lambda: not channel._pending)  # the tool server was told "rejected"
    # A decision after the execution ended runs nothing, and says so.
    with pytest.raises(ApprovalDecisionError, match="already rejected"):
        await request.accept()
    assert not channel._pending
    assert (await executor.execute("print('next')")).text == "next"


def gateway_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "ipybox.gateway._main" in command_line(p)]


def kill_tree(process: psutil.Process) -> None:
    for p in [*process.children(recursive=True), process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@pytest.mark.slow
async def test_a_gateway_that_died_neither_hides_the_callers_error_nor_half_resets(workdir: Path) -> None:
    before = {p.pid for p in gateway_processes()}
    async with CodeExecutor() as ex:
        # Private: the tool server's running sessions show whether its reset ran to its end.
        assert ex._tool_server is not None
        await ex.execute("from mcptools.demo import pid\npid.run(pid.Params())")
        assert ex._tool_server._sessions  # a running MCP server, for reset() to stop
        (gateway,) = [p for p in gateway_processes() if p.pid not in before]
        with pytest.raises(ValueError, match="the caller's own error"):
            async with contextlib.aclosing(
                ex.stream("print('go', flush=True)\nimport time\ntime.sleep(60)", chunks=True)
            ) as items:
                async for _ in items:
                    kill_tree(gateway)
                    raise ValueError("the caller's own error")
        with pytest.raises(KernelConnectionError):
            await ex.reset()
        assert ex._tool_server._sessions == {}  # the tool server's reset ran to its end


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sandbox", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_a_working_dir_that_does_not_exist_is_refused_at_start(tmp_path: Path, sandbox: bool) -> None:
    # Found in a newcomer's trial: the kernel silently worked in the gateway's private folder
    # instead, and a sandboxed executor's start never returned.
    if sandbox:
        require_sandbox()
    missing = tmp_path / "not-made-yet"
    executor = CodeExecutor(working_dir=missing, sandbox=sandbox)
    with pytest.raises(ValueError, match="not an existing folder; create it first"):
        await executor.start()
    assert not missing.exists()
    missing.mkdir()
    async with executor:
        assert (await executor.execute("import os\nprint(os.getcwd())")).text == str(missing)
