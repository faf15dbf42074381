"""Tool calls over the kernel's own stdin channel (``tool_channel="stdin"``), with local executors.

What a kernel on another host uses; here the kernel is local, so that every guarantee of the HTTP
path can be checked the same way. The tests the two channels share run over both (see
``tests/app/executor/test_code_exec.py``, ``test_tool_media.py``, ``test_tool_concurrency.py``);
these are about what only this channel has: batching, interrupts mid-request, and requests forged by
cell code.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import (
    ApprovalRequest,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)

# private-ok: the channel's wire constants and its cap are internal; the attacks are sized by them.
from ipybox._wire import MAX_MESSAGE_CHARS, PROMPT_PREFIX, ToolServerEnv
from ipybox.app.tools._stdin_channel import MAX_CALLS_IN_FLIGHT
from ipybox.errors import ApprovalDecisionError
from tests.conftest import DEMO_SERVER

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def executor(workdir: Path) -> AsyncIterator[CodeExecutor]:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(images_dir=workdir / "images", tool_channel="stdin") as ex:
        yield ex


async def run(ex: CodeExecutor, code: str, decide: bool = True) -> tuple[list[ApprovalRequest], str | None]:
    """Run `code`, deciding every approval request; the requests and the output."""
    requests: list[ApprovalRequest] = []
    text: str | None = None
    async for item in ex.stream(code):
        if isinstance(item, ApprovalRequest):
            requests.append(item)
            await (item.accept() if decide else item.reject())
        elif isinstance(item, CodeExecutionResult):
            text = item.text
    return requests, text


async def test_calls_go_over_stdin_without_the_tool_servers_token(executor: CodeExecutor) -> None:
    code = f"""
import os
os.environ.pop({ToolServerEnv.TOKEN!r})
os.environ[{ToolServerEnv.PORT!r}] = "1"
from mcptools.demo import add
print(add.run(add.Params(a=2, b=3)).sum)
"""
    requests, text = await run(executor, code)
    assert text == "5"
    assert [(r.server_name, r.tool_name, r.tool_args) for r in requests] == [
        ("demo", "add", {"a": 2, "b": 3})
    ]


async def test_calls_from_threads_and_a_gather_in_one_cell_are_in_flight_together(workdir: Path) -> None:
    # The rendezvous answers only once all 12 calls wait in the MCP server together: calls sent one
    # after another, each waiting for its result, never could.
    code = """
import asyncio, threading
from mcptools.demo import rendezvous
params = rendezvous.Params(key="mixed", count=12, timeout=60)
out = []
threads = [threading.Thread(target=lambda: out.append(rendezvous.run(params))) for _ in range(6)]
for t in threads:
    t.start()
gathered = await asyncio.gather(*(rendezvous.arun(params) for _ in range(6)))
for t in threads:
    t.join()
print(sorted(out + gathered))
"""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(approve_tool_calls=False, tool_channel="stdin") as ex:
        result = await ex.execute(code, timeout=90)
    assert result.text == str(["12 together"] * 12)


async def test_resetting_the_mcp_servers_from_the_kernel_says_the_application_does_it(
    executor: CodeExecutor,
) -> None:
    # Over HTTP a kernel may reset them; the stdin channel carries tool calls only.
    code = """
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
runner = ToolRunner("demo", {})
for blocking in (True, False):
    try:
        runner.reset_sync() if blocking else await runner.reset()
    except ToolRunnerError as exc:
        print(exc.kind, str(exc))
