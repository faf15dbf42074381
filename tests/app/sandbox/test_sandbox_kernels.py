"""Sandboxed kernels attacked from real kernel code: one kernel of an executor against its spare and
later kernels (private folders), and a kernel that tries to outlive its gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import socket
from pathlib import Path

import psutil
import pytest

from ipybox import CodeExecutionError, CodeExecutor
from ipybox.app.sandbox import find_srt  # private: the real srt, for a wrapper around it
from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway
from tests.conftest import command_line
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.slow

# Kernel code: find every other kernel's connection file in sight and run code in that kernel;
# plant an IPython startup file and a file in the temporary folder for kernels still to come.
# Prints the connection files found and what each connection did.
TAKE_OVER = """
import glob, json, os, tempfile
from IPython.paths import get_ipython_dir
from ipykernel.connect import get_connection_file
from jupyter_client import BlockingKernelClient

own = os.path.realpath(get_connection_file())
roots = {os.path.dirname(own), os.path.dirname(os.path.dirname(own)), tempfile.gettempdir()}
found = {}
for root in roots:
    for path in glob.glob(os.path.join(root, "**", "*.json"), recursive=True):
        path = os.path.realpath(path)
        if path == own or path in found:
            continue
        try:
            info = json.load(open(path))
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or "key" not in info:
            continue
        client = BlockingKernelClient(connection_file=path)
        try:
            client.load_connection_file()
            client.start_channels()
            reply = client.execute_interactive("planted = 'by the previous kernel'", timeout=20)
            found[path] = reply["content"]["status"]
        except Exception as exc:
            found[path] = repr(exc)
        finally:
            client.stop_channels()
