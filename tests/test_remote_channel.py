"""Tool calls from a kernel on a "remote host", over the kernel's own stdin channel (prototype).

The gateway runs in a network namespace of its own, reached through one forwarded port
(tests/remote_support.py): the kernel reaches nothing but the gateway, so every answer travels over
the gateway's WebSocket. Runs against a plain Jupyter Kernel Gateway (ipykernel 7, from ipybox's
environment) and, when ``IPYBOX_TEST_EG_PYTHON`` names the Python of an Enterprise Gateway 3.3
environment (``bash scripts/test-remote.sh`` makes one), against Enterprise Gateway (ipykernel 6).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

# Private: both halves of the remote channel (application and kernel side) are internal; these
# tests drive them directly.
from ipybox.app._remote_channel import RemoteKernel, RemoteToolCall
from ipybox.errors import ToolRunnerError
from ipybox.kernel._remote_channel import PROMPT_PREFIX
from tests.remote_support import (
    NetnsGateway,
    enterprise_gateway_argv,
    gateway_in_netns,
    kernel_gateway_argv,
    netns_unavailable,
)

pytestmark = pytest.mark.slow

# The kernel side, importable in a kernel whose environment lacks ipybox (Enterprise Gateway's).
SRC = str(Path(__file__).resolve().parents[1] / "src")
PREAMBLE = f"import json, sys\nsys.path.insert(0, {SRC!r})\nfrom ipybox.kernel import _remote_channel as rc\n"


@pytest.fixture(scope="module", params=["kernel-gateway", "enterprise-gateway"])
def gateway(request: pytest.FixtureRequest) -> Iterator[NetnsGateway]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"no gateway can run in a network namespace here: {reason}")
    if request.param == "kernel-gateway":
        argv = kernel_gateway_argv(sys.executable)
    else:
        eg_python = os.environ.get("IPYBOX_TEST_EG_PYTHON", "")
        if not eg_python:
            pytest.skip(
                "IPYBOX_TEST_EG_PYTHON is not set; `bash scripts/test-remote.sh` installs Enterprise Gateway"
            )
        argv = enterprise_gateway_argv(eg_python)
    with gateway_in_netns(argv) as running:
        yield running


class Recorder:
    """An application's tool handler: records each call and answers from `answer`."""

    def __init__(self, answer: Any = None, error: ToolRunnerError | None = None) -> None:
        self.calls: list[RemoteToolCall] = []
        self.answer = answer
        self.error = error

    async def __call__(self, call: RemoteToolCall) -> Any:
        self.calls.append(call)
        if self.error is not None:
            raise self.error
        return self.answer if self.answer is not None else {"echo": call.tool_args}


@pytest.fixture
async def kernel(gateway: NetnsGateway) -> AsyncIterator[tuple[RemoteKernel, Recorder]]:
    recorder = Recorder()
    async with RemoteKernel(gateway.url, recorder, token=gateway.token) as remote:
        yield remote, recorder


def cell(body: str) -> str:
    return PREAMBLE + textwrap.dedent(body)


async def test_kernel_code_gets_the_applications_reply_to_a_tool_call_in_the_middle_of_a_cell(
    kernel: tuple[RemoteKernel, Recorder],
) -> None:
    remote, recorder = kernel
    output = await remote.execute(
        cell("""
        first = rc.call("calc", "add", {"a": 1, "b": 2})
        second = rc.call("calc", "add", {"a": first["echo"]["a"] + 1, "b": 0})
        print(json.dumps([first, second]))
        print("still in the cell")
        """)
    )
    lines = output.splitlines()
    assert json.loads(lines[0]) == [{"echo": {"a": 1, "b": 2}}, {"echo": {"a": 2, "b": 0}}]
    assert lines[1] == "still in the cell"
    assert [(c.kernel_id, c.server_name, c.tool_name) for c in recorder.calls] == [
        (remote.kernel_id, "calc", "add"),
        (remote.kernel_id, "calc", "add"),
    ]


async def test_a_rejected_call_raises_a_tool_runner_error_that_says_so_in_the_kernel(
    kernel: tuple[RemoteKernel, Recorder],
) -> None:
    remote, recorder = kernel
    recorder.error = ToolRunnerError("The call of calc.add was rejected.", kind="rejected")
    output = await remote.execute(
        cell("""
        from ipybox.errors import ToolRunnerError
        try:
            rc.call("calc", "add", {})
        except ToolRunnerError as exc:
            print(exc.kind, exc)
        """)
    )
    assert output.strip() == "rejected The call of calc.add was rejected."


async def test_a_plain_input_gets_an_empty_line_and_reaches_no_tool(
    kernel: tuple[RemoteKernel, Recorder],
) -> None:
    remote, recorder = kernel
    assert await remote.execute("print(repr(input('name? ')))") == "''\n"
    assert recorder.calls == []


