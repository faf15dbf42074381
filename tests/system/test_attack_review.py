"""Attacks on the features that came with OAuth, tool search, approval by the person at the MCP
client, tracing and the remote channel: hostile kernel code, a hostile MCP server, a hostile web
page on the loopback interface. Each test passes when the attack fails."""

from __future__ import annotations

# private-ok: attacks on internal parts no public API reaches directly: the OAuth loopback callback,
# the search index's size caps, the remote channel's prompt marker and answer backlog.
import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipybox import CodeExecutor, generate_mcp_sources
from ipybox._wire import PROMPT_PREFIX
from ipybox.app.apigen import _search_index
from ipybox.app.mcp_client._oauth_flow import _LoopbackCallback
from ipybox.app.tools._server import ToolServer
from ipybox.app.tools._stdin_channel import StdinToolCalls
from ipybox.errors import ToolSearchError
from ipybox.kernel._search import INDEX_FILE
from ipybox.mcp_server import _search
from ipybox.tool_exec.search import search_tools
from tests.app.apigen.apigen_support import TOOLS_SERVER
from tests.app.tools.test_remote_channel import cell, client
from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, stdio_params, text_of
from tests.mcp_server.test_approve_tool_calls import Person
from tests.remote_support import NetnsGateway, gateway_in_netns, kernel_gateway_argv, netns_unavailable

ISSUES = {
    "name": "create_issue",
    "description": "Create a new issue in a GitHub repository.",
    "inputSchema": {"type": "object", "properties": {"repo": {"type": "string"}}, "required": ["repo"]},
}


def _params(tmp_path: Path, name: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    path = tmp_path / f"{name}-tools.json"
    path.write_text(json.dumps(tools))
    return {"command": sys.executable, "args": [str(TOOLS_SERVER), "--tools", str(path)]}


# Kernel code plants many packages, each with a catalogue just under the per-file cap: without a
# budget over all of them, every generation makes the trusted side read and index them all (its
# memory grows with the number of packages, beyond any limit the kernel itself runs under), and the
# catalogues read first can crowd out the package being generated.
_PLANT = """
import json, os
entry = {{"server": "junk", "tool": "t", "module": "m", "import_line": "x", "signature": "s",
          "description": "d", "text": "creat issu github repository " + "filler " * 40}}
for n in range({packages}):
    os.makedirs(f"mcptools/aaa{{n}}", exist_ok=True)
    tools = [dict(entry, tool=f"junk{{n}}_{{i}}") for i in range({per_package})]
    with open(f"mcptools/aaa{{n}}/_search.json", "w") as f:
        json.dump({{"version": 1, "tools": tools}}, f)
print(sum(os.path.getsize(f"mcptools/aaa{{n}}/_search.json") for n in range({packages})))
"""


async def test_planted_catalogues_cannot_make_generation_read_without_bound_or_crowd_out_the_new_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small budget stands for the real one, so the test plants little.
    budget = 256 * 1024
    monkeypatch.setattr(_search_index, "_MAX_CATALOGUES_BYTES", budget, raising=False)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    async with CodeExecutor(working_dir=workspace) as executor:
        planted = await executor.execute(_PLANT.format(packages=20, per_package=300))
    assert planted.text is not None and int(planted.text) > 8 * budget
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), workspace / "mcptools")
    index = json.loads((workspace / "mcptools" / INDEX_FILE).read_text())
    junk = [tool for tool in index["tools"] if tool["server"] == "junk"]
    # What was read of the planted catalogues fits the budget (each entry is well over 300 bytes).
    assert len(junk) * 300 <= budget
    # The server just generated is always in the index.
    assert "work.create_issue" in [
        f"{m.server}.{m.tool}" for m in search_tools("create issue", 50, root=workspace / "mcptools")
    ]


async def test_a_deeply_nested_planted_catalogue_does_not_stop_generation(tmp_path: Path) -> None:
    """A catalogue of nested brackets makes JSON parsing raise RecursionError, which is not a
    ValueError: unhandled, every later generation in the folder failed."""
    root = tmp_path / "mcptools"
    (root / "nested").mkdir(parents=True)
    (root / "nested" / "_search.json").write_text("[" * 200_000)
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), root)
    assert [f"{m.server}.{m.tool}" for m in search_tools("create issue", root=root)] == ["work.create_issue"]


