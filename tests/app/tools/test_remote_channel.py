"""Tool calls from a kernel on a "remote host", over the kernel's own stdin channel.

The kernel reaches nothing but its gateway, so every answer travels over the gateway's WebSocket.
The application side is a plain `KernelClient` with the executor's stdin handler (`StdinToolCalls`)
and a `ToolServer` whose run path (registry, approval, limits) each call takes; the MCP server runs
in the application. The gateways are those that ``IPYBOX_TEST_GATEWAYS`` selects
(tests/remote_support.py): by default a plain Jupyter Kernel Gateway (ipykernel 7) and, when
``IPYBOX_TEST_EG_PYTHON`` names the Python of an Enterprise Gateway 3.3 environment (``bash
scripts/test-remote.sh`` makes one), Enterprise Gateway (ipykernel 6), each in a network namespace of
its own; ``bash scripts/test-remote-docker.sh`` adds both gateways starting kernels in Docker
containers.
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
from urllib.parse import urlsplit

import pytest

from ipybox import generate_mcp_sources

# private-ok: the application side of the channel (kernel client, stdin handler, tool server) is
# driven directly against a bare remote gateway, below the executor; the attack reads the victim
# kernel's session and the handler's state to forge and to check.
from ipybox._wire import PROMPT_PREFIX, StdinChannel, ToolServerEnv
from ipybox.app.kernels._client import KernelClient
from ipybox.app.tools._server import ToolServer
from ipybox.app.tools._stdin_channel import StdinToolCalls
from ipybox.errors import KernelConnectionError
from tests.conftest import DEMO_SERVER
from tests.remote_support import NetnsGateway, gateway

__all__ = ["gateway"]  # the fixture, chosen by IPYBOX_TEST_GATEWAYS (tests/remote_support.py)

pytestmark = pytest.mark.slow

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
# The kernel side, importable in a kernel whose environment lacks ipybox (Enterprise Gateway's); the
# variable the executor gives a kernel whose calls go over stdin.
SRC = str(Path(__file__).resolve().parents[3] / "src")
PREAMBLE = (
    f"import json, os, sys\nsys.path.insert(0, {SRC!r})\n"
    f"os.environ[{ToolServerEnv.CHANNEL!r}] = {StdinChannel.VALUE!r}\n"
    "from ipybox.kernel._tool_client import run_tool\n"
)


@pytest.fixture
async def tools(tmp_path: Path) -> AsyncIterator[ToolServer]:
    """The application's tool server, with the demo server registered (approval asked of nobody)."""
    await generate_mcp_sources("demo", DEMO, tmp_path / "mcptools")
    async with ToolServer(approval_required=False) as server:
        yield server


def client(gateway: NetnsGateway, handler: StdinToolCalls) -> KernelClient:
    address = urlsplit(gateway.url)
    assert address.hostname is not None and address.port is not None
    return KernelClient(
        address.hostname, address.port, auth_token=gateway.token, spare_kernel=False, stdin_handler=handler
    )


@pytest.fixture
async def kernel(gateway: NetnsGateway, tools: ToolServer) -> AsyncIterator[KernelClient]:
    handler = StdinToolCalls(tools)
    remote = client(gateway, handler)
    try:
        await remote.connect(retries=1)
    except KernelConnectionError as exc:
        if "WebSocket protocol" in str(exc):
            pytest.skip(f"the kernel client does not speak this gateway's WebSocket protocol yet: {exc}")
        raise
    try:
        yield remote
    finally:
        await remote.disconnect()
        await handler.aclose()


def cell(body: str) -> str:
    return PREAMBLE + textwrap.dedent(body)


async def output(remote: KernelClient, code: str) -> str:
    return (await remote.execute(code, timeout=60)).text or ""


async def test_kernel_code_gets_a_registered_tools_result_in_the_middle_of_a_cell(
    kernel: KernelClient,
) -> None:
    text = await output(
        kernel,
        cell("""
        first = run_tool("demo", "add", {"a": 1, "b": 2})
        second = run_tool("demo", "add", {"a": first["sum"], "b": 10})
        print(json.dumps([first, second]))
        print("still in the cell")
        """),
    )
    assert text.splitlines() == ['[{"sum": 3}, {"sum": 13}]', "still in the cell"]


async def test_concurrent_calls_from_a_remote_kernel_are_in_flight_together(kernel: KernelClient) -> None:
    text = await output(
        kernel,
        cell("""
        import asyncio
        from ipybox.kernel._tool_client import arun_tool
        args = {"key": "remote", "count": 8, "timeout": 30}
        print(await asyncio.gather(*(arun_tool("demo", "rendezvous", args) for _ in range(8))))
        """),
    )
    assert text == str(["8 together"] * 8)


async def test_an_unregistered_server_is_refused_and_a_plain_input_gets_end_of_file(
    kernel: KernelClient,
) -> None:
    text = await output(
        kernel,
        cell("""
        from ipybox.errors import ToolRunnerError
        try:
            run_tool("calc", "add", {})
        except ToolRunnerError as exc:
            print(exc.kind, exc)
        try:
            input("name? ")
        except EOFError:
            print("EOF")
        """),
    )
    failed, eof = text.splitlines()
    assert failed.startswith("failed ") and "'calc' is not registered" in failed
    assert eof == "EOF"


