"""Tool calls from a kernel on a "remote host", over the kernel's own stdin channel (prototype).

The kernel reaches nothing but its gateway, so every answer travels over the gateway's WebSocket.
The gateways are those that ``IPYBOX_TEST_GATEWAYS`` selects (tests/remote_support.py): by default
a plain Jupyter Kernel Gateway (ipykernel 7) and, when ``IPYBOX_TEST_EG_PYTHON`` names the Python of
an Enterprise Gateway 3.3 environment (``bash scripts/test-remote.sh`` makes one), Enterprise
Gateway (ipykernel 6), each in a network namespace of its own; ``bash scripts/test-remote-docker.sh``
adds both gateways starting kernels in Docker containers.
"""

from __future__ import annotations

import json
import os
import socket
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
from tests.remote_support import NetnsGateway, gateway

__all__ = ["gateway"]  # the fixture, chosen by IPYBOX_TEST_GATEWAYS (tests/remote_support.py)

pytestmark = pytest.mark.slow

# The kernel side, importable in a kernel whose environment lacks ipybox (Enterprise Gateway's).
SRC = str(Path(__file__).resolve().parents[1] / "src")
PREAMBLE = f"import json, sys\nsys.path.insert(0, {SRC!r})\nfrom ipybox.kernel import _remote_channel as rc\n"


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
    kernel: tuple[RemoteKernel, Recorder], gateway: NetnsGateway, host_tmp_file: Path
) -> None:
    """What the remote cases rest on: the only way out of the kernel is the gateway's WebSocket.

    A kernel in a container also tries a port of the host's that listens on the host's address in
    the kernels' network: of the host, only the gateway's response port is open to it there.
    """
    remote, _ = kernel
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        # A service of the host's on its address in the kernels' network (where there is one).
        socket.create_server((gateway.kernel_host_address or "127.0.0.1", 0)) as on_host,
    ):
        targets = [("127.0.0.1", listener.getsockname()[1]), ("10.0.2.2", 80), ("1.1.1.1", 53)]
        if gateway.kernel_host_address is not None:
            targets.append((gateway.kernel_host_address, on_host.getsockname()[1]))
        output = await remote.execute(
            textwrap.dedent(f"""
            import os, socket
            for address in {targets!r}:
                try:
                    socket.create_connection(address, timeout=5).close()
                    print("reached", address)
                except OSError as exc:
                    print("blocked", type(exc).__name__)
            print("host tmp visible:", os.path.exists({str(host_tmp_file)!r}))
            """)
        )
    lines = output.splitlines()
    assert len(lines) == len(targets) + 1, output
    assert all(line.startswith("blocked") for line in lines[:-1]), output
    assert lines[-1] == "host tmp visible: False"


async def test_kernel_code_in_a_container_finds_no_trace_of_the_gateways_token(
    kernel: tuple[RemoteKernel, Recorder], gateway: NetnsGateway
) -> None:
    """Attack: read the gateway's token from the kernel's environment (its launcher copies its own).

    With the token, kernel code could open any other session's kernel through the gateway's API.
    Only where the kernel runs apart from the gateway (a container) can it be kept from the kernel:
    beside the gateway, the kernel's process can read the gateway's.
    """
    if gateway.kernel_host_address is None:
        pytest.skip("the kernel runs beside the gateway, whose environment it can read")
    remote, _ = kernel
    output = await remote.execute(
        textwrap.dedent(f"""
        import os
        seen = [name for name, value in os.environ.items() if {gateway.token!r} in value]
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{{pid}}/environ", "rb") as env:
                        if {gateway.token!r}.encode() in env.read():
                            seen.append(pid)
                except OSError:
                    pass
        print(seen, sorted(name for name in os.environ if name.startswith(("KG_", "JUPYTER_GATEWAY"))))
        """)
    )
    assert output == "[] []\n"


async def test_a_kernel_in_a_container_cannot_reach_another_sessions_kernel(gateway: NetnsGateway) -> None:
    """Attack: connect from one session's kernel to a port another session's kernel listens on.

    Kernels beside one gateway share its host; in containers each has its own address, and the
    network lets only the gateway reach them.
    """
    if gateway.kernel_host_address is None:
        pytest.skip("the kernels run beside the gateway, on one host")
    async with (
        RemoteKernel(gateway.url, Recorder(), token=gateway.token) as attacker,
        RemoteKernel(gateway.url, Recorder(), token=gateway.token) as victim,
    ):
        address = await victim.execute(
            textwrap.dedent("""
            import socket
            victim_listener = socket.create_server(("0.0.0.0", 0))
            # The container's address in the kernels' network (Docker writes it in /etc/hosts).
            print(socket.gethostbyname(socket.gethostname()), victim_listener.getsockname()[1])
            """)
        )
        ip, port = address.split()
        output = await attacker.execute(
            textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(({ip!r}, {port}), timeout=5).close()
                print("reached")
            except OSError as exc:
                print("blocked", type(exc).__name__)
            """)
        )
    assert output.startswith("blocked"), output
