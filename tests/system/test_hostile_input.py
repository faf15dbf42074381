"""Hostile input to the trusted side, by attack: kernel code, a client of the tool server's port and
a hostile MCP server try to make what is approved differ from what runs, or to make the
application hold unbounded memory, descriptors or time. Each test also shows the next call works."""

from __future__ import annotations

# private-ok: the tool server's waits and caps (ipybox.app.tools._http, _mcp_transport) are shortened
# so each hostile client's test ends in seconds, and the in-flight budget and the approval channel,
# which nothing public shows, are checked to be released after an attack.
import asyncio
import base64
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from ipybox import ApprovalRequest, CodeExecutionResult, CodeExecutor, generate_mcp_sources
from ipybox.app.mcp_client import _transport as _mcp_transport
from ipybox.app.tools import _http as tool_server_module
from ipybox.errors import ApprovalDecisionError, CodeExecutionError
from ipybox.tool_exec.approval.client import ApprovalClient
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
from ipybox.tool_exec.server import ToolServer
from tests.app.tools.support import wait_until
from tests.conftest import DEMO_SERVER

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
HOSTILE_SERVER = Path(__file__).parents[1] / "servers" / "hostile_server.py"
MiB = 1024 * 1024


class PeakRss:
    """Samples this process's resident memory in a thread; `growth` is the peak over the start."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._start = self._process.memory_info().rss
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._peak = max(self._peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._process.memory_info().rss)

    @property
    def growth(self) -> int:
        return int(self._peak - self._start)


# --- The approval shows what runs ---------------------------------------------------------------


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executor shares one registry, the module's (see `workdir`)."""
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def executor(workdir: Path) -> AsyncIterator[CodeExecutor]:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(images_dir=workdir / "images") as ex:
        yield ex


async def run_cell(executor: CodeExecutor, code: str) -> tuple[list[ApprovalRequest], object]:
    """Run a cell, accepting every request; the requests and the result (or the error)."""
    requests: list[ApprovalRequest] = []
    try:
        async for item in executor.stream(code, timeout=60):
            if isinstance(item, ApprovalRequest):
                requests.append(item)
                await item.accept()
            elif isinstance(item, CodeExecutionResult):
                return requests, item
    except CodeExecutionError as exc:
        return requests, exc
    raise AssertionError("the stream ended without a result")


RUNNER = (
    "import os\nfrom ipybox.tool_exec.client import ToolRunner\n"
    "runner = ToolRunner('demo', {}, port=int(os.environ['TOOL_SERVER_PORT']))\n"
)
# Moves the cursor to the start of the line and erases it: printed raw, what follows hides what came before.
HIDE = "\r\x1b[2K"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_is_shown_escaped_so_what_is_printed_is_what_runs(executor: CodeExecutor) -> None:
    text = f"rm -rf ~{HIDE}harmless\u202e"
    requests, result = await run_cell(
        executor, RUNNER + f"print(await runner.run('echo', {{'text': {text!r}}}))"
    )
    assert len(requests) == 1, result
    [request] = requests
    for shown in (str(request), repr(request)):
        assert not any(ord(char) < 32 or char in "\x7f\u202e" for char in shown), shown
    assert str(request) == "demo.echo(text='rm -rf ~\\r\\x1b[2Kharmless\\u202e')"
    # The cell's own output: the tool's result, terminal escapes stripped as for any output.
    assert isinstance(result, CodeExecutionResult) and result.text == "rm -rf ~\rharmless\u202e"


