"""`KernelPool`: one gateway for many executors, kernels handed out once, sessions kept apart.

The isolation tests are attacks: two executors on one pool, one of them hostile, each with its own
tool server; the hostile kernel tries to reach the other's tool server, token, folders and kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from ipybox import CodeExecutionError, CodeExecutor, KernelPool, generate_mcp_sources
from tests.conftest import DEMO_SERVER
from tests.sandbox_support import numbered_folders, require_sandbox

pytestmark = pytest.mark.slow

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


async def _until(predicate: object, timeout: float = 60) -> None:
    """Wait, bounded, until `predicate()` is true (what it waits for happens in another process)."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.05)


def _gateways() -> list[psutil.Process]:
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "ipybox.gateway._main" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


def _kernel_id(executor: CodeExecutor) -> str:
    # private: which gateway kernel an executor holds; no public API names it
    kernels = executor._kernels
    assert kernels is not None
    return kernels.client.kernel_id


def test_an_executor_whose_kernel_settings_differ_from_the_pool_is_refused() -> None:
    pool = KernelPool(size=0, sandbox=False, max_processes=64)
    with pytest.raises(ValueError, match=r"max_processes=None \(the pool's: 64\)"):
        CodeExecutor(pool=pool)
    with pytest.raises(ValueError, match="sandbox=True"):
        CodeExecutor(pool=pool, sandbox=True, max_processes=64)
    with pytest.raises(ValueError, match="kernel_gateway_port"):
        CodeExecutor(pool=pool, max_processes=64, kernel_gateway_port=0)
    with pytest.raises(ValueError, match="size must be"):
        KernelPool(size=-1)
    CodeExecutor(pool=pool, max_processes=64)


async def test_a_kernel_is_handed_out_once_and_a_reset_takes_a_fresh_one_from_the_same_gateway(
    tmp_path: Path,
) -> None:
    async with KernelPool(size=2, working_dir=tmp_path) as pool:
        seen: list[str] = []
        async with (
            CodeExecutor(pool=pool, working_dir=tmp_path) as first,
            CodeExecutor(pool=pool, working_dir=tmp_path) as second,
        ):
            for executor in (first, second):
                await executor.execute("x = 1")
                seen.append(_kernel_id(executor))
                await executor.reset()
                with pytest.raises(CodeExecutionError, match="NameError"):
                    await executor.execute("x")
                seen.append(_kernel_id(executor))
            assert len(_gateways()) == 1
        async with CodeExecutor(pool=pool, working_dir=tmp_path) as third:
            assert (await third.execute("print(1)")).text == "1"
            seen.append(_kernel_id(third))
    assert len(seen) == len(set(seen)) == 5


async def test_the_pool_keeps_no_more_ready_kernels_than_the_memory_holds_and_still_serves_executors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ipybox.app.pool import _capacity  # private: the machine's memory, as the pool reads it

    mib = 1024 * 1024
    # 600 MiB available: the 512 MiB reserve leaves no room for a 128 MiB ready kernel.
    monkeypatch.setattr(_capacity, "available_memory", lambda: 600 * mib)
    async with KernelPool(size=2, working_dir=tmp_path) as pool:
        assert pool.ready == 0
        assert "keeps 0 kernels ready, not 2" in caplog.text
        # Memory is back: the kernel an executor asks for is started, and the pool fills again.
        monkeypatch.setattr(_capacity, "available_memory", lambda: 8192 * mib)
        async with CodeExecutor(pool=pool, working_dir=tmp_path) as executor:
            assert (await executor.execute("print(1)")).text == "1"
            await asyncio.wait_for(pool.filled(), 120)
            assert pool.ready == 2