"""
    requests, text = await run(executor, code)
    lines = (text or "").splitlines()
    assert requests == [] and len(lines) == 2
    assert all(line.startswith("failed ") and "CodeExecutor.reset()" in line for line in lines)


async def test_a_plain_input_raises_eof_error_and_reaches_no_tool(executor: CodeExecutor) -> None:
    requests, text = await run(executor, "try:\n    input('name? ')\nexcept EOFError:\n    print('EOF')")
    assert (requests, text) == ([], "EOF")


async def test_an_interrupted_call_raises_keyboard_interrupt_and_its_late_result_reaches_nobody(
    executor: CodeExecutor,
) -> None:
    # The call, accepted, waits in the MCP server for a second arrival; the cell is interrupted.
    stream = executor.stream(
        "from mcptools.demo import rendezvous\nrendezvous.run(rendezvous.Params(key='late', count=2))"
    )
    request = await anext(stream)
    assert isinstance(request, ApprovalRequest)
    await request.accept()
    cancel = asyncio.create_task(executor.cancel())
    with pytest.raises(CodeExecutionError) as info:
        async for _ in stream:
            pass
    await cancel
    assert info.value.ename == "KeyboardInterrupt"
    # The next cell's call releases the first one: its late result ("2 together") arrives now, and
    # must not be taken for this call's ("1 together").
    requests, text = await run(
        executor,
        "from mcptools.demo import rendezvous\nprint(rendezvous.run(rendezvous.Params(key='late', count=1)))",
    )
    assert text == "1 together" and len(requests) == 1
    assert (await run(executor, "from mcptools.demo import add\nprint(add.run(add.Params(a=1, b=1)).sum)"))[
        1
    ] == "2"


async def test_a_decision_after_the_cell_was_interrupted_runs_nothing(executor: CodeExecutor) -> None:
    stream = executor.stream("from mcptools.demo import echo\necho.run(echo.Params(text='never'))")
    request = await anext(stream)
    assert isinstance(request, ApprovalRequest)
    cancel = asyncio.create_task(executor.cancel())
    with pytest.raises(CodeExecutionError, match="KeyboardInterrupt"):
        async for _ in stream:
            pass
    await cancel
    with pytest.raises(ApprovalDecisionError, match="already rejected"):
        await request.accept()
    assert (await run(executor, "from mcptools.demo import echo\nprint(echo.run(echo.Params(text='next')))"))[
        1
    ] == "next"


def forged(request: object) -> str:
    """Kernel code that sends `request` as a tool call request itself and prints the reply."""
    return f"import json\nprint(input({PROMPT_PREFIX!r} + json.dumps({request!r})))"


CALL = {"id": 1, "server_name": "demo", "tool_name": "echo", "tool_args": {"text": "forged"}}


@pytest.mark.parametrize(
    ("request_", "refused_field"),
    [
        ({"calls": [{**CALL, "approved": True}], "ack": []}, "approved"),
        ({"calls": [CALL], "ack": [], "approved": True}, "approved"),
        ({"calls": [CALL], "ack": [], "kernel_id": "another-kernel"}, "kernel_id"),
        ({"calls": [{**CALL, "session": "another-session"}], "ack": []}, "session"),
        (
            {"calls": [{**CALL, "server_params": {"command": "touch", "args": ["/tmp/pwned"]}}], "ack": []},
            "server_params",
        ),
    ],
    ids=["approved-call", "approved-request", "other-kernel", "other-session", "server-params"],
)
async def test_a_forged_request_with_a_field_of_its_own_is_refused_and_nothing_is_asked_or_run(
    executor: CodeExecutor, request_: dict[str, object], refused_field: str
) -> None:
    requests, text = await run(executor, forged(request_))
    assert requests == []
    assert text is not None
    reply = json.loads(text)
    assert (
        set(reply) == {"seq", "error", "ids"}
        and refused_field in reply["error"]
        and "Extra inputs" in reply["error"]
    )


ASK = {
    "id": 1,
    "server_name": "ipybox",
    "tool_name": "shell",
    "tool_args": {"cmd": "echo hi"},
    "ask_only": True,
}


@pytest.mark.parametrize(
    ("call_", "refused"),
    [
        ({**ASK, "approved": True}, "Extra inputs"),
        ({**ASK, "decision": "accept"}, "Extra inputs"),
        ({**CALL, "ask_only": True}, "asks about a shell command only"),
        ({**ASK, "tool_name": "echo"}, "asks about a shell command only"),
        ({**ASK, "content": True}, "asks about a shell command only"),
        ({**ASK, "ask_only": 1}, "ask_only"),
    ],
    ids=["approved", "decision", "a-tool-call", "another-kind", "content", "not-a-bool"],
)
async def test_a_forged_ask_only_call_with_a_field_of_its_own_or_of_another_kind_is_refused_unasked(
    executor: CodeExecutor, call_: dict[str, object], refused: str
) -> None:
    requests, text = await run(executor, forged({"calls": [call_], "ack": []}))
    assert requests == []
    assert text is not None
    reply = json.loads(text)
    assert set(reply) == {"seq", "error", "ids"} and refused in reply["error"]


async def test_a_well_formed_ask_only_call_written_by_cell_code_only_asks_and_runs_nothing(
    executor: CodeExecutor, workdir: Path
) -> None:
    # Accepted or not, the application runs nothing for it: the kernel runs its own commands.
    marker = workdir / "ask-only-ran"
    code = f"""