@pytest.mark.asyncio(loop_scope="module")
async def test_an_unknown_tool_or_an_undeclared_argument_is_refused_before_anyone_is_asked(
    executor: CodeExecutor,
) -> None:
    requests, error = await run_cell(executor, RUNNER + "await runner.run('delete_everything', {})")
    assert requests == []
    assert isinstance(error, CodeExecutionError)
    assert "has no tool 'delete_everything'" in str(error) and "'echo'" in str(error)

    # An argument whose name hides itself, next to the declared one.
    args = {"text": "hello", f"text{HIDE}": "rm -rf ~"}
    requests, error = await run_cell(executor, RUNNER + f"await runner.run('echo', {args!r})")
    assert requests == []
    assert isinstance(error, CodeExecutionError)
    assert "does not declare the argument(s) 'text\\r\\x1b[2K'" in str(error)

    requests, result = await run_cell(executor, RUNNER + "print(await runner.run('echo', {'text': 'next'}))")
    assert [request.tool_args for request in requests] == [{"text": "next"}]
    assert isinstance(result, CodeExecutionResult) and result.text == "next"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_call_larger_than_a_websocket_message_is_approved_and_the_next_call_works(
    executor: CodeExecutor,
) -> None:
    # 3 MB of arguments: over the approval channel's message size before the fix (1 MiB).
    code = RUNNER + "print(len(await runner.run('echo', {'text': 'y' * 3_000_000})))"
    requests, result = await run_cell(executor, code)
    assert len(requests) == 1 and len(requests[0].tool_args["text"]) == 3_000_000
    assert isinstance(result, CodeExecutionResult) and result.text == "3000000"
    requests, result = await run_cell(executor, RUNNER + "print(await runner.run('echo', {'text': 'next'}))")
    assert isinstance(result, CodeExecutionResult) and result.text == "next"


# --- Malformed kernel messages and output without end --------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
async def test_malformed_display_data_is_skipped_with_a_note_and_the_rest_is_kept(
    executor: CodeExecutor,
) -> None:
    code = """
from IPython.display import publish_display_data
print("before")
publish_display_data({"image/png": "this is not base64!"})
publish_display_data({"image/png": 12})
publish_display_data({"image/png": "aGVsbG8gd29ybGQ="})
publish_display_data({"text/plain": ["not", "a", "string"]})
print("after")
"""
    result = await executor.execute(code)
    assert result.images == []
    assert result.text is not None
    lines = result.text.splitlines()
    assert lines[0] == "before" and lines[-1] == "after"
    assert lines.count("[ipybox skipped an image/png output: it is not base64-encoded PNG data]") == 3
    assert "[ipybox skipped a text/plain output: it is not a string]" in lines
    assert (await executor.execute("print('next')")).text == "next"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.slow
async def test_a_kernel_printing_far_more_than_is_kept_does_not_grow_the_application(
    executor: CodeExecutor,
) -> None:
    code = "chunk = 'z' * (1 << 20)\nfor _ in range(400):\n    print(chunk, end='', flush=True)\nprint('END')"
    with PeakRss() as rss:
        result = await executor.execute(code, timeout=300)
    assert result.text is not None
    assert result.text.startswith("z" * 1000) and result.text.endswith("zEND")
    assert "ipybox dropped" in result.text
    assert len(result.text) < 17 * MiB
    # 400 MiB printed; the application keeps at most 16 Mi characters of it, plus what is in flight.
    assert rss.growth < 150 * MiB, rss.growth
    assert (await executor.execute("print('next')")).text == "next"


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.slow
async def test_one_print_of_hundreds_of_megabytes_keeps_the_kernel_and_the_application_bounded(
    executor: CodeExecutor,
) -> None:
    # The kernel sends one large write in pieces: the cell keeps its state and its head and tail.
    await executor.execute("kept = 42")
    with PeakRss() as rss:
        result = await executor.execute("print('q' * 300_000_000)\nprint(kept)", timeout=300)
    assert result.text is not None and result.text.startswith("q" * 1000) and result.text.endswith("q\n42")
    assert "ipybox dropped" in result.text
    assert rss.growth < 150 * MiB, rss.growth


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.slow
async def test_one_output_message_of_hundreds_of_megabytes_is_refused_unread(executor: CodeExecutor) -> None:
    # Kernel code that undoes the pieces sends one message, which the application must not read whole.
    with PeakRss() as rss:
        with pytest.raises(CodeExecutionError, match="over 64 MiB") as info:
            await executor.execute("import sys\ndel sys.stdout.write\nprint('q' * 300_000_000)", timeout=300)
    assert "print less at once" in str(info.value)
    assert rss.growth < 150 * MiB, rss.growth
    assert (await executor.execute("print('next')")).text == "next"