@pytest.mark.parametrize("sandbox", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_a_launcher_planted_in_the_pools_folder_runs_in_no_kernel_the_pool_starts_later(
    tmp_path: Path, sandbox: bool
) -> None:
    """Attack: a module named like the kernel's launcher in the folder kernels start in would run
    in every kernel started there later, before its hand-out: in another executor's kernel, where
    it would see that executor's token and cells."""
    if sandbox:
        require_sandbox()
    marker = tmp_path / "planted-ran"
    plant = (
        f"open({str(marker)!r}, 'a').write('ran')\n"
        "import sys, runpy\nsys.path.pop(0)\nrunpy.run_module('ipykernel_launcher', run_name='__main__')\n"
    )
    async with KernelPool(size=1, working_dir=tmp_path, sandbox=sandbox, refill_delay=0) as pool:
        async with CodeExecutor(pool=pool, working_dir=tmp_path, sandbox=sandbox) as hostile:
            await hostile.execute(f"open('ipykernel_launcher.py', 'w').write({plant!r})")
            # Twice: the first kernel taken may have been started before the plant.
            await hostile.reset()
            await hostile.reset()
            assert (await hostile.execute("print(1 + 1)")).text == "2"
        async with CodeExecutor(pool=pool, working_dir=tmp_path, sandbox=sandbox) as victim:
            assert (await victim.execute("print(2 + 2)")).text == "4"
    assert not marker.exists()


@pytest_asyncio.fixture
async def demo_dir(tmp_path: Path) -> AsyncIterator[Path]:
    work = tmp_path / "work"
    work.mkdir()
    await generate_mcp_sources("demo", DEMO, work / "mcptools")
    yield work


ATTACK = """
import json, os, socket, http.client
from ipybox.tool_exec.client import ToolRunner
target = json.loads({target!r})
found = {{}}
# Its own tool server address is its own; the victim's token is nowhere in its environment.
found["token_in_env"] = target["token"] in json.dumps(dict(os.environ))
found["own_token"] = os.environ.get("TOOL_SERVER_TOKEN") == target["token"]
# Call the victim's tool server with the token this kernel was given: over TCP, its socket, the
# link to that socket in the victim kernel's own folder.
found["call"] = []
for socket_path in dict.fromkeys(("", target["socket"] or "", target["kernel_socket"])):
    try:
        ToolRunner("demo", {{}}, port=target["port"], socket_path=socket_path).run_sync("echo", {{"text": "stolen"}})
        found["call"].append("ran")
    except Exception as exc:
        found["call"].append(type(exc).__name__ + ": " + str(exc)[:200])
# Read the victim's private folders and connection file; plant in them.
for name in ("tmp", "ipython", "connection_file", "socket_dir"):
    path = target[name]
    try:
        os.listdir(path) if os.path.isdir(path) else open(path).read()
        found["read_" + name] = True
    except OSError:
        found["read_" + name] = False
for name in ("tmp", "ipython"):
    try:
        os.makedirs(os.path.join(target[name], "profile_default", "startup"), exist_ok=True)
        with open(os.path.join(target[name], "profile_default", "startup", "00-evil.py"), "w") as f:
            f.write("import os; os.environ['PWNED'] = '1'")
        with open(os.path.join(target[name], "evil_mod.py"), "w") as f:
            f.write("PWNED = 1")
        found["plant_" + name] = True
    except OSError:
        found["plant_" + name] = False
print(json.dumps(found))
"""

VICTIM_FACTS = """
import json, os, tempfile, IPython
from ipykernel.connect import get_connection_file
print(json.dumps({"tmp": tempfile.gettempdir(), "ipython": IPython.paths.get_ipython_dir(),
                  "connection_file": get_connection_file(),
                  "kernel_socket": os.environ.get("TOOL_SERVER_SOCKET") or ""}))
"""


@pytest.mark.parametrize("sandbox", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_a_hostile_kernel_on_a_shared_pool_cannot_reach_another_sessions_tools_token_or_folders(
    demo_dir: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    import json

    async with KernelPool(size=2, sandbox=sandbox, working_dir=demo_dir) as pool:
        options = {"pool": pool, "sandbox": sandbox, "working_dir": demo_dir, "approve_tool_calls": False}
        async with CodeExecutor(**options) as victim, CodeExecutor(**options) as hostile:  # type: ignore[arg-type]
            assert (
                await victim.execute(
                    "from mcptools.demo import echo\nprint(echo.run(echo.Params(text='own')))"
                )
            ).text == "own"
            assert (
                await hostile.execute(
                    "from mcptools.demo import echo\nprint(echo.run(echo.Params(text='own')))"
                )
            ).text == "own"
            facts = json.loads((await victim.execute(VICTIM_FACTS)).text or "")
            # private: the victim's tool server address and token, the loot the attack tries to use
            server = victim._tool_server
            assert server is not None and server.token is not None
            socket_dir = str(server.uds.parent) if server.uds is not None else facts["tmp"]
            target = {
                **facts,
                "token": server.token,
                "port": server.port,
                "socket": str(server.uds) if server.uds is not None else None,
                "socket_dir": socket_dir,
            }
            found = json.loads((await hostile.execute(ATTACK.format(target=json.dumps(target)))).text or "")
            assert "ran" not in found["call"], found
            assert found["token_in_env"] is False
            assert found["own_token"] is False
            if sandbox:
                # Unsandboxed, a kernel runs as the user and can read what the user can (see the README).
                for name in ("tmp", "ipython", "connection_file", "socket_dir"):
                    assert found["read_" + name] is False, (name, found)
                # What it wrote there went to a view of its own (the sandbox's), not the victim's folders.
                for name in ("tmp", "ipython"):
                    assert not (Path(facts[name]) / "evil_mod.py").exists(), found
            # Whatever it planted (unsandboxed) runs in no other kernel: each has its own folders.
            await victim.reset()
            check = "import os, importlib.util\nprint(os.environ.get('PWNED'), importlib.util.find_spec('evil_mod'))"
            assert (await victim.execute(check)).text == "None None"
            async with CodeExecutor(**options) as later:  # type: ignore[arg-type]
                assert (await later.execute(check)).text == "None None"


PLANT = """
import os
found = {{}}
try:
    found["listed"] = os.listdir({victim!r})
except OSError as exc:
    found["listed"] = type(exc).__name__
try:
    with open(os.path.join({victim!r}, "evil_mod.py"), "w") as f:
        f.write("PWNED = 1")
    found["planted"] = True
except OSError:
    found["planted"] = False
print(found)
"""


async def test_sandboxed_kernels_in_folders_of_their_own_cannot_plant_on_each_others_import_path(
    tmp_path: Path,
) -> None:
    require_sandbox()
    root = tmp_path
    sessions = root / "sessions"
    sessions.mkdir()
    new_folder = numbered_folders(sessions)

    async with KernelPool(
        size=2, sandbox=True, working_dir=root, new_folder=new_folder, sandbox_hidden=(sessions,)
    ) as pool:
        await _until(lambda: pool.ready == 2)
        options = {"pool": pool, "sandbox": True, "sandbox_hidden": (sessions,)}
        victim_dir, hostile_dir = pool.claim(), pool.claim()
        (victim_dir / "notes.txt").write_text("private")
        async with (
            CodeExecutor(working_dir=victim_dir, **options) as victim,  # type: ignore[arg-type]
            CodeExecutor(working_dir=hostile_dir, **options) as hostile,  # type: ignore[arg-type]
        ):
            assert (await victim.execute("import os; print(os.getcwd())")).text == str(victim_dir)
            assert (await hostile.execute("import os; print(os.getcwd())")).text == str(hostile_dir)
            found = (await hostile.execute(PLANT.format(victim=str(victim_dir)))).text or ""
            assert "notes.txt" not in found and not (victim_dir / "evil_mod.py").exists(), found
            check = "import importlib.util\nprint(importlib.util.find_spec('evil_mod'))"
            assert (await victim.execute(check)).text == "None"
            # A reset starts a fresh kernel in the same folder of its own.
            await victim.reset()
            assert (await victim.execute("import os; print(open('notes.txt').read(), os.getcwd())")).text == (
                f"private {victim_dir}"
            )


@pytest.mark.parametrize("sandbox", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_a_killed_gateway_is_restarted_once_and_every_executor_on_it_recovers(
    tmp_path: Path, sandbox: bool
) -> None:
    if sandbox:
        require_sandbox()
    async with KernelPool(size=1, sandbox=sandbox, working_dir=tmp_path) as pool:
        options = {"pool": pool, "sandbox": sandbox, "working_dir": tmp_path}
        async with CodeExecutor(**options) as first, CodeExecutor(**options) as second:  # type: ignore[arg-type]
            for executor in (first, second):
                await executor.execute("x = 1")
            (gateway,) = _gateways()
            for child in gateway.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):  # one that ended with its parent
                    child.kill()
            gateway.kill()
            gateway.wait(10)
            for executor in (first, second):
                with pytest.raises(CodeExecutionError, match=r"gateway|kernel died"):
                    await asyncio.wait_for(executor.execute("print(x)"), 120)
            # private: counts gateway restarts; no public API reports them
            assert pool.generation == 1
            for executor in (first, second):
                assert (
                    await asyncio.wait_for(executor.execute("print('recovered')"), 120)
                ).text == "recovered"
            assert len(_gateways()) == 1


@pytest.mark.parametrize("sandbox", [False, True], ids=["unsandboxed", "sandboxed"])
async def test_a_stopped_pool_leaves_no_process_running(tmp_path: Path, sandbox: bool) -> None:
    if sandbox:
        require_sandbox()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    async with KernelPool(size=2, sandbox=sandbox, working_dir=tmp_path) as pool:
        await _until(lambda: pool.ready == 2)
        async with CodeExecutor(pool=pool, sandbox=sandbox, working_dir=tmp_path) as executor:
            await executor.execute(
                "import threading, time; threading.Thread(target=time.sleep, args=(600,)).start()"
            )
            # A process the kernel started, left running when the executor stops.
            await executor.execute("import subprocess; subprocess.Popen(['sleep', '600'])")
    await _until(lambda: {p.pid for p in psutil.Process().children(recursive=True)} <= before, 30)


async def test_approved_shell_commands_of_a_pooled_kernel_run_in_its_own_folder(tmp_path: Path) -> None:
    require_sandbox()
    from ipybox import ApprovalRequest, CodeExecutionResult

    sessions = tmp_path / "sessions"
    sessions.mkdir()
    new_folder = numbered_folders(sessions)

    async with KernelPool(
        size=1,
        sandbox=True,
        working_dir=tmp_path,
        approve_shell_cmds=True,
        new_folder=new_folder,
        sandbox_hidden=(sessions,),
    ) as pool:
        unused = pool.claim()
        await pool.unclaim(unused)  # no executor will work there: its kernel is shut down
        # private: no public API lists claimed folders
        assert unused not in pool._claimed
        folder = pool.claim()
        options = {"pool": pool, "sandbox": True, "approve_shell_cmds": True, "sandbox_hidden": (sessions,)}
        async with CodeExecutor(working_dir=folder, **options) as executor:  # type: ignore[arg-type]
            texts = []
            async for item in executor.stream("!pwd; touch made.txt"):
                if isinstance(item, ApprovalRequest):
                    await item.accept()
                elif isinstance(item, CodeExecutionResult):
                    texts.append(item.text)
            assert texts == [str(folder)]
            assert (folder / "made.txt").exists()


@pytest.mark.parametrize("own_folders", [False, True], ids=["pool-folder", "own-folders"])
async def test_an_approved_command_of_one_session_cannot_plant_for_another_sessions_commands(
    tmp_path: Path, own_folders: bool
) -> None:
    # Session A's approved command writes an IPython startup file where its IPYTHONDIR points;
    # session B's approved `python -m IPython` must not run it (the runner's folders were shared).
    require_sandbox()
    from ipybox import ApprovalRequest

    sessions = tmp_path / "sessions"
    sessions.mkdir()
    new_folder = numbered_folders(sessions)

    async def accepted(executor: CodeExecutor, code: str) -> str:
        text = ""
        async for item in executor.stream(code, timeout=120):
            if isinstance(item, ApprovalRequest):
                await item.accept()
            else:
                text = getattr(item, "text", None) or text
        return text

    options: dict[str, Any] = {"sandbox": True, "approve_shell_cmds": True, "sandbox_hidden": (sessions,)}
    folders = new_folder if own_folders else None
    async with KernelPool(size=1, working_dir=tmp_path, new_folder=folders, **options) as pool:
        a_dir, b_dir = (pool.claim(), pool.claim()) if own_folders else (tmp_path, tmp_path)
        async with (
            CodeExecutor(pool=pool, working_dir=a_dir, **options) as a,
            CodeExecutor(pool=pool, working_dir=b_dir, **options) as b,
        ):
            marker = b_dir / "planted-startup-ran"
            plant = (
                "%%bash\n"
                'mkdir -p "$IPYTHONDIR/profile_default/startup"\n'
                f"echo \"open('{marker}', 'w').close()\" > \"$IPYTHONDIR/profile_default/startup/00.py\"\n"
                'echo "$IPYTHONDIR $TMPDIR $XDG_CACHE_HOME"\n'
            )
            a_folders = (await accepted(a, plant)).split()
            out = await accepted(b, "%%bash\npython -m IPython -c 'print(41 + 1)'\necho \"$IPYTHONDIR\"\n")
            assert "42" in out
            # Nor can a command write to the folder that all commands shared before, found from its own.
            probe = '%%bash\ntouch "$(dirname "$(dirname "$TMPDIR")")/tmp/probe" 2>/dev/null && echo wrote || echo refused\n'
            assert (await accepted(b, probe)).strip() == "refused"
            assert not marker.exists()
            # Not even A's own next command sees what its last one left.
            again = await accepted(a, '%%bash\nls "$IPYTHONDIR/profile_default/startup" || echo gone\n')
            assert "gone" in again
            assert a_folders[0] not in out