async def _send(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def test_a_hostile_page_on_the_loopback_cannot_inject_a_code_fail_or_stall_the_oauth_callback() -> None:
    """A web page (or unsandboxed local code) that finds the callback port sends a code of its own
    (login CSRF), an error to end the login, requests elsewhere, an oversized head, and holds
    connections open without sending: none completes or ends the login, the real redirect still
    gets through, and the idle connections are closed when the login ends (they were left open,
    a socket each, for as long as the application ran)."""
    callback = _LoopbackCallback(0)
    state = "the-real-state"
    waiting = asyncio.ensure_future(callback.wait(state))
    try:
        await asyncio.sleep(0)  # the wait listens before its first suspension
        port = callback.port
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        hostile = [
            b"GET /callback?code=attacker&state=guess HTTP/1.1\r\n\r\n",
            b"GET /callback?code=attacker HTTP/1.1\r\n\r\n",
            b"GET /callback?error=access_denied&state=guess HTTP/1.1\r\n\r\n",
            b"GET /elsewhere?code=attacker&state=the-real-state HTTP/1.1\r\n\r\n",
            b"POST /callback?code=attacker&state=the-real-state HTTP/1.1\r\n\r\n",
            b"GET /callback?state=guess&state=the-real-state&code=x HTTP/1.1\r\n\r\n",
            b"GET /callback?code=" + b"a" * 40_000 + b"&state=the-real-state HTTP/1.1\r\n\r\n",
        ]
        for request in hostile:
            answer = await _send(port, request)
            assert answer.startswith(b"HTTP/1.1 400"), (request[:80], answer)
            assert not waiting.done()
        answer = await _send(port, b"GET /callback?code=real&state=the-real-state HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200")
        result = await waiting
        assert (result.code, result.state) == ("real", state)
        # The connections that sent nothing are closed when the login ends, not left open.
        for reader, writer in idle:
            assert await asyncio.wait_for(reader.read(), 30) == b""
            writer.close()
            await writer.wait_closed()
    finally:
        waiting.cancel()
        callback.close()


async def test_kernel_code_cannot_make_the_mcp_servers_search_parse_a_huge_or_deep_index(
    tmp_path: Path,
) -> None:
    """The MCP server's search_tools parses the kernel-writable index in its own process: a 20 MiB
    index of empty objects took ~0.5 GB there (63 MiB, the old cap: 1.6 GB), whatever memory limit
    the kernel runs under; one of nested brackets raised RecursionError instead of a clear error."""
    workspace = tmp_path / "workspace"
    await generate_mcp_sources("work", _params(tmp_path, "work", [ISSUES]), workspace / "mcptools")
    async with CodeExecutor(working_dir=workspace) as executor:
        await executor.execute(
            "with open('mcptools/_search_index.json', 'wb') as f:\n"
            "    f.write(b'{\"version\":1,\"tools\":[' + b'{},' * (7 * 1024 * 1024) + b'{}],\"postings\":{}}')\n"
        )
        size = (workspace / "mcptools" / INDEX_FILE).stat().st_size
        assert size > _search._MAX_INDEX_BYTES, (size, _search._MAX_INDEX_BYTES)
        with pytest.raises(ToolSearchError, match=r"larger than .* MiB.*register an MCP server again"):
            _search.search(workspace, "mcptools", "create issue", 5)
        await executor.execute("open('mcptools/_search_index.json', 'w').write('[' * 200_000)")
        with pytest.raises(ToolSearchError, match="damaged: register an MCP server again"):
            _search.search(workspace, "mcptools", "create issue", 5)


async def test_padding_cannot_push_the_dangerous_part_of_an_asked_call_out_of_sight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack on ``--approve-tool-calls``: the cell pads an argument with thousands of spaces (or of
    blank-looking printable characters, U+2800), so that a dialog showing the start of the question
    shows a harmless call and the rest (``; rm -rf ~``) lies far beyond it. The person must see the
    whole call within the first lines: runs of one character are shown counted."""
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(tmp_path / "state"))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    person = Person()
    person.answer = "decline"
    params = stdio_params(workspace, "--approve-tool-calls", "--approval-timeout", "120")
    async with connected(params, elicitation_callback=person, mode="legacy") as client:
        registered = await client.call_tool(
            "register_mcp_server",
            {"server_name": "demo", "server_params": {"command": sys.executable, "args": [str(DEMO_SERVER)]}},
        )
        assert not registered.is_error, text_of(registered)
        for pad in (" ", "\u2800", "\t"):
            person.asked = []
            code = (
                "from mcptools.demo.echo import Params, run\n"
                f"run(Params(text='hello' + {pad!r} * 5000 + '; rm -rf ~'))"
            )
            result = await run(client, code)
            assert "rejected" in text_of(result), text_of(result)
            [message] = person.asked
            assert "; rm -rf ~" in message[:200], message[:300]
            assert "5000" in message[:200]


async def test_kernel_code_cannot_put_megabytes_into_the_applications_trace_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tracing on, the server and tool names of a ``/run`` request (straight from the kernel,
    before they are checked against the registry) and the message of a cell's error became span
    attributes at full length: each call could park megabytes in the application's span queue
    and send them to the collector. They are capped."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setenv("IPYBOX_STATE_DIR", str(tmp_path / "state"))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        async with CodeExecutor(tracing=provider, working_dir=tmp_path) as executor:
            result = await executor.execute(
                "from ipybox.tool_exec.client import ToolRunner, ToolRunnerError\n"
                "try:\n"
                "    ToolRunner('s' * 2_000_000, {}).run_sync('t' * 2_000_000, {'a': 'b'})\n"
                "except ToolRunnerError as e:\n"
                "    print('refused', len(str(e)) < 10_000)\n"
            )
            assert result.text is not None and result.text.startswith("refused")
            with pytest.raises(Exception, match="zzzz"):
                await executor.execute("raise ValueError('z' * 3_000_000)")
        biggest = 0
        for span in exporter.get_finished_spans():
            values = [*(span.attributes or {}).values()]
            for event in span.events:
                values.extend((event.attributes or {}).values())
            values.append(span.status.description or "")
            biggest = max([biggest, *(len(v) for v in values if isinstance(v, str))])
        assert biggest <= 10_000
    finally:
        provider.shutdown()


@pytest.fixture
def gateway() -> Iterator[NetnsGateway]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"no gateway can run in a network namespace here: {reason}")
    with gateway_in_netns(kernel_gateway_argv(sys.executable)) as running:
        yield running


@pytest.mark.slow  # a gateway in a network namespace
async def test_malformed_messages_from_a_remote_kernel_do_not_stop_its_channel(
    gateway: NetnsGateway, tmp_path: Path
) -> None:
    """Code in a remote kernel sends messages of the wrong shape through the gateway (a parent header
    that is a list or a string, a message id that is a list): one frame
    the application's receiver could not take ended it, and every later cell and tool call of
    that kernel waited until its timeout."""
    await generate_mcp_sources(
        "demo", {"command": sys.executable, "args": [str(DEMO_SERVER)]}, tmp_path / "mcptools"
    )
    async with ToolServer(approval_required=False) as tools:
        handler = StdinToolCalls(tools)
        async with client(gateway, handler) as remote:
            await remote.execute(
                cell("""
                kernel = get_ipython().kernel
                for parent in ([1], {"msg_id": [2]}, "x"):
                    msg = kernel.session.msg("stream", {"name": "stdout", "text": "x"}, parent=kernel.get_parent())
                    msg["parent_header"] = parent
                    kernel.session.send(kernel.iopub_socket, msg)
                print("sent")
                """),
                timeout=60,
            )
            result = await remote.execute(
                cell('print(json.dumps(run_tool("demo", "add", {"a": 1, "b": 0})))'), timeout=60
            )
            assert json.loads(result.text or "") == {"sum": 1}
        await handler.aclose()


class _Counting(StdinToolCalls):
    """The executor's handler, counting the requests it answers at once; each answer waits until released
    (as one waits while its calls run)."""

    def __init__(self, server: ToolServer) -> None:
        super().__init__(server)
        self.answering = self.most = 0
        self.release = asyncio.Event()

    async def input_request(self, kernel_id: str, prompt: str) -> str:
        self.answering += 1
        self.most = max(self.most, self.answering)
        try:
            await self.release.wait()
            return await super().input_request(kernel_id, prompt)
        finally:
            self.answering -= 1


@pytest.mark.slow  # a gateway in a network namespace
async def test_a_remote_kernel_flooding_stdin_requests_cannot_pile_them_up_in_the_application(
    gateway: NetnsGateway,
) -> None:
    """Code in the kernel sends a hundred large stdin requests without waiting for replies
    (ipykernel's own input() never does that): each became a task holding its message in the
    application, without bound. A new request means nobody reads the answer to the one before, so
    one answer is made per kernel at a time."""
    async with ToolServer(approval_required=False) as tools:
        handler = _Counting(tools)
        async with client(gateway, handler) as remote:
            result = await remote.execute(
                cell(f"""
                kernel = get_ipython().kernel
                ident, parent = kernel._parent_ident["shell"], kernel.get_parent()
                for n in range(100):
                    call = {{"id": n, "server_name": "c", "tool_name": "t", "tool_args": {{"pad": "x" * 100_000}}}}
                    big = {PROMPT_PREFIX!r} + json.dumps({{"calls": [call], "ack": []}})
                    kernel.session.send(kernel.stdin_socket, "input_request", {{"prompt": big, "password": False}},
                                        parent=parent, ident=ident)
                print("flooded")
                """),
                timeout=120,
            )
            assert result.text == "flooded"
            handler.release.set()
            # The replies the kernel asked for sit on its own stdin socket (its next call purges
            # them) or come while its next call waits (they are to other requests: dropped unread,
            # never taken for that call's); the application goes on serving the kernel.
            code = 'try:\n    run_tool("c", "t", {})\nexcept Exception as exc:\n    print(type(exc).__name__, exc)'
            result = await remote.execute(cell(code), timeout=60)
            assert result.text is not None and result.text.startswith("ToolRunnerError")
            assert "'c' is not registered" in result.text
            assert handler.most == 1
        await handler.aclose()