# --- Tool calls in flight hold a bounded total -------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.slow
async def test_many_large_tool_calls_at_once_hold_a_bounded_total_in_the_application(
    executor: CodeExecutor,
) -> None:
    # Each call is within the per-call limits (16 MiB out, 16 MiB back); without a total bound
    # the application held every one of them at once, about 70 MiB per call.
    code = (
        "import asyncio\n"
        "from mcptools.demo import echo\n"
        "big = 'x' * (16 << 20)\n"
        "async def one():\n"
        "    try:\n"
        "        return len(await echo.arun(echo.Params(text=big)))\n"
        "    except Exception as e:\n"
        "        return repr(e)[:300]\n"
        "res = await asyncio.gather(*(one() for _ in range(40)))\n"
        "print(sum(r == len(big) for r in res), [r for r in res if r != len(big)][:1])"
    )
    with PeakRss() as rss:
        result = await executor.execute(code, timeout=600)
    assert result.text is not None
    done, failed = result.text.split(" ", 1)
    # Calls wait for room rather than fail, unless a result arrives with no room left.
    assert int(done) > 0, result.text
    assert failed == "[]" or "max_inflight_size" in failed, result.text
    # Held at once, 40 calls of 16 MiB grew the application by over 2.5 GiB; the total bound
    # (128 MiB counted on the wire) keeps it to a small multiple of that bound.
    assert rss.growth < 768 * MiB, rss.growth
    assert (await executor.execute("print(len(echo.run(echo.Params(text='hi'))))")).text == "2"


@pytest.mark.slow
async def test_calls_over_the_inflight_limit_wait_or_fail_alone_and_one_call_always_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tool_server_module, "_INFLIGHT_WAIT", 1.0, raising=False)
    requests: asyncio.Queue[ApprovalRequest] = asyncio.Queue()

    async def hold(request: ApprovalRequest) -> None:
        requests.put_nowait(request)

    async with (
        ToolServer(
            port=0, approval_required=True, log_level="WARNING", max_inflight_size=MiB, trust_all_clients=True
        ) as server,
        ApprovalClient(hold, port=server.port),
    ):
        runner = ToolRunner("demo", DEMO, port=server.port)
        # A call over the whole limit is run when it is alone; while its approval waits it holds
        # all of the limit, so the next call waits for room, then fails naming the limit, unasked.
        big = asyncio.create_task(runner.run("echo", {"text": "a" * (2 * MiB)}))
        first = await asyncio.wait_for(requests.get(), 30)
        with pytest.raises(ToolRunnerError, match="max_inflight_size") as info:
            await runner.run("echo", {"text": "b"})
        assert "waited 1 s for room" in str(info.value) and "1.0 MiB" in str(info.value)
        assert requests.empty()
        await first.accept()
        assert await big == "a" * (2 * MiB)

        # A result that does not fit beside what other calls hold fails that call alone.
        held = asyncio.create_task(runner.run("echo", {"text": "c" * (MiB - 4096)}))
        waiting = await asyncio.wait_for(requests.get(), 30)
        blob = asyncio.create_task(runner.run_content("blob", {"size": 100_000}))
        await (await asyncio.wait_for(requests.get(), 30)).accept()
        with pytest.raises(ToolRunnerError, match="did not fit") as info:
            await blob
        assert "max_inflight_size" in str(info.value)
        await waiting.accept()
        assert await held == "c" * (MiB - 4096)
        assert server._inflight.held == 0  # private: the only view of the in-flight budget's release

        next_call = asyncio.create_task(runner.run_content("blob", {"size": 100_000}))
        await (await asyncio.wait_for(requests.get(), 30)).accept()
        assert len((await next_call).parts) == 1


