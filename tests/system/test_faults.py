"""The fault matrix: each fault ends in a clear error for the operation it hit, and the executor works on.

Faults are real: processes are killed with SIGKILL, servers go away and come back, cells flood
output or block the kernel in C code. Everything goes through the public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from ipybox import (
    ApprovalRequest,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)
from ipybox.errors import ApprovalDecisionError
from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway
from ipybox.tool_exec.server import default_registry
from tests.conftest import DEMO_SERVER, command_line
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
CONNECT_TIMEOUT = 5


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


class HttpDemo:
    """The demo MCP server over streamable HTTP on a fixed port, to be killed and started again.

    The port stays reserved while the server is down: a socket bound to it (not listening, so a
    connection is refused at once, as to a server that is down) keeps any other process's
    ``bind(0)`` or outgoing connection from taking it; the server binds it beside that socket
    (``SO_REUSEPORT``).
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.reserved.bind(("127.0.0.1", 0))
        self.port = self.reserved.getsockname()[1]

    def start(self) -> str:
        self.process = subprocess.Popen(
            [sys.executable, str(DEMO_SERVER), "--transport", "streamable-http", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line.startswith("READY "), line
        url = line.removeprefix("READY ")
        self.port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        return url

    def close(self) -> None:
        self.kill()
        self.reserved.close()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process = None


@pytest.fixture(scope="module")
def http_demo() -> Iterator[HttpDemo]:
    server = HttpDemo()
    try:
        yield server
    finally:
        server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def executor(workdir: Path, http_demo: HttpDemo) -> AsyncIterator[CodeExecutor]:
    url = http_demo.start()
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    await generate_mcp_sources("web", {"url": url}, workdir / "mcptools")
    # A server that starts but never says a word: it is registered by the application (the
    # registry is trusted) and its module is the demo's, so the kernel can call it. Registered
    # by hand: generate_mcp_sources needs a server that answers.
    await generate_mcp_sources("mute", DEMO, workdir / "mcptools")
    default_registry().register(
        "mute",
        {"command": sys.executable, "args": ["-c", "import time; time.sleep(3600)"]},
        workdir / "mcptools",
    )
    # The default connect_timeout: every MCP server start here must succeed however loaded the
    # machine; only the test of a server that never answers takes a short one, on its own executor.
    async with CodeExecutor(images_dir=workdir / "images") as ex:
        yield ex


async def until(predicate: object, timeout: float = 30) -> None:
    """Wait, bounded, until `predicate()` is true.

    Polled: what it waits for happens in another process (a file it creates, a process table
    entry), which offers no event to wait on from here.
    """
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.05)


def descendants(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


async def test_a_stdio_mcp_server_killed_mid_call_fails_that_call_naming_it_and_the_next_call_restarts_it(
    executor: CodeExecutor, tmp_path: Path
) -> None:
    before = int(
        (
            await executor.execute("from mcptools.demo import pid, slow\nprint(pid.run(pid.Params()).result)")
        ).text
        or 0
    )
    started = tmp_path / "started"
    call = asyncio.create_task(
        executor.execute(f"slow.run(slow.Params(seconds=60, started={str(started)!r}))")
    )
    await until(started.exists)  # the call has reached the server: killing earlier tests an earlier moment
    os.kill(before, signal.SIGKILL)
    with pytest.raises(CodeExecutionError, match="demo") as info:
        await asyncio.wait_for(call, 30)
    assert info.value.ename == "ToolRunnerError"
    after = int((await executor.execute("print(pid.run(pid.Params()).result)")).text or 0)
    assert after != before


async def test_an_http_mcp_server_killed_mid_call_fails_that_call_and_works_again_once_back(
    executor: CodeExecutor, http_demo: HttpDemo, tmp_path: Path
) -> None:
    assert (
        await executor.execute("from mcptools.web import echo, slow\nprint(echo.run(echo.Params(text='up')))")
    ).text == "up"
    started = tmp_path / "started"
    call = asyncio.create_task(
        executor.execute(f"slow.run(slow.Params(seconds=60, started={str(started)!r}))")
    )
    await until(started.exists)  # the call has reached the server
    http_demo.kill()
    with pytest.raises(CodeExecutionError, match="web") as info:
        await asyncio.wait_for(call, 30)
    assert info.value.ename == "ToolRunnerError"
    # While it is down, a call fails with an error naming it rather than hanging (the bound only
    # turns a hang into a failure).
    with pytest.raises(CodeExecutionError, match="web"):
        await asyncio.wait_for(executor.execute("echo.run(echo.Params(text='down'))"), 30)
    http_demo.start()
    assert (await executor.execute("print(echo.run(echo.Params(text='back')))")).text == "back"


async def test_an_mcp_server_that_answers_nothing_fails_within_its_connect_timeout(
    executor: CodeExecutor,
) -> None:
    async with CodeExecutor(connect_timeout=CONNECT_TIMEOUT) as short:
        with pytest.raises(CodeExecutionError, match="mute") as info:
            await asyncio.wait_for(
                short.execute("from mcptools.mute import echo\necho.run(echo.Params(text='hello?'))"), 60
            )
        assert f"did not answer within {CONNECT_TIMEOUT} s" in str(info.value)
        assert (await short.execute("print('still here')")).text == "still here"


async def test_a_tool_call_that_never_answers_is_bounded_by_the_execution_timeout(
    executor: CodeExecutor,
) -> None:
    with pytest.raises(TimeoutError):
        await executor.execute(
            "from mcptools.demo import slow\nslow.run(slow.Params(seconds=3600))", timeout=2
        )
    assert (
        await executor.execute("from mcptools.demo import echo\nprint(echo.run(echo.Params(text='next')))")
    ).text == "next"


async def test_the_approval_side_going_away_mid_call_ends_the_call_and_a_late_decision_runs_nothing(
    executor: CodeExecutor,
) -> None:
    # A server of its own, marked on its command line: whether it ever started is visible.
    marker = f"witness-{time.monotonic_ns()}"
    await generate_mcp_sources(
        "witness", {**DEMO, "args": [*DEMO["args"], "--host", marker]}, Path("mcptools")
    )
    stream = executor.stream("from mcptools.witness import echo\necho.run(echo.Params(text='x'))")
    request = await anext(stream)
    assert isinstance(request, ApprovalRequest)
    await asyncio.wait_for(stream.aclose(), 30)  # the application walks away without deciding
    # Too late: its execution has ended, the call was refused, and the decision says so. (The
    # server itself was started before the question, to check the call against its tool list.)
    with pytest.raises(ApprovalDecisionError, match="already rejected"):
        await request.accept()
    assert (await executor.execute("print('next')")).text == "next"


async def test_a_cell_flooding_100_mb_of_output_ends_and_the_executor_works_on(
    executor: CodeExecutor,
) -> None:
    code = "import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range(100 * 1024):\n    sys.stdout.write(line)"
    result = await executor.execute(code, timeout=300)
    assert isinstance(result, CodeExecutionResult) and result.text is not None
    assert (await executor.execute("print('after the flood')")).text == "after the flood"


async def test_a_cell_that_never_ends_times_out_and_keeps_state(executor: CodeExecutor) -> None:
    await executor.execute("kept = 'yes'")
    with pytest.raises(TimeoutError):
        await executor.execute("while True:\n    pass", timeout=1)
    assert (await executor.execute("print(kept)")).text == "yes"


async def test_a_cell_blocked_in_c_code_times_out_into_a_kernel_restart_reported_as_such(
    executor: CodeExecutor,
) -> None:
    await executor.execute("lost = 'yes'")
    # SIGINT blocked in the kernel's main thread stands for any C code that never checks for
    # signals (a native library's loop, a wait without timeout): interrupting cannot stop it.
    blocked = (
        "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\ntime.sleep(3600)"
    )
    with pytest.raises(TimeoutError, match="restart") as info:
        await executor.execute(blocked, timeout=2)
    assert "state" in str(info.value)
    result = await executor.execute("print(globals().get('lost'))")
    assert result.text == "None"


async def test_the_gateway_killed_mid_cell_is_reported_and_the_executor_recovers(
    executor: CodeExecutor, tmp_path: Path
) -> None:
    await executor.execute("print('warm')")
    started = tmp_path / "started"
    call = asyncio.create_task(
        executor.execute(f"import time\nopen({str(started)!r}, 'x').close()\ntime.sleep(60)")
    )
    await until(started.exists)  # the cell runs
    (gateway,) = descendants("ipybox.gateway._main")
    for child in gateway.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ended with its parent
            child.kill()
    gateway.kill()
    with pytest.raises(CodeExecutionError) as info:
        await asyncio.wait_for(call, 60)
    assert "gateway" in str(info.value).lower() or "kernel died" in str(info.value).lower()
    result = await asyncio.wait_for(executor.execute("print('recovered')"), 120)
    assert result.text == "recovered"


async def test_the_gateway_killed_between_cells_is_reported_on_the_next_cell_and_the_executor_recovers(
    executor: CodeExecutor,
) -> None:
    await executor.execute("print('warm')")
    (gateway,) = descendants("ipybox.gateway._main")
    for child in gateway.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # one that ended with its parent
            child.kill()
    gateway.kill()
    gateway.wait(10)
    with pytest.raises(CodeExecutionError, match=r"gateway|kernel died"):
        await asyncio.wait_for(executor.execute("print('lost')"), 60)
    assert (await asyncio.wait_for(executor.execute("print('recovered')"), 120)).text == "recovered"


APPROVER = """
import asyncio, sys
from ipybox.tool_exec.approval.client import ApprovalClient

async def main():
    async def never_decide(request):
        print("ASKED", flush=True)
    async with ApprovalClient(never_decide, port=int(sys.argv[1])):
        print("CONNECTED", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_the_approval_process_killed_mid_call_fails_the_pending_call_at_once() -> None:
    from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
    from ipybox.tool_exec.server import ToolServer

    async with ToolServer(
        port=0, approval_required=True, approval_timeout=600, trust_all_clients=True
    ) as server:
        approver = await asyncio.create_subprocess_exec(
            sys.executable, "-c", APPROVER, str(server.port), stdout=asyncio.subprocess.PIPE
        )
        assert approver.stdout is not None
        runners: list[ToolRunner] = []
        try:
            assert await asyncio.wait_for(approver.stdout.readline(), 60) == b"CONNECTED\n"
            runner = ToolRunner("demo", DEMO, port=server.port)
            runners.append(runner)
            call = asyncio.create_task(runner.run("echo", {"text": "x"}))
            assert await asyncio.wait_for(approver.stdout.readline(), 60) == b"ASKED\n"
            approver.kill()
            # Far sooner than the 600 s approval timeout: the call fails once the channel drops.
            with pytest.raises(ToolRunnerError, match="disconnected"):
                await asyncio.wait_for(call, 30)
        finally:
            if approver.returncode is None:
                approver.kill()
            await approver.wait()
            for runner in runners:
                await runner.aclose()


APPLICATION = """
import asyncio, sys
from pathlib import Path
from ipybox import CodeExecutor

async def main():
    async with CodeExecutor(images_dir=Path("images"), sandbox=sys.argv[1] == "sandbox") as executor:
        await executor.execute("x = 1")
        print("RUNNING", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["plain", "sandbox"])
async def test_an_application_killed_with_sigkill_leaves_no_gateway_or_kernel_behind(
    mode: str, workdir: Path
) -> None:
    if mode == "sandbox":
        require_sandbox()
    application = await asyncio.create_subprocess_exec(
        sys.executable, "-c", APPLICATION, mode, stdout=asyncio.subprocess.PIPE, cwd=workdir
    )
    assert application.stdout is not None
    left: list[psutil.Process] = []
    try:
        assert await asyncio.wait_for(application.stdout.readline(), 120) == b"RUNNING\n"
        left = psutil.Process(application.pid).children(recursive=True)
        assert any("ipybox.gateway._main" in command_line(p) for p in left)
        assert any("ipykernel_launcher" in command_line(p) for p in left)
        application.kill()
        await application.wait()
        # The gateway reads end of file on the stdin the application held, stops, and its
        # kernels go with it (sandboxed ones through the lock the gateway held).
        _, alive = await asyncio.to_thread(psutil.wait_procs, left, 60)
        assert alive == [], f"left running after the application was killed: {alive}"
    finally:
        if application.returncode is None:
            application.kill()
            await application.wait()
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.kill()


SUBREAPER_GATEWAY = """
import asyncio, ctypes, sys
from ipybox.kernel_mgr.server import KernelGateway

async def main():
    async with KernelGateway(port=None, log_level="WARNING") as gateway:
        print(gateway.port, gateway.pid, flush=True)
        await asyncio.to_thread(sys.stdin.readline)

# Orphans are adopted here (PR_SET_CHILD_SUBREAPER) rather than by init, as under a service
# manager, a container's init or a test command that finds what was left running.
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
asyncio.run(main())
"""


def _start_kernel(port: int) -> None:
    request = urllib.request.Request(
        f"http://localhost:{port}/api/kernels", data=b'{"name": "ipybox-python"}', method="POST"
    )
    with contextlib.suppress(OSError):  # the gateway is killed before it answers
        urllib.request.urlopen(request, timeout=120).close()


def _ended(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


async def test_a_kernel_whose_gateway_is_killed_while_it_starts_ends_where_orphans_are_adopted() -> None:
    # ipykernel watches its parent only once it is up, and a parent gone by then it takes for
    # "none to watch": it waited for init to adopt it, which a subreaper never lets happen.
    helper = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SUBREAPER_GATEWAY, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert helper.stdin is not None and helper.stdout is not None
    kernels: list[psutil.Process] = []
    try:
        port, pid = map(int, (await asyncio.wait_for(helper.stdout.readline(), 120)).split())
        gateway = psutil.Process(pid)
        start = asyncio.create_task(asyncio.to_thread(_start_kernel, port))

        def started() -> bool:
            kernels[:] = gateway.children()
            return bool(kernels)

        await until(started, 60)
        # The kernel is held still as it appears, before anything of it runs, while its gateway dies.
        kernels[0].suspend()
        gateway.kill()
        await asyncio.to_thread(gateway.wait, 30)
        kernels[0].resume()
        await start
        await until(lambda: _ended(kernels[0]), 60)
    finally:
        helper.stdin.close()
        try:
            await asyncio.wait_for(helper.wait(), 60)
        finally:
            if helper.returncode is None:
                helper.kill()
                await helper.wait()
            for kernel in kernels:
                with contextlib.suppress(psutil.Error):
                    kernel.kill()


# The kernel hands the gateway's own output pipe (its inherited standard output, which ipykernel
# keeps on a descriptor of its own) to a program that leaves the kernel's process tree, and its
# process group (a session of its own): a kernel's shutdown may signal its whole group.
HOLD_GATEWAY_OUTPUT = """
import os, subprocess
gateway_output = os.readlink(f"/proc/{os.getppid()}/fd/1")
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the listing's own descriptor, closed once listed
        return None
held = next(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2 and target(fd) == gateway_output)
daemon = subprocess.run(
    ["sh", "-c", "sleep 600 2>/dev/null & echo $! >&2"], stdout=held, stderr=subprocess.PIPE, check=True,
    start_new_session=True,
)
print(gateway_output, int(daemon.stderr))
"""


@pytest.mark.parametrize("grace", [0, 0.05])
async def test_a_program_holding_the_gateways_output_cannot_make_stop_hang(grace: float) -> None:
    """A process that outlives the kernel and holds the gateway's output pipe cannot hang stop().

    On Python 3.11, waiting for a process whose output pipe asyncio holds ends only when every
    copy of that pipe is closed. When the gateway's exit came in after stop() began to wait
    (always so with no grace: it is killed and waited for at once), stop() waited for ever.
    """
    daemon = None
    async with KernelGateway(port=None) as gateway:
        try:
            async with KernelClient(port=gateway.port) as client:
                held = await client.execute(HOLD_GATEWAY_OUTPUT)
                pipe, pid = (held.text or "").split()
                daemon = psutil.Process(int(pid))
            # The program outlived the kernel, and holds the gateway's output.
            assert os.readlink(f"/proc/{pid}/fd/1") == pipe
            # A bound on a hang, not a timing check: stop() takes well under a second.
            async with asyncio.timeout(60):
                await gateway.stop(timeout=grace)
        finally:
            if daemon is not None:
                daemon.kill()