import json
def results(request):
    reply = json.loads(input({PROMPT_PREFIX!r} + json.dumps(request)))
    while not reply["results"]:
        reply = json.loads(input({PROMPT_PREFIX!r} + json.dumps({{"calls": [], "ack": []}})))
    return reply["results"]
call = {{**{ASK!r}, "tool_args": {{"cmd": "touch {marker}"}}}}
print(json.dumps(results({{"calls": [call], "ack": []}})))
"""
    requests, text = await run(executor, code)
    assert [(r.server_name, r.tool_name, r.tool_args) for r in requests] == [
        ("ipybox", "shell", {"cmd": f"touch {marker}"})
    ]
    assert text is not None
    assert json.loads(text) == [{"id": 1, "status": 200, "answer": {"result": None}}]
    assert not marker.exists()
    requests, text = await run(executor, code, decide=False)
    assert json.loads(text or "")[0]["answer"]["error"]["kind"] == "rejected"
    assert not marker.exists()


async def test_shell_approval_goes_over_stdin_without_the_tool_servers_address_or_token(
    workdir: Path,
) -> None:
    async with CodeExecutor(tool_channel="stdin", approve_shell_cmds=True, working_dir=workdir) as ex:
        code = (
            f"import os\nos.environ.pop({ToolServerEnv.TOKEN!r})\nos.environ[{ToolServerEnv.PORT!r}] = '1'\n"
        )
        assert (await run(ex, code))[0] == []
        requests, text = await run(ex, "!echo hi")
        assert [(r.server_name, r.tool_name, r.tool_args) for r in requests] == [
            ("ipybox", "shell", {"cmd": "echo hi"})
        ]
        assert (text or "").strip() == "hi"
        with pytest.raises(CodeExecutionError, match="The shell command was rejected by the application"):
            await run(ex, "!touch rejected-ran", decide=False)
        assert not (workdir / "rejected-ran").exists()


async def test_a_well_formed_request_written_by_cell_code_is_asked_about_and_checked_like_any_call(
    executor: CodeExecutor,
) -> None:
    # Writing the request by hand gains nothing: the application asks about it, and the registry decides.
    code = f"""
import json
def results(request):
    reply = json.loads(input({PROMPT_PREFIX!r} + json.dumps(request)))
    while not reply["results"]:  # held for a moment at most: ask again until the result is there
        reply = json.loads(input({PROMPT_PREFIX!r} + json.dumps({{"calls": [], "ack": []}})))
    return reply["results"]
print(json.dumps(results({{"calls": [{CALL!r}], "ack": []}})))
print(json.dumps(results({{"calls": [{{**{CALL!r}, "id": 2, "server_name": "unregistered"}}], "ack": [1]}})))
"""
    requests, text = await run(executor, code, decide=False)
    assert [(r.server_name, r.tool_name, r.tool_args) for r in requests] == [
        ("demo", "echo", {"text": "forged"})
    ]
    assert text is not None
    [rejected], [unregistered] = (json.loads(line) for line in text.splitlines())
    assert (rejected["id"], rejected["status"], rejected["answer"]["error"]["kind"]) == (1, 403, "rejected")
    assert (unregistered["id"], unregistered["status"]) == (2, 404)
    assert "'unregistered' is not registered" in unregistered["answer"]["error"]["message"]


async def test_a_prompt_printed_or_published_on_iopub_is_output_and_the_next_call_gets_its_own_reply(
    executor: CodeExecutor,
) -> None:
    request = json.dumps({"calls": [CALL], "ack": []})
    code = f"""