# --- Approval decisions that do not take effect -----------------------------------------------


@pytest_asyncio.fixture
async def approval_server() -> AsyncIterator[ToolServer]:
    async with ToolServer(
        port=0, approval_required=True, approval_timeout=2, log_level="WARNING", trust_all_clients=True
    ) as server:
        yield server


@pytest.mark.slow
async def test_a_second_decision_and_a_decision_after_expiry_raise(approval_server: ToolServer) -> None:
    requests: asyncio.Queue[ApprovalRequest] = asyncio.Queue()

    async def hold(request: ApprovalRequest) -> None:
        requests.put_nowait(request)

    async with ApprovalClient(hold, port=approval_server.port):
        runner = ToolRunner("demo", DEMO, port=approval_server.port)
        call = asyncio.create_task(runner.run("echo", {"text": "ran"}))
        request = await asyncio.wait_for(requests.get(), 30)
        await request.accept()
        with pytest.raises(ApprovalDecisionError, match="already accepted"):
            await request.accept()
        with pytest.raises(ApprovalDecisionError, match="already accepted \\(the call runs\\)"):
            await request.reject()
        assert await call == "ran"

        # No decision within the approval timeout: the call expires, and a late accept says so.
        call = asyncio.create_task(runner.run("echo", {"text": "late"}))
        request = await asyncio.wait_for(requests.get(), 30)
        with pytest.raises(ToolRunnerError) as info:
            await call
        assert info.value.kind == "expired"
        with pytest.raises(ApprovalDecisionError, match="no longer waiting"):
            await request.accept()

        call = asyncio.create_task(runner.run("echo", {"text": "next"}))
        await (await asyncio.wait_for(requests.get(), 30)).accept()
        assert await call == "next"


async def test_the_approval_channel_recovers_when_it_drops(approval_server: ToolServer) -> None:
    async def accept(request: ApprovalRequest) -> None:
        await request.accept()

    async with ApprovalClient(accept, port=approval_server.port):
        runner = ToolRunner("demo", DEMO, port=approval_server.port)
        assert await runner.run("echo", {"text": "one"}) == "one"
        await approval_server._channel.disconnect()  # the connection drops (private: no public way)
        assert await wait_until(lambda: approval_server._channel.open, timeout=30)
        assert await runner.run("echo", {"text": "two"}) == "two"


async def test_a_call_over_the_request_limit_fails_alone_naming_the_limit() -> None:
    async with ToolServer(
        port=0, log_level="WARNING", max_request_size=MiB, approval_required=False, trust_all_clients=True
    ) as server:
        runner = ToolRunner("demo", DEMO, port=server.port)
        with pytest.raises(ToolRunnerError, match="max_request_size") as info:
            await runner.run("echo", {"text": "w" * (2 * MiB)})
        assert "1.0 MiB" in str(info.value)
        # 256 MiB sent in pieces: the server reads it to answer, and keeps none of it.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        with PeakRss() as rss:
            writer.write(b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (256 * MiB))
            piece = b"w" * MiB
            for _ in range(256):
                writer.write(piece)
                await writer.drain()
            async with asyncio.timeout(60):
                answer = await reader.read(65536)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413") and b"max_request_size" in answer, answer[:200]
        assert rss.growth < 50 * MiB, rss.growth
        assert await runner.run("echo", {"text": "next"}) == "next"


# --- The tool server's port ---------------------------------------------------------------------