startup = os.path.join(get_ipython_dir(), "profile_default", "startup")
os.makedirs(startup, exist_ok=True)
open(os.path.join(startup, "00-planted.py"), "w").write("planted_at_start = True\\n")
open(os.path.join(tempfile.gettempdir(), "planted.txt"), "w").write("x")
print(json.dumps(found))
"""

# Kernel code: what the attack left in this kernel.
TRACES = """
import os, tempfile
print(json.dumps({
    "variable": "planted" in globals(),
    "startup": "planted_at_start" in globals(),
    "tmp": os.path.exists(os.path.join(tempfile.gettempdir(), "planted.txt")),
}))
"""

# Kernel code: try everything that could keep this kernel alive without its gateway, and leave a
# detached process of its own behind.
OUTLIVE = """
import os, signal, subprocess, time
os._exit = lambda *args: None
for name in ("SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT", "SIGPIPE", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})
detached = subprocess.Popen(
    ["sleep", "100001"], start_new_session=True, stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
# vfork returns before exec has set the new command line: wait until it shows.
deadline = time.monotonic() + 30
while not open(f"/proc/{detached.pid}/cmdline").read() and time.monotonic() < deadline:
    time.sleep(0.001)
print(open(f"/proc/{detached.pid}/cmdline").read().split("\\0"))
"""


# Kernel code: replace this kernel's ZMQ socket files with links to a Unix socket of the host, then
# die, so that the gateway, reconnecting, would follow them.
PLANT_LINKS = """
import os
from ipykernel.connect import get_connection_file
folder = os.path.dirname(get_connection_file())
for name in os.listdir(folder):
    if name.startswith("ipc-"):
        os.unlink(os.path.join(folder, name))
        os.symlink(HOST, os.path.join(folder, name))
os._exit(1)
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    require_sandbox()
    path = tmp_path / "project"
    path.mkdir()
    return path


async def test_a_kernel_cannot_reach_its_spare_nor_plant_anything_for_kernels_after_a_reset(
    project: Path,
) -> None:
    async with CodeExecutor(sandbox=True, working_dir=project) as executor:
        await executor.execute("import json")
        # The spare kernel starts after the first execution: let it come up before the attack.
        # Private: the spare kernel is not exposed; the attack needs it up first.
        assert executor._kernels is not None
        kernel = executor._kernels.client
        assert kernel._spare is not None
        await kernel._spare
        found = json.loads(str((await executor.execute(TAKE_OVER, timeout=120)).text))
        assert found == {}, f"another kernel's connection file was in sight: {found}"
        # The first reset swaps in the spare (started before the attack), the second a kernel
        # started after it: neither shows a trace.
        for _ in range(2):
            await executor.reset()
            traces = json.loads(str((await executor.execute("import json\n" + TRACES)).text))
            assert traces == {"variable": False, "startup": False, "tmp": False}


async def test_a_sandboxed_kernel_that_defends_itself_ends_with_its_killed_gateway(project: Path) -> None:
    async with (
        KernelGateway(port=None, sandbox=True, working_dir=project) as gateway,
        KernelClient(port=gateway.port) as client,
    ):
        assert (await client.execute(OUTLIVE)).text == "['sleep', '100001', '']"
        assert gateway.pid is not None
        process = psutil.Process(gateway.pid)
        descendants = process.children(recursive=True)
        names = [command_line(proc) for proc in descendants]
        listing = "\n".join(name[:100] for name in names)
        assert any("ipykernel_launcher" in name for name in names), listing
        assert "sleep 100001" in names, listing
        process.kill()
        _, alive = await asyncio.to_thread(psutil.wait_procs, descendants, timeout=60)
        for proc in alive:
            proc.kill()
        assert alive == [], f"still running after the gateway was killed: {alive}"


async def test_the_gateway_follows_no_link_planted_in_place_of_a_kernel_socket(project: Path) -> None:
    host = project.parent / "host.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(host))
    listener.listen(64)
    listener.setblocking(False)
    try:
        async with CodeExecutor(sandbox=True, working_dir=project, spare_kernel=False) as executor:
            with pytest.raises(CodeExecutionError, match="died"):
                await executor.execute(PLANT_LINKS.replace("HOST", repr(str(host))))
            # The client saw the kernel die (the gateway noticed it) and works with a new kernel.
            assert (await executor.execute("print(1)")).text == "1"
        connections = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.accept()[0].close()
                connections += 1
        assert connections == 0, "the gateway connected to the host's socket through the planted links"
    finally:
        listener.close()


async def test_a_process_of_a_sandboxed_kernels_group_outside_the_gateways_tree_ends_with_its_stop(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found after a test run: a sandboxed kernel's srt proxy bridge (``socat UNIX-LISTEN:...
    claude-http-...sock,fork``) outlived its gateway. Stopping a gateway lists its tree, terminates
    it, and kills what is still running 50 ms later; a spare kernel's srt that is setting its sandbox
    up meanwhile handles the SIGTERM and starts its bridge after the listing, so the kill missed the
    bridge (the gateway's own shutdown, which kills each kernel's process group, had no time to run).
    Here srt runs through a wrapper that leaves one process in srt's process group outside the
    gateway's tree (its parent has ended), where such a bridge is at the kill: it must end with the
    gateway's stop, and so must every process of the kernel's (socat, bwrap)."""
    srt = find_srt()
    pid_file = tmp_path / "outside.pid"
    wrapper = tmp_path / "srt"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *ipykernel*) (sleep 100003 & echo $! >> {shlex.quote(str(pid_file))}) ;; esac\n'
        f'exec {shlex.quote(srt)} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("IPYBOX_SRT", str(wrapper))
    gateway = KernelGateway(port=None, sandbox=True, working_dir=project)
    await gateway.start()
    client = KernelClient(port=gateway.port)
    outside: list[psutil.Process] = []
    try:
        await client.connect()
        assert (await client.execute("print(1)")).text == "1"
        assert gateway.pid is not None
        tree = psutil.Process(gateway.pid).children(recursive=True)
        kernel = [proc for proc in tree if any(word in command_line(proc) for word in ("socat", "bwrap"))]
        assert kernel, "\n".join(command_line(proc)[:100] for proc in tree)
        outside = [psutil.Process(int(pid)) for pid in pid_file.read_text().split()]
        assert outside and all(
            proc not in tree and os.getpgid(proc.pid) in {leader.pid for leader in tree} for proc in outside
        )
        # As an executor stops its gateway (KernelHost): a grace of 50 ms, then the kill. The gateway
        # is paused first, as a loaded machine can hold it: its own shutdown, which kills each
        # kernel's process group, does not get to run within the grace.
        psutil.Process(gateway.pid).suspend()
        await gateway.stop(timeout=0.05)
        _, alive = await asyncio.to_thread(psutil.wait_procs, [*outside, *kernel], timeout=60)
        assert alive == [], [command_line(proc)[:100] for proc in alive]
    finally:
        await gateway.stop()
        with contextlib.suppress(Exception):  # broad: the gateway is gone; only the connection closes
            await client.disconnect()
        for proc in outside:
            with contextlib.suppress(psutil.Error):
                proc.kill()