kernel = get_ipython().kernel
parent = kernel.get_parent()
prompt = {PROMPT_PREFIX!r} + {request!r}
print(prompt + "\\a")  # BEL ends the escape sequence the prefix starts: the rest of the output stays
kernel.session.send(kernel.iopub_socket, "input_request", {{"prompt": prompt, "password": False}}, parent=parent)
kernel.session.send(kernel.iopub_socket, "input_reply", {{"value": '{{"results": []}}'}}, parent=parent)
from mcptools.demo import add
print(add.run(add.Params(a=20, b=22)).sum)
"""
    requests, text = await run(executor, code)
    assert [(r.tool_name, r.tool_args) for r in requests] == [("add", {"a": 20, "b": 22})]
    assert text is not None and text.splitlines()[-1] == "42"


async def test_a_cell_that_never_takes_its_results_cannot_have_more_calls_in_flight_than_the_limit(
    workdir: Path,
) -> None:
    # The cell writes its own requests of 100 calls each and never acknowledges a result: the
    # application keeps each (here: rejected) result for it, and counts it as in flight. An
    # executor of its own: calls of another test's cells, still running, would count too.
    code = f"""
import json
def request(n):
    calls = [{{"id": n * 100 + i, "server_name": "demo", "tool_name": "echo", "tool_args": {{"text": "x"}}}} for i in range(100)]
    return {PROMPT_PREFIX!r} + json.dumps({{"calls": calls, "ack": []}})
for n in range(3):
    reply = json.loads(input(request(n)))
print(reply["error"])
"""
    async with CodeExecutor(tool_channel="stdin") as executor:
        requests, text = await run(executor, code, decide=False)
        assert text is not None and f"200 tool calls in flight, and at most {MAX_CALLS_IN_FLIGHT}" in text
        assert len(requests) <= 200
        after = "from mcptools.demo import echo\nprint(echo.run(echo.Params(text='after')))"
        assert (await run(executor, after))[1] == "after"


@pytest.mark.slow
async def test_calls_still_running_from_ended_cells_count_against_the_limit(workdir: Path) -> None:
    """Attack: each cell starts as many slow calls as the limit allows and ends; calls run to
    their end after their cell, so a fresh cell must not get a fresh allowance."""
    code = f"""
import json
calls = [{{"id": i, "server_name": "demo", "tool_name": "slow", "tool_args": {{"seconds": 120}}}} for i in range({{n}})]
reply = json.loads(input({PROMPT_PREFIX!r} + json.dumps({{"calls": calls, "ack": []}})))
print(reply.get("error"))
"""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(tool_channel="stdin", approve_tool_calls=False) as ex:
        first = await ex.execute(code.replace("{n}", str(MAX_CALLS_IN_FLIGHT - 10)))
        assert first.text == "None"
        second = await ex.execute(code.replace("{n}", "20"))
        assert (
            second.text is not None
            and f"tool calls in flight, and at most {MAX_CALLS_IN_FLIGHT}" in second.text
        )


@pytest.mark.slow
async def test_a_request_sent_between_cells_runs_nothing(workdir: Path, tmp_path: Path) -> None:
    """Attack: a thread the cell left behind sends a tool call request on the stdin socket once
    the cell has ended; no execution would ever end to free what it holds, so it is not served."""
    go, started, replied = tmp_path / "go", tmp_path / "started", tmp_path / "replied"
    code = f"""
import json, os, threading, time
k = get_ipython().kernel
parent = dict(k.get_parent("shell"))
ident = k._parent_ident["shell"]
calls = [{{"id": 1, "server_name": "demo", "tool_name": "slow", "tool_args": {{"seconds": 0, "started": {str(started)!r}}}}}]
def later():
    while not os.path.exists({str(go)!r}):
        time.sleep(0.01)
    k.session.send(k.stdin_socket, "input_request",
                   {{"prompt": {PROMPT_PREFIX!r} + json.dumps({{"calls": calls, "ack": []}}), "password": False}},
                   parent=parent, ident=ident)
    _, reply = k.session.recv(k.stdin_socket, mode=0)
    with open({str(replied)!r}, "w") as out:
        out.write(reply["content"]["value"])