async def raw_exchange(port: int, head: bytes, body: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read(65536)
    finally:
        writer.close()


async def test_a_client_without_the_token_is_answered_before_it_sends_a_body() -> None:
    async with ToolServer(
        port=0, log_level="WARNING", token="secret", approval_required=False, trust_all_clients=True
    ) as server:
        # Announces 500 MB and sends none of it: the answer comes anyway, at once.
        head = b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Length: 500000000\r\n\r\n"
        answer = await raw_exchange(server.port, head)
        assert answer.startswith(b"HTTP/1.1 401"), answer
        head = b"POST /approve HTTP/1.1\r\nHost: x\r\nContent-Length: 500000000\r\n\r\n"
        assert (await raw_exchange(server.port, head)).startswith(b"HTTP/1.1 401")
        runner = ToolRunner("demo", DEMO, port=server.port, token="secret")
        assert await runner.run("echo", {"text": "next"}) == "next"


async def test_a_body_that_trickles_is_cut_off_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_server_module, "_BODY_TIMEOUT", 1.0, raising=False)
    async with ToolServer(
        port=0, log_level="WARNING", token="secret", approval_required=False, trust_all_clients=True
    ) as server:
        # The right token, 100 bytes announced, 10 sent, then nothing.
        head = b"POST /run HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret\r\nContent-Length: 100\r\n\r\n"
        answer = await raw_exchange(server.port, head, b'{"server_n')
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
        runner = ToolRunner("demo", DEMO, port=server.port, token="secret")
        assert await runner.run("echo", {"text": "next"}) == "next"


async def test_a_huge_request_head_is_refused() -> None:
    async with ToolServer(
        port=0, log_level="WARNING", approval_required=False, trust_all_clients=True
    ) as server:
        head = b"GET /status HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"p" * (1024 * 1024) + b"\r\n\r\n"
        answer = await raw_exchange(server.port, head)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        runner = ToolRunner("demo", DEMO, port=server.port)
        assert await runner.run("echo", {"text": "next"}) == "next"


async def test_stalled_connections_are_dropped_and_hold_no_descriptors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tool_server_module, "_HEAD_TIMEOUT", 1.0, raising=False)
    monkeypatch.setattr(tool_server_module, "_MAX_CONNECTIONS", 50, raising=False)
    process = psutil.Process()
    async with ToolServer(
        port=0, log_level="WARNING", approval_required=False, trust_all_clients=True
    ) as server:
        before = process.num_fds()
        stalled: list[socket.socket] = []
        try:
            # 300 connections that send half a request head and then nothing.
            for _ in range(300):
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(b"POST /run HTTP/1.1\r\nHost: x\r\n")
                stalled.append(sock)
            with selectors.DefaultSelector() as selector:
                for sock in stalled:
                    selector.register(sock, selectors.EVENT_READ)
                closed: set[int] = set()
                async with asyncio.timeout(60):
                    while len(closed) < len(stalled):
                        for key, _ in await asyncio.to_thread(selector.select, 1):
                            conn = key.fileobj
                            assert isinstance(conn, socket.socket)
                            try:
                                gone = conn.recv(1) == b""
                            except ConnectionResetError:  # closed over the limit: aborted
                                gone = True
                            if gone:
                                closed.add(conn.fileno())
                                selector.unregister(conn)
            # The server closed every one: the test's own 300 sockets are all that is left.
            assert process.num_fds() - before <= len(stalled) + 5
        finally:
            for sock in stalled:
                sock.close()
        runner = ToolRunner("demo", DEMO, port=server.port)
        assert await runner.run("echo", {"text": "next"}) == "next"