async def test_a_cell_cannot_forge_an_approval_or_a_reply_and_the_channel_keeps_working(
    kernel: tuple[RemoteKernel, Recorder],
) -> None:
    """Hostile code sends every request-like message it can; it gets an error or nothing."""
    remote, recorder = kernel
    output = await remote.execute(
        cell(f"""
        kernel = get_ipython().kernel
        prefix = {PROMPT_PREFIX!r}
        request = {{"id": 7, "server_name": "calc", "tool_name": "add", "tool_args": {{}}}}
        # 1. A request that claims to be approved already, or to come from another kernel.
        for extra in ({{"approved": True}}, {{"kernel_id": "another-kernel"}}):
            print(input(prefix + json.dumps({{**request, **extra}})))
        # 2. A request that is not one at all.
        print(input(prefix + "[1, 2]"))
        # 3. A request on the wrong channel (iopub), and reply-looking messages from the kernel.
        parent = kernel.get_parent()
        kernel.session.send(kernel.iopub_socket, "input_request", {{"prompt": prefix + json.dumps(request)}}, parent=parent)
        kernel.session.send(kernel.iopub_socket, "input_reply", {{"value": json.dumps({{"id": 8, "result": "approved"}})}}, parent=parent)
        print(json.dumps({{"msg_type": "input_reply", "content": {{"value": "approved"}}}}))
        # 4. The channel still pairs the next real call with its own reply.
        print(json.dumps(rc.call("calc", "add", {{"a": 5}})))
        """)
    )
    lines = output.splitlines()
    approved, other_kernel, not_a_request = (json.loads(line) for line in lines[:3])
    for reply, field in ((approved, "approved"), (other_kernel, "kernel_id")):
        assert reply["id"] is None and field in reply["error"] and "exactly the fields" in reply["error"]
    assert not_a_request["id"] is None and "exactly the fields" in not_a_request["error"]
    assert json.loads(lines[-1]) == {"echo": {"a": 5}}
    # The only call the application saw is the real one, attributed to this kernel's connection.
    assert [(c.kernel_id, c.tool_args) for c in recorder.calls] == [(remote.kernel_id, {"a": 5})]


async def test_a_request_that_names_another_session_reaches_only_its_own_kernels_application(
    gateway: NetnsGateway,
) -> None:
    mine, theirs = Recorder(), Recorder()
    async with (
        RemoteKernel(gateway.url, mine, token=gateway.token) as attacker,
        RemoteKernel(gateway.url, theirs, token=gateway.token) as victim,
    ):
        # Every routing field the kernel controls names the victim's session and request.
        # Private: the victim's session id is not exposed; the attacker is taken to have learnt it.
        forged_parent = {
            "msg_id": "victim-request",
            "session": victim._session,
            "msg_type": "execute_request",
        }
        output = await attacker.execute(
            cell(f"""
            kernel = get_ipython().kernel
            request = {{"id": 1, "server_name": "calc", "tool_name": "add", "tool_args": {{"to": "victim"}}}}
            kernel.session.send(
                kernel.stdin_socket, "input_request",
                {{"prompt": {PROMPT_PREFIX!r} + json.dumps(request), "password": False}},
                parent={forged_parent!r}, ident=kernel._parent_ident["shell"],
            )
            ident, reply = kernel.session.recv(kernel.stdin_socket, mode=0)
            print(reply["content"]["value"])
            """)
        )
        assert await victim.execute("print('victim idle')") == "victim idle\n"
        attacker_id = attacker.kernel_id
    assert json.loads(output) == {"id": 1, "result": {"echo": {"to": "victim"}}}
    assert [c.kernel_id for c in mine.calls] == [attacker_id]
    assert theirs.calls == []


@pytest.fixture
def host_tmp_file() -> Iterator[Path]:
    fd, name = tempfile.mkstemp(prefix="ipybox-host-")
    os.close(fd)
    yield Path(name)
    os.unlink(name)


async def test_the_kernel_reaches_neither_the_hosts_network_nor_its_tmp(
    kernel: tuple[RemoteKernel, Recorder], host_tmp_file: Path
) -> None:
    """What the remote cases rest on: the only way out of the kernel is the gateway's WebSocket."""
    remote, _ = kernel
    with socket.create_server(("127.0.0.1", 0)) as listener:
        host_port = listener.getsockname()[1]
        output = await remote.execute(
            textwrap.dedent(f"""
            import os, socket
            for address in [("127.0.0.1", {host_port}), ("10.0.2.2", 80), ("1.1.1.1", 53)]:
                try:
                    socket.create_connection(address, timeout=5).close()
                    print("reached", address)
                except OSError as exc:
                    print("blocked", type(exc).__name__)
            print("host tmp visible:", os.path.exists({str(host_tmp_file)!r}))
            """)
        )
    lines = output.splitlines()
    assert len(lines) == 4 and all(line.startswith("blocked") for line in lines[:3]), output
    assert lines[3] == "host tmp visible: False"