threading.Thread(target=later, daemon=True).start()
"""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(tool_channel="stdin", approve_tool_calls=False) as ex:
        # The same request made in a cell is served (the slow tool starts): the refusal below is
        # the channel's, not a broken call.
        served = code.replace("threading.Thread(target=later, daemon=True).start()", "")
        await ex.execute(
            served.replace(repr(str(started)), repr(str(tmp_path / "in-cell")))
            + f"print(json.loads(input({PROMPT_PREFIX!r} + json.dumps({{'calls': calls, 'ack': []}}))).get('error'))"
        )
        async with asyncio.timeout(60):
            while not (tmp_path / "in-cell").exists():  # noqa: ASYNC110  # the MCP server writes it
                await asyncio.sleep(0.05)
        await ex.execute(code)
        go.touch()  # the cell has ended
        async with asyncio.timeout(60):
            while not replied.exists():  # noqa: ASYNC110  # a file the kernel's thread writes
                await asyncio.sleep(0.05)
        assert replied.read_text() == "\x04"  # end of input
        assert (await ex.execute("print('still here')")).text == "still here"
    assert not started.exists()


async def test_stdin_channel_is_refused_unless_http_or_stdin() -> None:
    with pytest.raises(ValueError, match="tool_channel must be 'http' or 'stdin'"):
        CodeExecutor(tool_channel="carrier-pigeon")  # type: ignore[arg-type]


@pytest.mark.slow
async def test_a_result_or_arguments_over_the_channels_cap_fail_that_call_alone(
    executor: CodeExecutor,
) -> None:
    # 7 MB of bytes is 9.3 MB of base64: under the tool server's 32 MiB, over the channel's 8 MiB.
    code = """
from mcptools.demo import blob, echo
for call in (lambda: blob.run_content(blob.Params(size=7_000_000)), lambda: echo.run(echo.Params(text="x" * 9_000_000))):
    try:
        call()
    except Exception as exc:
        print(type(exc).__name__, exc)
print(echo.run(echo.Params(text="still here")))
"""
    requests, text = await run(executor, code)
    assert text is not None
    result, arguments, after = text.splitlines()
    assert (
        result.startswith("ToolRunnerError")
        and f"limit of {MAX_MESSAGE_CHARS} bytes of the kernel's stdin channel" in result
    )
    assert arguments.startswith("ToolRunnerError") and "over the stdin channel's limit" in arguments
    assert after == "still here"
    # The call whose arguments were too large was never sent: nothing was asked about it.
    assert [r.tool_name for r in requests] == ["blob", "echo"]


async def test_a_late_reply_to_another_request_is_never_taken_for_a_new_calls_reply(workdir: Path) -> None:
    """ipykernel hands a reply to whichever request waits: a late reply to a request of an earlier
    cell, with a result under the id the next call gets, must not become that call's result.

    The first cell keeps a real reply (with its result) to a request it wrote; the second hands it to
    the channel in place of the reply to the channel's own request, which is lost, as ipykernel loses
    a reply that comes after the next request was made."""
    first = f"""
import json
from ipybox.kernel._stdin import CHANNEL  # the id the next call gets (code in the kernel may look)
call_id = next(CHANNEL._ids) + 1
call = {{"id": call_id, "server_name": "demo", "tool_name": "echo", "tool_args": {{"text": "stale"}}}}
late = input({PROMPT_PREFIX!r} + json.dumps({{"calls": [call], "ack": []}}))
while not json.loads(late)["results"]:
    late = input({PROMPT_PREFIX!r} + json.dumps({{"calls": [], "ack": []}}))
print(json.loads(late)["results"][0]["id"] == call_id)
"""
    second = """
import builtins, types
real = builtins.input
def swapped(kernel, prompt=""):
    builtins.input = real
    real(prompt)  # answered, but this reply is lost
    return late
builtins.input = types.MethodType(swapped, get_ipython().kernel)
from mcptools.demo import echo
print(echo.run(echo.Params(text="fresh")))
"""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(tool_channel="stdin") as ex:
        requests, text = await run(ex, first)
        assert text == "True" and [r.tool_args for r in requests] == [{"text": "stale"}]
        requests, text = await run(ex, second)
        assert text == "fresh"
        # Sent again after the late reply was dropped, the call still ran once.
        assert [r.tool_args for r in requests] == [{"text": "fresh"}]