# --- A hostile MCP server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_url() -> Iterator[str]:
    process = subprocess.Popen([sys.executable, str(HOSTILE_SERVER)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(timeout=60), "the hostile server did not start"
        line = process.stdout.readline().strip()
        assert line.startswith("READY "), line
        yield line.removeprefix("READY ")
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


async def test_argument_names_are_shown_escaped_where_the_schema_allows_any(hostile_url: str) -> None:
    seen: list[ApprovalRequest] = []

    async def accept(request: ApprovalRequest) -> None:
        seen.append(request)
        await request.accept()

    async with ToolServer(
        port=0, approval_required=True, log_level="WARNING", trust_all_clients=True
    ) as server:
        async with ApprovalClient(accept, port=server.port):
            runner = ToolRunner("hostile", {"url": hostile_url}, port=server.port)
            # Printed raw, the second name would erase the line and show only "safe=1".
            args = {"path": "/", f"recursive{HIDE}safe": 1}
            assert await runner.run("anything", args) == "2 arguments"
    [request] = seen
    assert str(request) == "hostile.anything(path='/', 'recursive\\r\\x1b[2Ksafe'=1)"
    for shown in (str(request), repr(request)):
        assert not any(ord(char) < 32 for char in shown), shown


@pytest.mark.parametrize("tool", ["huge_json", "huge_sse"])
async def test_a_huge_answer_is_refused_while_it_is_read(hostile_url: str, tool: str) -> None:
    async with ToolServer(
        port=0, log_level="WARNING", max_result_size=MiB, approval_required=False, trust_all_clients=True
    ) as server:
        runner = ToolRunner("hostile", {"url": hostile_url}, port=server.port)
        with PeakRss() as rss:
            with pytest.raises(ToolRunnerError, match="byte limit") as info:
                async with asyncio.timeout(120):
                    await runner.run(tool, {"size": 400 * MiB})
        assert "max_result_size" in str(info.value)
        # Refused by ipybox's own bounded stream (the refusal it records), not by httpx2's parser.
        assert "so it was not read further" in str(info.value)
        assert "too large to receive" in str(info.value)
        # 400 MiB answered; at most the limit (2 MiB with the envelope) is read.
        assert rss.growth < 100 * MiB, rss.growth
        assert await runner.run("echo", {"text": "next"}) == "next"


async def test_a_server_cannot_pass_its_error_off_as_a_refused_answer(hostile_url: str) -> None:
    # Only the client's own refusal, recorded where it happens, makes "a message too large".
    async with ToolServer(
        port=0, log_level="WARNING", approval_required=False, trust_all_clients=True
    ) as server:
        runner = ToolRunner("hostile", {"url": hostile_url}, port=server.port)
        with pytest.raises(ToolRunnerError, match="answered tool 'fake_limit' with an error") as info:
            await runner.run("fake_limit", {})
        assert "too large to receive" not in str(info.value)
        assert await runner.run("echo", {"text": "next"}) == "next"


async def test_a_huge_answer_over_stdio_is_refused_while_it_is_read() -> None:
    async with ToolServer(
        port=0, log_level="WARNING", max_result_size=MiB, approval_required=False, trust_all_clients=True
    ) as server:
        runner = ToolRunner("demo", DEMO, port=server.port)
        assert await runner.run("echo", {"text": "first"}) == "first"
        with PeakRss() as rss:
            with pytest.raises(ToolRunnerError, match=r"too large to receive: .*byte limit"):
                async with asyncio.timeout(120):
                    # One line of about 80 MB (the blob as base64 in JSON) from the server's stdout.
                    await runner.run_content("blob", {"size": 60 * MiB})
        assert rss.growth < 60 * MiB, rss.growth
        assert await runner.run("echo", {"text": "next"}) == "next"


@pytest.mark.slow
async def test_an_answer_that_trickles_forever_is_abandoned(
    hostile_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_mcp_transport, "_ANSWER_DEADLINE", 2.0, raising=False)
    async with ToolServer(
        port=0, log_level="WARNING", approval_required=False, trust_all_clients=True
    ) as server:
        runner = ToolRunner("hostile", {"url": hostile_url}, port=server.port)
        with pytest.raises(ToolRunnerError, match="did not arrive whole within 2 s"):
            async with asyncio.timeout(120):
                await runner.run("trickle", {})
        assert await runner.run("echo", {"text": "next"}) == "next"


# --- The MCP server (python -m ipybox over stdio, through the SDK's client) ------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mcp_client(workdir: Path) -> AsyncIterator[Any]:
    from tests.mcp_server.support import connected, server_env, stdio_params

    workspace = workdir / "workspace"
    workspace.mkdir()
    async with connected(stdio_params(workspace, env=server_env())) as client:
        yield client


def _mcp_server_process() -> psutil.Process:
    [server] = [
        child
        for child in psutil.Process().children()
        if "ipybox" in child.cmdline() and "--workspace" in child.cmdline()
    ]
    return server


class PeakTreeRss(PeakRss):
    """`PeakRss` of another process (the MCP server) rather than this one."""

    def __init__(self, process: psutil.Process) -> None:
        super().__init__()
        self._process = process
        self._start = self._peak = process.memory_info().rss


# A 6000 x 6000 grey PNG (36 million pixels, a few kilobytes), made without Pillow.
BIG_PNG = """
import struct, zlib
from IPython.display import Image, display
def chunk(kind, data):
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))
def png(width, height, extra=b''):
    rows = zlib.compress((b'\\x00' + b'\\x80' * width) * height)
    head = chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, 8, 0, 0, 0, 0))
    return b'\\x89PNG\\r\\n\\x1a\\n' + head + extra + chunk(b'IDAT', rows) + chunk(b'IEND', b'')
"""


@pytest.mark.asyncio(loop_scope="module")
async def test_the_mcp_server_skips_bad_display_data_and_bad_images_with_a_note(mcp_client: Any) -> None:
    import mcp_types as types

    from tests.mcp_server.support import run, text_of

    code = BIG_PNG + (
        "from IPython.display import publish_display_data\n"
        "print('before')\n"
        "publish_display_data({'image/png': 'not base64!'})\n"
        "display(Image(data=png(6000, 6000)))\n"
        # A bad checksum in an ancillary chunk: Pillow refuses it, other viewers show it.
        "bad = chunk(b'tEXt', b'k\\x00v')[:-4] + b'\\x00\\x00\\x00\\x00'\n"
        "display(Image(data=png(1000, 800, bad)))\n"
        "print('after')\n"
    )
    result = await run(mcp_client, code)
    assert not result.is_error, text_of(result)
    text = text_of(result)
    assert text.startswith("before\n[ipybox skipped an image/png output: it is not base64-encoded PNG data]")
    assert "after" in text
    assert "is not shown: it is 6000 x 6000 pixels, more than the 25000000 pixels" in text
    images = [block for block in result.content if isinstance(block, types.ImageContent)]
    # The image Pillow cannot decode is passed on as it is.
    assert len(images) == 1 and base64.b64decode(images[0].data).startswith(b"\x89PNG")
    assert text_of(await run(mcp_client, "print('next')")).startswith("next")


@pytest.mark.asyncio(loop_scope="module")
async def test_the_mcp_server_does_not_grow_with_what_a_cell_prints(mcp_client: Any, workdir: Path) -> None:
    from tests.mcp_server.support import run, text_of

    code = "chunk = 'v' * (1 << 20)\nfor _ in range(300):\n    print(chunk, end='', flush=True)\nraise ValueError('at the end')"
    server = _mcp_server_process()
    with PeakTreeRss(server) as rss:
        result = await run(mcp_client, code, timeout=300)
    assert result.is_error
    text = text_of(result)
    assert "ValueError: at the end" in text
    # The "complete" output the server saved is what it kept: head and tail around a note.
    saved = workdir / "workspace" / text.split("the complete output is in ")[1].split(" in the workspace")[0]
    assert saved.stat().st_size < 17 * MiB
    assert "ipybox dropped" in saved.read_text()
    # 300 MiB printed; the server keeps at most 16 Mi characters of it (and one copy to shape it).
    assert rss.growth < 200 * MiB, rss.growth
    assert text_of(await run(mcp_client, "print('next')")).startswith("next")
