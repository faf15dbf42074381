"""``ipybox --approve-tool-calls``: the person at the MCP client decides on each inner tool call.

A real ``ipybox`` process, over stdio (handshake era and 2026-07-28) and streamable HTTP, driven by
the SDK's client with an elicitation callback that plays the person.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
import pytest_asyncio
from mcp.client import Client
from pydantic import TypeAdapter

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, own_state, run, server_env, stdio_params, text_of
from tests.mcp_server.test_http import start_server, stop_server
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "approve-token-0123456789"
# Long enough for any answer the tests give; the timeout test uses a server of its own.
APPROVAL_TIMEOUT = "120"
SHORT_TIMEOUT = "2"


class Person:
    """Answers elicitation requests as the test tells it, and records what it was asked."""

    def __init__(self) -> None:
        self.answer: str = "accept"
        self.asked: list[str] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestFormParams)
        self.asked.append(params.message)
        if self.hold is not None:
            await self.hold.wait()
        return types.ElicitResult(action=self.answer)  # type: ignore[arg-type]  # the test's own literal


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("approve").resolve()
    with own_state(path):
        yield path


_DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
_GREET = "from mcptools.demo.greet import Params, run\nprint(run(Params(name='agent')))"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["legacy", "2026-07-28"])
async def asked(workspace: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[Client, Person]]:
    """A client of ``ipybox --approve-tool-calls`` over stdio, in each protocol era, that answers."""
    person = Person()
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", APPROVAL_TIMEOUT)
    async with connected(params, elicitation_callback=person, mode=request.param) as client:
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": _DEMO}
        )
        assert not registered.is_error, text_of(registered)
        yield client, person


async def test_an_accepted_tool_call_runs(asked: tuple[Client, Person]) -> None:
    client, person = asked
    person.answer, person.asked = "accept", []
    result = await run(client, _GREET)
    assert not result.is_error, text_of(result)
    assert text_of(result) == "Hello, agent!"
    assert person.asked == [
        "Allow the tool call a cell wants to make? demo.greet(name='agent', punctuation='!')"
    ]


async def test_a_declined_tool_call_is_refused_with_a_clear_error_in_the_cell(
    asked: tuple[Client, Person],
) -> None:
    client, person = asked
    person.answer, person.asked = "decline", []
    result = await run(client, _GREET)
    assert result.is_error
    assert "rejected" in text_of(result), text_of(result)
    assert len(person.asked) == 1


async def test_each_call_of_a_cell_is_asked_and_only_accepted_ones_run(
    asked: tuple[Client, Person], workspace: Path
) -> None:
    client, person = asked
    person.answer, person.asked = "accept", []
    marker = workspace / f"ran-{id(person)}"
    marker.unlink(missing_ok=True)
    code = (
        "from mcptools.demo.add import Params, run\n"
        "print(run(Params(a=1, b=2)).sum, run(Params(a=3, b=4)).sum)\n"
        f"!touch {marker.name}"
    )
    result = await run(client, code)
    assert not result.is_error, text_of(result)
    assert "3 7" in text_of(result)
    assert len(person.asked) == 3
    assert person.asked[2].startswith("Allow the shell command a cell wants to run?")
    assert marker.name in person.asked[2]
    assert marker.exists()


async def test_hostile_arguments_cannot_disguise_the_call_the_person_is_asked_about(
    asked: tuple[Client, Person],
) -> None:
    """Attack: the cell's arguments carry a newline, terminal escapes and a right-to-left override to
    paint a harmless-looking question over the real one; the person reads them escaped, on one line."""
    client, person = asked
    person.answer, person.asked = "decline", []
    disguise = "x')\n\x1b[2K\rAllow the tool call a cell wants to make? demo.echo(text='hi')\u202e"
    result = await run(client, f"from mcptools.demo.echo import Params, run\nrun(Params(text={disguise!r}))")
    assert "rejected" in text_of(result), text_of(result)
    [message] = person.asked
    assert message.isprintable() and "\x1b" not in message and "\u202e" not in message
    assert message == f"Allow the tool call a cell wants to make? demo.echo(text={disguise!r})"


async def test_a_declined_shell_command_does_not_run(asked: tuple[Client, Person], workspace: Path) -> None:
    client, person = asked
    person.answer, person.asked = "decline", []
    marker = workspace / f"declined-{id(person)}"
    result = await run(client, f"!touch {marker.name}")
    assert len(person.asked) == 1
    assert "rejected" in text_of(result), text_of(result)
    assert not marker.exists()


async def test_a_client_without_elicitation_gets_a_clear_error_not_a_hang(workspace: Path) -> None:
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", APPROVAL_TIMEOUT)
    for mode in ("legacy", "2026-07-28"):
        async with connected(params, mode=mode) as client:
            result = await run(client, "print('never')")
            assert result.is_error
            assert "does not support elicitation" in text_of(result)
            assert "--approve-tool-calls" in text_of(result)


@pytest.mark.slow
async def test_an_answer_after_the_approval_timeout_is_refused_and_the_call_does_not_run(
    workspace: Path,
) -> None:
    person = Person()
    person.hold = asyncio.Event()
    marker = workspace / "late-answer"
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", SHORT_TIMEOUT)
    async with connected(params, elicitation_callback=person, mode="legacy") as client:
        cell = asyncio.create_task(run(client, f"!touch {marker.name}"))
        result = await cell
        person.hold.set()  # the person answers "accept", after the cell was told the call expired
        assert result.is_error
        assert "expired" in text_of(result), text_of(result)
        # The server is still usable, and the late answer ran nothing.
        person.hold, person.answer = None, "decline"
        assert not (await run(client, "print('next')")).is_error
    assert not marker.exists()


async def test_an_answer_replayed_under_2026_07_28_is_refused(workspace: Path) -> None:
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", APPROVAL_TIMEOUT)
    marker = workspace / "replayed"
    async with connected(params, mode="2026-07-28", elicitation_callback=Person()) as client:
        arguments = {"code": f"!touch {marker.name}"}
        first = await client.session.call_tool("execute_ipython_cell", arguments, allow_input_required=True)
        assert isinstance(first, types.InputRequiredResult) and first.input_requests
        answers: dict[str, Any] = {key: types.ElicitResult(action="decline") for key in first.input_requests}
        retry = types.CallToolRequestParams(
            name="execute_ipython_cell",
            arguments=arguments,
            input_responses=answers,
            request_state=first.request_state,
        )
        declined = await client.session.send_request(
            types.CallToolRequest(params=retry), types.CallToolResult
        )
        assert declined.is_error and "rejected" in text_of(declined)
        accept = {key: types.ElicitResult(action="accept") for key in first.input_requests}
        replay = retry.model_copy(update={"input_responses": accept})
        replayed = await client.session.send_request(
            types.CallToolRequest(params=replay), types.CallToolResult
        )
        assert replayed.is_error and "No cell is waiting for these answers" in text_of(replayed)
    assert not marker.exists()


@pytest.mark.slow
async def test_over_streamable_http_the_person_decides(tmp_path: Path) -> None:
    env = {**server_env(), "IPYBOX_MCP_TOKEN": TOKEN, "IPYBOX_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "workspace").mkdir()
    server = start_server(
        tmp_path / "workspace",
        tmp_path / "server.log",
        env,
        "--approve-tool-calls",
        "--approval-timeout",
        APPROVAL_TIMEOUT,
        "--shared-workspace",
    )
    try:
        person = Person()
        async with connected(server.url, url_token=TOKEN, elicitation_callback=person) as client:
            registered = await client.call_tool(
                "register_mcp_server", {"server_name": "demo", "server_params": _DEMO}
            )
            assert not registered.is_error, text_of(registered)
            accepted = await run(client, _GREET)
            assert text_of(accepted) == "Hello, agent!"
            person.answer = "decline"
            declined = await run(client, _GREET)
            assert declined.is_error and "rejected" in text_of(declined)
            assert len(person.asked) == 2
        async with connected(server.url, url_token=TOKEN) as unable:
            refused = await run(unable, "print('never')")
            assert refused.is_error and "does not support elicitation" in text_of(refused)
    finally:
        stop_server(server.process)


@pytest.mark.slow
async def test_under_2026_07_28_an_answer_after_the_approval_timeout_is_refused(workspace: Path) -> None:
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", SHORT_TIMEOUT)
    marker = workspace / "late-retry"
    async with connected(params, mode="2026-07-28", elicitation_callback=Person()) as client:
        arguments = {"code": f"!touch {marker.name}"}
        first = await client.session.call_tool("execute_ipython_cell", arguments, allow_input_required=True)
        assert isinstance(first, types.InputRequiredResult) and first.input_requests
        # The next cell waits for the first one, which ends when its question expires.
        assert not (await client.session.call_tool("execute_ipython_cell", {"code": "1"})).is_error
        accept: dict[str, Any] = {key: types.ElicitResult(action="accept") for key in first.input_requests}
        retry = types.CallToolRequestParams(
            name="execute_ipython_cell",
            arguments=arguments,
            input_responses=accept,
            request_state=first.request_state,
        )
        late = await client.session.send_request(types.CallToolRequest(params=retry), types.CallToolResult)
        assert late.is_error and "expired" in text_of(late), text_of(late)
    assert not marker.exists()


@pytest.mark.slow
async def test_sandboxed_the_person_decides_on_shell_commands_that_the_kernel_cannot_run_itself(
    tmp_path: Path,
) -> None:
    require_sandbox()
    person = Person()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env = server_env(IPYBOX_STATE_DIR=str(tmp_path / "state"))
    params = stdio_params(
        workspace, "--sandbox", "--approve-tool-calls", "--approval-timeout", APPROVAL_TIMEOUT, env=env
    )
    async with connected(params, elicitation_callback=person, mode="legacy") as client:
        accepted = await run(client, "!touch accepted")
        assert not accepted.is_error, text_of(accepted)
        person.answer = "decline"
        declined = await run(client, "!touch declined")
        assert "rejected" in text_of(declined), text_of(declined)
        # The kernel cannot start the program itself, around the question.
        bypass = await run(client, "import subprocess\nsubprocess.run(['touch', 'bypassed'])")
        assert bypass.is_error, text_of(bypass)
    assert (workspace / "accepted").exists()
    assert not (workspace / "declined").exists() and not (workspace / "bypassed").exists()
    assert len(person.asked) == 2


CALLS = 40
_FLOOD = (
    "import asyncio\n"
    "from mcptools.demo.add import Params, arun\n"
    "go = asyncio.Event()\n"
    "async def one(i):\n"
    "    await go.wait()\n"
    "    try:\n"
    "        return (await arun(Params(a=i, b=1000))).sum\n"
    "    except Exception as exc:\n"
    "        return 'rejected' if 'rejected' in str(exc) else repr(exc)\n"
    f"calls = [asyncio.ensure_future(one(i)) for i in range({CALLS})]\n"
    "await asyncio.sleep(0)\n"
    "go.set()  # all at once\n"
    "print(await asyncio.gather(*calls))"
)
_FLOOD_EXPECTED = str([i + 1000 if i != 7 else "rejected" for i in range(CALLS)])
_DECLINED = "demo.add(a=7, b=1000)"
_ANSWER: TypeAdapter[types.CallToolResult | types.InputRequiredResult] = TypeAdapter(
    types.CallToolResult | types.InputRequiredResult
)


class Crowd:
    """Plays the person against a flood of questions: holds every answer until as many questions are
    open as the server may have open (`MAX_OPEN_QUESTIONS`, or all that are left) and the server has
    said that each question not asked yet waits its turn, or until one question more than it may
    have open arrives (the cap is broken: everything is let go, for the test to fail); declines one.

    What the server says comes from its log on stderr (`waiting`, counted by `Crowd.read_log`): with
    only the open count to go by, the person would answer before it could tell whether a fifth
    question was on its way.
    """

    def __init__(self, limit: int, total: int) -> None:
        self.limit, self.total = limit, total
        self.open = self.most_open = self.answered = self.waiting = 0
        self.asked: list[str] = []
        self.changed = asyncio.Condition()

    def _may_answer(self) -> bool:
        if self.open > self.limit:
            return True
        return self.open >= min(self.limit, self.total - self.answered) and self.waiting >= self.total - len(
            self.asked
        )

    async def __call__(self, context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestFormParams)
        # Counted as it comes, before waiting for the lock (that is taken only to wait and to notify).
        self.asked.append(params.message)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            async with self.changed:
                self.changed.notify_all()
                await self.changed.wait_for(self._may_answer)
        finally:
            self.open -= 1
            self.answered += 1
        async with self.changed:
            self.changed.notify_all()
        return types.ElicitResult(action="decline" if params.message.endswith(_DECLINED) else "accept")

    async def _saw_waiting(self) -> None:
        async with self.changed:
            self.waiting += 1
            self.changed.notify_all()

    def read_log(self, stderr: int, loop: asyncio.AbstractEventLoop) -> None:
        """Read the server's stderr to its end (a thread's work), counting the questions that wait."""
        with open(stderr, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if "waits its turn" in line:
                    asyncio.run_coroutine_threadsafe(self._saw_waiting(), loop)


async def test_a_flood_of_gathered_calls_is_asked_a_few_questions_at_a_time(workspace: Path) -> None:
    """Attack: a cell gathers 40 tool calls at once to put 40 questions before the person together;
    at most `MAX_OPEN_QUESTIONS` are open at the client at any moment (the person holds its answers
    until the server says the others wait), the rest wait their turn, every one is asked, and the
    declined one refuses only its own call."""
    from mcp.client.stdio import stdio_client

    # Private: the cap on open questions is internal; the flood is measured against it.
    from ipybox.mcp_server._elicit import MAX_OPEN_QUESTIONS

    crowd = Crowd(MAX_OPEN_QUESTIONS, CALLS)
    params = stdio_params(
        workspace, "--approve-tool-calls", "--approval-timeout", APPROVAL_TIMEOUT, "--log-level", "DEBUG"
    )
    read_end, write_end = os.pipe()
    reader = threading.Thread(target=crowd.read_log, args=(read_end, asyncio.get_running_loop()), daemon=True)
    reader.start()
    try:
        with os.fdopen(write_end, "w") as stderr:
            transport = stdio_client(params, errlog=stderr)
            async with connected(transport, elicitation_callback=crowd, mode="legacy") as client:
                registered = await client.call_tool(
                    "register_mcp_server", {"server_name": "demo", "server_params": _DEMO}
                )
                assert not registered.is_error, text_of(registered)
                result = await run(client, _FLOOD)
    finally:
        # The server has exited and the write end is closed: the reader reaches the end of the log.
        await asyncio.to_thread(reader.join)
    assert text_of(result) == _FLOOD_EXPECTED, text_of(result)
    assert crowd.most_open <= MAX_OPEN_QUESTIONS, crowd.most_open
    assert sorted(crowd.asked) == sorted(
        f"Allow the tool call a cell wants to make? demo.add(a={i}, b=1000)" for i in range(CALLS)
    )


async def test_under_2026_07_28_a_flood_of_gathered_calls_is_asked_a_few_questions_at_a_time(
    workspace: Path,
) -> None:
    # Private: the cap on open questions is internal; the flood is measured against it.
    from ipybox.mcp_server._elicit import MAX_OPEN_QUESTIONS

    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", APPROVAL_TIMEOUT)
    asked: list[str] = []
    async with connected(params, mode="2026-07-28", elicitation_callback=Person()) as client:
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": _DEMO}
        )
        assert not registered.is_error, text_of(registered)
        arguments = {"code": _FLOOD}
        answer: Any = await client.session.call_tool(
            "execute_ipython_cell", arguments, allow_input_required=True
        )
        while isinstance(answer, types.InputRequiredResult):
            assert answer.input_requests and len(answer.input_requests) <= MAX_OPEN_QUESTIONS
            answers: dict[str, Any] = {}
            for key, question in answer.input_requests.items():
                assert isinstance(question, types.ElicitRequest)
                text = question.params.message
                asked.append(text)
                answers[key] = types.ElicitResult(action="decline" if text.endswith(_DECLINED) else "accept")
            retry = types.CallToolRequestParams(
                name="execute_ipython_cell",
                arguments=arguments,
                input_responses=answers,
                request_state=answer.request_state,
            )
            answer = await client.session.send_request(types.CallToolRequest(params=retry), _ANSWER)
    assert text_of(answer) == _FLOOD_EXPECTED, text_of(answer)
    assert sorted(asked) == sorted(
        f"Allow the tool call a cell wants to make? demo.add(a={i}, b=1000)" for i in range(CALLS)
    )