async def test_a_request_with_fields_of_its_own_is_refused_and_the_channel_keeps_working(
    kernel: KernelClient,
) -> None:
    call = {"id": 7, "server_name": "demo", "tool_name": "add", "tool_args": {"a": 1, "b": 1}}
    text = await output(
        kernel,
        cell(f"""
        prefix = {PROMPT_PREFIX!r}
        for request in ({{"calls": [{{**{call!r}, "approved": True}}], "ack": []}},
                        {{"calls": [], "ack": [], "kernel_id": "another-kernel"}}, [1, 2]):
            print(input(prefix + json.dumps(request)))
        print(json.dumps(run_tool("demo", "add", {{"a": 5, "b": 0}})))
        """),
    )
    *refused, last = text.splitlines()
    assert [set(json.loads(line)) for line in refused] == [{"seq", "error", "ids"}] * 3
    assert "approved" in refused[0] and "kernel_id" in refused[1]
    assert json.loads(last) == {"sum": 5}


async def test_a_request_that_names_another_session_reaches_only_its_own_kernels_application(
    gateway: NetnsGateway, tools: ToolServer
) -> None:
    mine, theirs = StdinToolCalls(tools), StdinToolCalls(tools)
    async with client(gateway, mine) as attacker, client(gateway, theirs) as victim:
        assert attacker._kernel is not None and victim._kernel is not None
        # Every routing field the kernel controls names the victim's session and request.
        forged_parent = {
            "msg_id": "victim-request",
            "session": victim._kernel.session,
            "msg_type": "execute_request",
        }
        request = {
            "calls": [{"id": 1, "server_name": "demo", "tool_name": "add", "tool_args": {"a": 2, "b": 2}}],
            "ack": [],
        }
        text = await output(
            attacker,
            cell(f"""
            kernel = get_ipython().kernel
            kernel.session.send(
                kernel.stdin_socket, "input_request",
                {{"prompt": {PROMPT_PREFIX!r} + json.dumps({request!r}), "password": False}},
                parent={forged_parent!r}, ident=kernel._parent_ident["shell"],
            )
            ident, reply = kernel.session.recv(kernel.stdin_socket, mode=0)
            print(reply["content"]["value"])
            """),
        )
        assert await output(victim, "print('victim idle')") == "victim idle"
        # Answered to the attacker's own kernel (started there, so the victim's application holds nothing).
        assert "error" not in json.loads(text)
        assert theirs._kernels == {} and theirs._tasks == set()
    await mine.aclose()
    await theirs.aclose()


@pytest.fixture
def host_tmp_file() -> Iterator[Path]:
    fd, name = tempfile.mkstemp(prefix="ipybox-host-")
    os.close(fd)
    yield Path(name)
    os.unlink(name)


async def test_the_kernel_reaches_neither_the_hosts_network_nor_its_tmp(
    kernel: KernelClient, gateway: NetnsGateway, host_tmp_file: Path
) -> None:
    """What the remote cases rest on: the only way out of the kernel is the gateway's WebSocket.

    A kernel in a container also tries a port of the host's that listens on the host's address in
    the kernels' network: of the host, only the gateway's response port is open to it there.
    """
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        # A service of the host's on its address in the kernels' network (where there is one).
        socket.create_server((gateway.kernel_host_address or "127.0.0.1", 0)) as on_host,
    ):
        targets = [("127.0.0.1", listener.getsockname()[1]), ("10.0.2.2", 80), ("1.1.1.1", 53)]
        if gateway.kernel_host_address is not None:
            targets.append((gateway.kernel_host_address, on_host.getsockname()[1]))
        text = await output(
            kernel,
            textwrap.dedent(f"""
            import os, socket
            for address in {targets!r}:
                try:
                    socket.create_connection(address, timeout=5).close()
                    print("reached", address)
                except OSError as exc:
                    print("blocked", type(exc).__name__)
            print("host tmp visible:", os.path.exists({str(host_tmp_file)!r}))
            """),
        )
    lines = text.splitlines()
    assert len(lines) == len(targets) + 1, text
    assert all(line.startswith("blocked") for line in lines[:-1]), text
    assert lines[-1] == "host tmp visible: False"


async def test_kernel_code_in_a_container_finds_no_trace_of_the_gateways_token(
    kernel: KernelClient, gateway: NetnsGateway
) -> None:
    """Attack: read the gateway's token from the kernel's environment (its launcher copies its own).

    With the token, kernel code could open any other session's kernel through the gateway's API.
    Only where the kernel runs apart from the gateway (a container) can it be kept from the kernel:
    beside the gateway, the kernel's process can read the gateway's.
    """
    if gateway.kernel_host_address is None:
        pytest.skip("the kernel runs beside the gateway, whose environment it can read")
    text = await output(
        kernel,
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
        """),
    )
    assert text == "[] []"


async def test_a_kernel_in_a_container_cannot_reach_another_sessions_kernel(
    gateway: NetnsGateway, tools: ToolServer
) -> None:
    """Attack: connect from one session's kernel to a port another session's kernel listens on.

    Kernels beside one gateway share its host; in containers each has its own address, and the
    network lets only the gateway reach them.
    """
    if gateway.kernel_host_address is None:
        pytest.skip("the kernels run beside the gateway, on one host")
    mine, theirs = StdinToolCalls(tools), StdinToolCalls(tools)
    async with client(gateway, mine) as attacker, client(gateway, theirs) as victim:
        address = await output(
            victim,
            textwrap.dedent("""
            import socket
            victim_listener = socket.create_server(("0.0.0.0", 0))
            # The container's address in the kernels' network (Docker writes it in /etc/hosts).
            print(socket.gethostbyname(socket.gethostname()), victim_listener.getsockname()[1])
            """),
        )
        ip, port = address.split()
        text = await output(
            attacker,
            textwrap.dedent(f"""
            import socket
            try:
                socket.create_connection(({ip!r}, {port}), timeout=5).close()
                print("reached")
            except OSError as exc:
                print("blocked", type(exc).__name__)
            """),
        )
    await mine.aclose()
    await theirs.aclose()
    assert text.startswith("blocked"), text
