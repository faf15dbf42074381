"""A sandboxed kernel whose shell commands need approval cannot start a program by itself.

Attacked from kernel code in the real sandbox: every lower-level way to start a process fails
with ``PermissionError``, nobody is asked and nothing runs, while ``!cmd`` and ``%%bash`` still
work once accepted (they run on the tool server, in a sandbox of their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx2
import psutil
import pytest
import pytest_asyncio

from ipybox import ApprovalRequest, CodeExecutionError, CodeExecutionResult, CodeExecutor
from tests.sandbox_support import sandboxed_workdir

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield from sandboxed_workdir(tmp_path_factory, "walled")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def walled(workdir: Path) -> AsyncIterator[CodeExecutor]:
    async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir) as ex:
        yield ex


async def run(ex: CodeExecutor, code: str, decide: bool = True) -> list[object]:
    """Stream `code`, deciding every approval request."""
    items: list[object] = []
    async for item in ex.stream(code, timeout=60):
        items.append(item)
        if isinstance(item, ApprovalRequest):
            await (item.accept() if decide else item.reject())
    return items


def asked(items: list[object]) -> list[tuple[str, dict[str, object]]]:
    return [(i.tool_name, i.tool_args) for i in items if isinstance(i, ApprovalRequest)]


TOUCH = "import shutil\nTOUCH = shutil.which('touch')\nMARKER = {marker!r}\n"
# Each starts `touch MARKER` without asking, the way hostile code would.
ATTACKS = {
    "subprocess": "import subprocess\nsubprocess.run([TOUCH, MARKER])",
    "os.system": "import os\nstatus = os.system(f'{TOUCH} {MARKER}')\nif status: raise PermissionError(status)",
    "posix_spawn": "import os\nos.waitpid(os.posix_spawn(TOUCH, [TOUCH, MARKER], os.environ), 0)",
    "fork+execv": (
        "import os, pickle\nr, w = os.pipe()\npid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n        os.execv(TOUCH, [TOUCH, MARKER])\n"
        "    except OSError as exc:\n        os.write(w, pickle.dumps(exc))\n        os._exit(1)\n"
        "os.close(w)\nos.waitpid(pid, 0)\nerror = os.read(r, 65536)\nif error: raise pickle.loads(error)"
    ),
    # The kernel itself becomes `touch` if this works (and the cell then never ends).
    "execv": "import os\nos.execv(TOUCH, [TOUCH, MARKER])",
    "syscall(execve)": (
        "import ctypes, os, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = {'x86_64': 59, 'aarch64': 221}[platform.machine()]\n"
        "argv = (ctypes.c_char_p * 3)(TOUCH.encode(), MARKER.encode(), None)\n"
        "libc.syscall(nr, TOUCH.encode(), argv, None)\n"
        "raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))"
    ),
    "memfd+execveat": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = os.memfd_create('t')\nos.write(fd, open(TOUCH, 'rb').read())\n"
        "os.execve(fd, [TOUCH, MARKER], os.environ)"
    ),
    "an older thread": (
        # ipykernel's control thread was running before the filter was installed.
        "import os, threading\nimport concurrent.futures as cf\nfrom ipykernel.kernelapp import IPKernelApp\n"
        "control = IPKernelApp.instance().kernel.control_thread\n"
        "done = cf.Future()\n"
        "def attack():\n"
        "    try:\n"
        "        os.waitpid(os.posix_spawn(TOUCH, [TOUCH, MARKER], os.environ), 0)\n        done.set_result(None)\n"
        "    except BaseException as exc:\n        done.set_exception(exc)\n"
        "control.io_loop.add_callback(attack)\ndone.result(30)"
    ),
}


def check_blocked(result: CodeExecutionError | None, marker: Path, items: list[object]) -> None:
    assert not marker.exists(), "the program ran"
    assert asked(items) == []
    assert result is not None and result.ename == "PermissionError", result


@pytest.mark.parametrize("attack", ATTACKS)
async def test_no_way_around_the_shell_escape_starts_a_program(
    walled: CodeExecutor, workdir: Path, attack: str
) -> None:
    marker = workdir / f"ran-{attack.replace('+', '-').replace('(', '-').rstrip(')').replace(' ', '-')}"
    items: list[object] = []
    error: CodeExecutionError | None = None
    try:
        async for item in walled.stream(TOUCH.format(marker=str(marker)) + ATTACKS[attack], timeout=60):
            items.append(item)
            if isinstance(item, ApprovalRequest):
                await item.accept()
    except CodeExecutionError as exc:
        error = exc
    check_blocked(error, marker, items)


async def test_another_process_cannot_be_driven_to_start_one(walled: CodeExecutor) -> None:
    # ptrace and process_vm_writev on a child of the kernel (same user): both refused.
    code = (
        "import ctypes, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n    signal.pause()\n"
        "try:\n"
        "    attach = libc.ptrace(16, pid, None, None), ctypes.get_errno()\n"
        "    buffer = ctypes.create_string_buffer(8)\n"
        "    class IOVec(ctypes.Structure):\n"
        "        _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "    local = IOVec(ctypes.cast(buffer, ctypes.c_void_p), 8)\n"
        "    remote = IOVec(ctypes.cast(buffer, ctypes.c_void_p), 8)\n"
        "    write = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), ctypes.get_errno()\n"
        "    read = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), ctypes.get_errno()\n"
        "finally:\n    os.kill(pid, signal.SIGKILL)\n    os.waitpid(pid, 0)\n"
        "print(attach, write, read)"
    )
    result = await walled.execute(code, timeout=60)
    assert result.text == "(-1, 1) (-1, 1) (-1, 1)"


async def test_an_accepted_command_runs_outside_the_kernel_and_returns_its_output(
    walled: CodeExecutor, workdir: Path
) -> None:
    items = await run(walled, "word = 'hi'\n!echo {word} there; echo err >&2; touch accepted-ran")
    assert asked(items) == [("shell", {"cmd": "echo hi there; echo err >&2; touch accepted-ran"})]
    result = items[-1]
    assert isinstance(result, CodeExecutionResult) and result.text == "hi there\nerr"
    assert (workdir / "accepted-ran").exists()

    items = await run(walled, "lines = !printf 'a\\nb\\n'\n!exit 3\nprint(lines, _exit_code)")
    result = items[-1]
    assert isinstance(result, CodeExecutionResult) and result.text == "['a', 'b'] 3"

    # In the kernel's current folder.
    (workdir / "sub").mkdir(exist_ok=True)
    result = await walled.execute("import os\nos.chdir('sub')\nhere = !pwd\nprint(here)")
    assert result.text is not None and result.text.startswith(str([str(workdir / "sub")]))


async def test_a_script_cell_runs_with_its_cell_on_stdin(walled: CodeExecutor, workdir: Path) -> None:
    items = await run(walled, "%%bash --out captured\npwd\necho to-stderr >&2")
    assert asked(items) == [("shell_magic", {"magic": "bash", "cmd": "pwd\necho to-stderr >&2\n"})]
    result = await walled.execute("print(captured.strip())")
    assert result.text == str(workdir)
    with pytest.raises(CodeExecutionError) as info:
        await run(walled, "%%bash\nexit 4")
    assert info.value.ename == "CalledProcessError"


async def test_a_rejected_command_runs_nothing(walled: CodeExecutor, workdir: Path) -> None:
    for code in ("!touch rejected-ran", "x = !touch rejected-ran", "%%sh\ntouch rejected-ran"):
        with pytest.raises(CodeExecutionError, match="rejected by the application"):
            await run(walled, code, decide=False)
    assert not (workdir / "rejected-ran").exists()


async def test_the_filter_checks_the_architecture_first() -> None:
    from ipybox.kernel import _exec_wall  # private: the filter program is checked instruction by instruction

    for machine in ("x86_64", "aarch64"):
        program = _exec_wall.program(machine)
        assert program[0] == (0x20, 0, 0, 4)  # load the architecture
        assert program[2] == (0x06, 0, 0, 0x80000000)  # a foreign one kills the process
        assert program[-1] == (0x06, 0, 0, 0x00050000 | 1)  # denied: EPERM


async def test_the_sandbox_helpers_outside_the_wall_cannot_be_driven(walled: CodeExecutor) -> None:
    # bwrap and srt's socat proxies run in the kernel's sandbox without its filter: writing their
    # memory through /proc would make them start a program.
    code = (
        "import os\nopened, refused = [], []\n"
        "for pid in (p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()):\n"
        "    try:\n        fd = os.open(f'/proc/{pid}/mem', os.O_RDWR)\n"
        "    except PermissionError:\n        refused.append(pid)\n"
        "    except OSError:\n        pass\n"
        "    else:\n        os.close(fd)\n        opened.append(open(f'/proc/{pid}/comm').read().strip())\n"
        "print(opened, len(refused) > 0)"
    )
    result = await walled.execute(code, timeout=60)
    assert result.text == "[] True"


async def test_code_planted_for_the_next_kernel_runs_inside_its_wall(
    walled: CodeExecutor, workdir: Path
) -> None:
    # A module named like the kernel's launcher in the working directory, and IPython's kernel
    # configuration in the kernel's own (writable) IPython folder: both would run in the next
    # kernel before anything of ipybox's extension.
    marker = workdir / "planted-ran"
    plant = f"import subprocess, shutil\nsubprocess.run([shutil.which('touch'), {str(marker)!r}])\n"
    code = (
        "import os, pathlib\n"
        f"pathlib.Path('ipykernel_launcher.py').write_text({plant!r} + 'from ipykernel import kernelapp as app\\napp.launch_new_instance()\\n')\n"
        "profile = pathlib.Path(os.environ['IPYTHONDIR'], 'profile_default')\nprofile.mkdir(parents=True, exist_ok=True)\n"
        f"(profile / 'ipython_kernel_config.py').write_text({plant!r})\n"
    )
    await walled.execute(code, timeout=60)
    # Twice: the first new kernel may have been started (as a spare) before the plant.
    await walled.reset()
    await walled.reset()
    assert (await walled.execute("print(1 + 1)")).text == "2"
    assert not marker.exists()


async def wait_for(condition: Callable[[], bool], what: str, limit: float = 60) -> None:
    """Poll `condition` until it holds; fail after `limit` seconds."""
    async with asyncio.timeout(limit):
        while not condition():  # noqa: ASYNC110  # polls processes and files of other components
            await asyncio.sleep(0.05)


def sleeping(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if tag in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


async def test_an_interrupted_command_is_killed_with_its_sandbox(walled: CodeExecutor, workdir: Path) -> None:
    started = workdir / "long-started"

    async def long_command() -> None:
        async for item in walled.stream(f"!touch {started}; sleep 987654", timeout=300):
            if isinstance(item, ApprovalRequest):
                await item.accept()

    task = asyncio.create_task(long_command())
    await wait_for(started.exists, "the command's start")
    assert sleeping("987654")
    await walled.cancel()
    with pytest.raises(CodeExecutionError) as info:
        await task
    assert info.value.ename == "KeyboardInterrupt"
    await wait_for(lambda: not sleeping("987654"), "the command's end")


async def test_a_command_that_writes_too_much_is_stopped(walled: CodeExecutor) -> None:
    tool_server = walled._tool_server  # private: the executor does not expose its shell runner
    assert tool_server is not None and tool_server.confinement.shell_runner is not None
    confinement = tool_server.confinement
    assert confinement.shell_runner is not None
    small = dataclasses.replace(confinement.shell_runner, max_output=1000)
    tool_server.confine(dataclasses.replace(confinement, shell_runner=small))
    try:
        items = await run(walled, "out = !yes\nprint(len(out), sum(map(len, out)))")
    finally:
        tool_server.confine(confinement)
    result = items[-1]
    assert isinstance(result, CodeExecutionResult) and result.text is not None
    assert "was stopped: it wrote more than 1000 bytes" in result.text
    assert "500 500" in result.text.splitlines()


async def test_an_approved_command_is_not_a_program_the_kernel_planted(
    walled: CodeExecutor, workdir: Path
) -> None:
    # The person approves `ls`; a kernel that put its own `ls` first on its PATH must not get it run.
    marker = workdir / "planted-ls-ran"
    code = (
        "import os, pathlib, stat\n"
        "pathlib.Path('bin').mkdir(exist_ok=True)\n"
        f"pathlib.Path('bin/ls').write_text('#!/bin/sh\\ntouch {marker}\\n')\n"
        "os.chmod('bin/ls', 0o755)\n"
        "os.environ['PATH'] = os.path.abspath('bin') + os.pathsep + os.environ['PATH']\n"
        "!ls -d bin"
    )
    items = await run(walled, code)
    result = items[-1]
    assert isinstance(result, CodeExecutionResult) and result.text == "bin"
    assert not marker.exists()


async def test_the_shell_endpoint_needs_the_token_and_a_runner() -> None:
    from ipybox.tool_exec.server import ToolServer

    async with (
        ToolServer(port=0, token="secret", approval_required=False, trust_all_clients=True) as server,
        httpx2.AsyncClient() as http,
    ):
        url = f"http://localhost:{server.port}/shell"
        body = {"kind": "shell", "cmd": "true", "cwd": "/"}
        response = await http.post(url, json=body)
        assert response.status_code == 401
        headers = {"Authorization": "Bearer secret"}
        response = await http.post(url, json={**body, "path": "/planted"}, headers=headers)
        assert response.status_code == 400 and "malformed" in response.json()["error"]["message"]
        response = await http.post(url, json=body, headers=headers)
        assert response.status_code == 400
        assert "runs no shell commands" in response.json()["error"]["message"]


async def test_without_landlock_the_start_fails_and_says_what_to_do(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stands in for a machine without Landlock (the check runs in the application, before any kernel).
    # Private: the check is patched, as no machine here lacks Landlock on demand.
    from ipybox.errors import SandboxUnavailableError
    from ipybox.kernel import _exec_wall

    monkeypatch.setattr(_exec_wall, "unavailable", lambda: "Landlock is not available (test)")
    with pytest.raises(SandboxUnavailableError, match="approve_shell_cmds=False"):
        async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir):
            pass


async def test_an_accepted_command_sees_no_ipc_object_of_the_host(walled: CodeExecutor) -> None:
    # A SysV segment of this process (0600): an approved command sees none of the host's.
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x1C000000 | (os.getpid() & 0xFFFFFF)
    shmid = libc.shmget(key, 4096, 0o1000 | 0o600)
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        assert str(key) in await asyncio.to_thread(Path("/proc/sysvipc/shm").read_text)
        items = await run(walled, "!cat /proc/sysvipc/shm")
        result = items[-1]
        assert isinstance(result, CodeExecutionResult) and result.text is not None
        assert "shmid" in result.text and str(key) not in result.text, result.text
    finally:
        libc.shmctl(shmid, 0, None)


def gateways() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if "ipybox.gateway._main" in _cmdline(p)}


def _cmdline(process: psutil.Process) -> str:
    # A child that ended meanwhile (a zombie not reaped yet, or gone) is no gateway of ours.
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


async def test_approved_commands_still_run_after_a_dead_gateway_was_replaced(workdir: Path) -> None:
    # The tool server runs an approved command in the kernels' own sandbox: after the gateway died
    # and a new one took over, that is the new gateway's (the old one's settings are gone).
    before = gateways()
    async with CodeExecutor(sandbox=True, approve_shell_cmds=True, working_dir=workdir) as ex:
        assert (await ex.execute("print('warm')")).text == "warm"
        (pid,) = gateways() - before
        gateway = psutil.Process(pid)
        for process in [*gateway.children(recursive=True), gateway]:
            with contextlib.suppress(psutil.NoSuchProcess):  # one that ended with its parent
                process.kill()
        gateway.wait(10)
        with pytest.raises(CodeExecutionError, match=r"gateway|kernel died"):
            await ex.execute("print('lost')", timeout=60)
        items = await run(ex, "!echo after the new gateway")
        result = items[-1]
        assert isinstance(result, CodeExecutionResult) and result.text == "after the new gateway", result
