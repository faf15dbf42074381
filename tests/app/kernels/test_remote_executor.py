"""`CodeExecutor(kernel_gateway_url=...)`: the executor's kernel on an existing gateway.

Each gateway runs on a "remote host" (tests/remote_support.py): a network namespace of its own
with a private ``/tmp``, reached through one forwarded port, with no route back and no shared
folder the tests write. The same cases run against a plain Jupyter Kernel Gateway (ipykernel 7,
binary WebSocket protocol) and, when ``bash scripts/test-remote.sh`` provides it, Enterprise
Gateway 3.3 (Jupyter Server 1: plain JSON protocol; ipykernel 6).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import sys
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.client.stdio import StdioServerParameters

from ipybox import (
    ApprovalRequest,
    CodeExecutionChunk,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)

# private-ok: settings and CLI parsing are checked without a process; the token tests read the
# executor's tool server token and kernel id, the secrets and the target of the attacks.
from ipybox._wire import UserEnv
from ipybox.app._settings import ExecutorSettings
from ipybox.errors import KernelConnectionError, KernelStartTimeoutError
from ipybox.mcp_server._cli import parse_args
from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of
from tests.remote_support import (
    EXECUTOR_GATEWAY_KINDS,
    INNER_PORT,
    NEVER_STARTS,
    RemoteGateway,
    remote_gateway,
    remote_gateway_unavailable,
)

# A folder of the kernel's host: inside the namespace's private /tmp, absent on this machine.
REMOTE_DIR = "/tmp/ipybox-remote-work"
# A 1x1 PNG, shown without matplotlib (Enterprise Gateway's environment has none).
PNG_CELL = """
import base64
from IPython.display import Image, display
display(Image(data=base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)))
"""


def _started(kind: str) -> Generator[RemoteGateway, None, None]:
    reason = remote_gateway_unavailable(kind)
    if reason is not None:
        pytest.skip(reason)
    with remote_gateway(kind) as running:
        yield running


@pytest.fixture(scope="module", params=EXECUTOR_GATEWAY_KINDS)
def gateway(request: pytest.FixtureRequest) -> Iterator[RemoteGateway]:
    """A running remote gateway of each kind, shared by the module's tests."""
    yield from _started(request.param)


def remote(gateway: RemoteGateway, **kwargs: Any) -> CodeExecutor:
    options: dict[str, Any] = {
        "kernel_gateway_url": gateway.url,
        "kernel_gateway_token": gateway.token,
        "kernel_name": gateway.kernel_name,
        "working_dir": REMOTE_DIR,
        "kernel_start_timeout": 60,
    }
    return CodeExecutor(**{**options, **kwargs})


def remote_server(gateway: RemoteGateway, workspace: Path, **env: str) -> StdioServerParameters:
    """The ``ipybox`` MCP server (stdio) with its sessions' kernels on `gateway`, and `env` set."""
    return stdio_params(
        workspace,
        "--kernel-gateway-url",
        gateway.url,
        "--kernel-name",
        gateway.kernel_name,
        env=server_env(**{UserEnv.KERNEL_GATEWAY_TOKEN: gateway.token, **env}),
    )


@pytest.fixture
async def executor(gateway: RemoteGateway, tmp_path: Path) -> AsyncIterator[CodeExecutor]:
    async with remote(gateway, images_dir=tmp_path / "images") as running:
        yield running


async def kernels_on(gateway: RemoteGateway) -> list[dict[str, Any]]:
    async with httpx2.AsyncClient(headers={"Authorization": f"token {gateway.token}"}) as client:
        response = await client.get(f"{gateway.url}/api/kernels")
        response.raise_for_status()
        kernels: list[dict[str, Any]] = response.json()
        return kernels


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("sandbox", True),
        ("memory_limit", "1G"),
        ("max_processes", 64),
        ("kernel_gateway_host", "0.0.0.0"),
        ("kernel_gateway_port", 8888),
        ("sandbox_hidden", (Path("/srv"),)),
    ],
)
def test_options_that_need_a_local_kernel_are_refused_with_the_reason(option: str, value: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"^{option} cannot be used with kernel_gateway_url: .*\. Drop {option}\."
    ):
        CodeExecutor(kernel_gateway_url="http://gateway:8888", **{option: value})


def test_sandbox_config_is_refused_remotely_as_well() -> None:
    with pytest.raises(ValueError, match="sandbox_config cannot be used with kernel_gateway_url"):
        ExecutorSettings(kernel_gateway_url="http://gateway:8888", sandbox_config=Path("srt.json"))
    with pytest.raises(
        ValueError, match="sandbox cannot be used with kernel_gateway_url: the kernel does not run"
    ):
        ExecutorSettings(kernel_gateway_url="http://gateway:8888", sandbox=True)


@pytest.mark.parametrize("url", ["gateway:8888", "ftp://gateway", "http://", ""])
def test_a_gateway_url_that_is_no_http_address_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="kernel_gateway_url must be the http:// or https:// address"):
        CodeExecutor(kernel_gateway_url=url)


def test_token_and_kernel_name_need_a_gateway_url_and_a_remote_working_dir_is_absolute() -> None:
    with pytest.raises(ValueError, match="kernel_gateway_token was given without kernel_gateway_url"):
        CodeExecutor(kernel_gateway_token="secret")
    with pytest.raises(ValueError, match="kernel_name was given without kernel_gateway_url"):
        CodeExecutor(kernel_name="python3")
    with pytest.raises(ValueError, match="working_dir='work' is relative; with kernel_gateway_url"):
        CodeExecutor(kernel_gateway_url="http://gateway:8888", working_dir="work")
    with pytest.raises(ValueError, match="kernel_start_timeout must be a positive number of seconds"):
        CodeExecutor(kernel_gateway_url="http://gateway:8888", kernel_start_timeout=0)


@pytest.mark.slow
async def test_the_setup_cells_are_hidden_and_the_first_cell_is_in_1(
    executor: CodeExecutor, tmp_path: Path
) -> None:
    # The setup cell and the uploads run before the agent's first cell, counting nothing.
    count = "print(len(In) - 1)"  # this cell is In[1]: the first the history holds
    assert (await executor.execute(count)).text == "1"
    (tmp_path / "up.txt").write_text("up")
    await executor.upload(tmp_path / "up.txt")
    assert (await executor.execute(count)).text == "2"  # an upload to the live kernel counts nothing either
    await executor.reset()
    assert (await executor.execute(count)).text == "1"
    assert (await executor.execute("print(open('up.txt').read())")).text == "up"


@pytest.mark.slow
async def test_download_brings_a_file_back_and_refuses_what_the_kernel_forges(executor: CodeExecutor) -> None:
    await executor.execute("open('small.txt', 'w').write('back')\nimport os\nos.symlink('small.txt', 'link')")
    assert await executor.download("small.txt") == b"back"
    for path, refused in [
        ("missing.txt", "FileNotFoundError"),
        ("link", "OSError"),
        (".", "IsADirectoryError"),
    ]:
        with pytest.raises(ValueError, match=f"could not read {path!r}: {refused}"):
            await executor.download(path)
    with pytest.raises(ValueError, match="over the limit of 2"):
        await executor.download("small.txt", max_bytes=2)
    # Attack: code in the kernel changes what the reader sends back.
    for encoded, refused in [
        (b"!!!!", "not a piece of a file"),
        (b"QUJDREVG", "changed while it was read"),  # 6 bytes for a file of 4
    ]:
        await executor.execute(
            f"import base64\n_real = base64.b64encode\nbase64.b64encode = lambda data: {encoded!r}"
        )
        with pytest.raises(ValueError, match=refused):
            await executor.download("small.txt")
        await executor.execute("base64.b64encode = _real")
    assert await executor.download("small.txt") == b"back"


async def test_a_snapshot_of_a_remote_kernel_travels_over_the_gateways_connection(
    executor: CodeExecutor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await executor.execute(
        "import json\nrows = [{'n': i} for i in range(1000)]\nblob = bytes(5 * 1024 * 1024)\n"
        "def triple(v):\n    return v * 3"
    )
    report = await executor.save_snapshot(tmp_path / "remote.snap")
    assert {"rows", "blob"} <= set(report.names) and report.modules == {"json": "json"}
    assert report.working_dir == REMOTE_DIR and report.size > 5 * 1024 * 1024
    await executor.reset()
    loaded = await executor.load_snapshot(tmp_path / "remote.snap")
    assert set(loaded.names) == set(report.names)
    result = await executor.execute("print(len(rows), rows[-1], len(blob), json.dumps([1]))")
    assert result.text == "1000 {'n': 999} 5242880 [1]"
    if "triple" in report.names:
        assert (await executor.execute("print(triple(2))")).text == "6"
    else:  # Enterprise Gateway's kernels have no cloudpickle: said so, not half-saved
        assert "cloudpickle" in report.left_out["triple"]
    # Attack: a pickle that runs code when loaded runs it on the kernel's host, never here.
    marker = "/tmp/ipybox-snapshot-unpickled"
    payload = f"open({marker!r}, 'w').close()"
    await executor.execute(
        f"class Evil:\n    def __reduce__(self):\n        return (exec, ({payload!r},))\nevil = Evil()"
    )
    await executor.save_snapshot(tmp_path / "evil.snap")

    def tripwire(*args: object, **kwargs: object) -> object:
        raise AssertionError("the application unpickled a snapshot")

    import pickle

    monkeypatch.setattr(pickle, "loads", tripwire)
    monkeypatch.setattr(pickle, "Unpickler", tripwire)
    await executor.reset()
    await executor.load_snapshot(tmp_path / "evil.snap")
    monkeypatch.undo()
    assert (await executor.execute(f"import os\nprint(os.path.exists({marker!r}))")).text == "True"
    assert not await asyncio.to_thread(Path(marker).exists)


def test_the_token_is_kept_out_of_the_settings_repr() -> None:
    settings = ExecutorSettings(kernel_gateway_url="http://gateway:8888", kernel_gateway_token="s3cret-token")
    assert settings.remote
    assert "s3cret-token" not in repr(settings)
    assert not ExecutorSettings().remote


@pytest.mark.slow
async def test_code_runs_in_the_working_dir_on_the_kernels_host(executor: CodeExecutor) -> None:
    result = await executor.execute("import os\nx = 21\nprint(os.getcwd())")
    assert result.text == REMOTE_DIR
    assert not await asyncio.to_thread(Path(REMOTE_DIR).exists)  # the kernel's host, not this machine
    assert (await executor.execute("print(x * 2)")).text == "42"


@pytest.mark.slow
async def test_a_cell_that_leaves_the_working_dir_is_put_back_as_locally(executor: CodeExecutor) -> None:
    result = await executor.execute("import os\nos.chdir('/')")
    assert result.text is not None and f"it is back in {REMOTE_DIR}" in result.text
    assert (await executor.execute("print(os.getcwd())")).text == REMOTE_DIR


@pytest.mark.slow
async def test_stream_yields_output_as_it_comes_and_then_the_result(executor: CodeExecutor) -> None:
    items = [item async for item in executor.stream("for i in range(3): print(i, flush=True)", chunks=True)]
    assert isinstance(items[-1], CodeExecutionResult) and items[-1].text == "0\n1\n2"
    assert "".join(item.text for item in items if isinstance(item, CodeExecutionChunk)) == "0\n1\n2\n"


@pytest.mark.slow
async def test_errors_come_back_with_their_name_and_no_colour(executor: CodeExecutor) -> None:
    with pytest.raises(CodeExecutionError) as raised:
        await executor.execute("1 / 0")
    assert raised.value.ename == "ZeroDivisionError"
    assert "\x1b[" not in str(raised.value)


@pytest.mark.slow
async def test_cancel_interrupts_the_running_code_and_the_kernel_keeps_its_state(
    executor: CodeExecutor,
) -> None:
    await executor.execute("kept = 'yes'")
    code = "import time\nprint('started', flush=True)\ntime.sleep(600)"
    with pytest.raises(CodeExecutionError) as raised:
        async for item in executor.stream(code, chunks=True):
            if isinstance(item, CodeExecutionChunk) and "started" in item.text:
                await executor.cancel()
    assert raised.value.ename == "KeyboardInterrupt"
    assert (await executor.execute("print(kept)")).text == "yes"


@pytest.mark.slow
async def test_a_timeout_interrupts_the_code_and_the_kernel_keeps_its_state(executor: CodeExecutor) -> None:
    await executor.execute("kept = 'yes'")
    with pytest.raises(TimeoutError, match="kernel kept its state"):
        await executor.execute("import time\ntime.sleep(600)", timeout=2)
    assert (await executor.execute("print(kept)")).text == "yes"


@pytest.mark.slow
async def test_reset_gives_a_fresh_kernel_set_up_as_the_first(executor: CodeExecutor) -> None:
    await executor.execute("import os\nos.environ['LEFT_BEHIND'] = '1'\ngone = 1")
    await executor.reset()
    with pytest.raises(CodeExecutionError, match="NameError"):
        await executor.execute("gone")
    result = await executor.execute(
        "import os, sys\nprint(os.getcwd(), 'ipybox.kernel._ext' in sys.modules, os.environ.get('LEFT_BEHIND'))"
    )
    assert result.text == f"{REMOTE_DIR} True None"


@pytest.mark.slow
async def test_plots_come_back_as_local_png_files(executor: CodeExecutor, tmp_path: Path) -> None:
    result = await executor.execute(PNG_CELL)
    assert len(result.images) == 1
    assert result.images[0].parent == tmp_path / "images"
    assert result.images[0].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow
async def test_the_gateway_token_and_the_tool_servers_token_never_reach_the_kernel(
    gateway: RemoteGateway, executor: CodeExecutor
) -> None:
    assert executor._tool_server is not None
    secrets = {gateway.token, str(executor._tool_server.token)}
    # What the kernel can see of itself: its environment, the cells it ran (the setup cell among
    # them), its command line and its process's environment at start.
    seen = await executor.execute(
        "import os\n"
        "print(repr(dict(os.environ)))\n"
        "print(repr(get_ipython().user_ns.get('In')))\n"
        "print(open('/proc/self/cmdline', 'rb').read())\n"
        "print(open('/proc/self/environ', 'rb').read())"
    )
    assert seen.text is not None and "TOOL_SERVER_CHANNEL" in seen.text
    # Nor the tool server's address: it is not reachable from there, and nothing needs it.
    assert "TOOL_SERVER_HOST" not in seen.text and "TOOL_SERVER_PORT" not in seen.text
    for secret in secrets:
        assert secret not in seen.text


@pytest.mark.slow
async def test_code_in_the_kernel_cannot_use_the_gateways_api_with_anything_it_can_find(
    gateway: RemoteGateway, executor: CodeExecutor
) -> None:
    if gateway.kind.endswith("-docker"):
        pytest.skip(
            "the kernel's container reaches no port of the gateway's (tests/app/tools/test_remote_channel.py)"
        )
    # The gateway listens beside the kernel (the namespace's loopback); hostile code tries every
    # value of its environment and every word of the cells it ran as the gateway's token.
    attack = f"""
import os, re, urllib.error, urllib.request
candidates = {{""}} | set(os.environ.values()) | set(re.findall(r"[A-Za-z0-9_-]{{16,}}", " ".join(In)))
statuses = set()
for token in candidates:
    request = urllib.request.Request(
        "http://127.0.0.1:{INNER_PORT}/api/kernels", headers={{"Authorization": f"token {{token}}"}}
    )
    try:
        statuses.add(urllib.request.urlopen(request, timeout=10).status)
    except urllib.error.HTTPError as error:
        statuses.add(error.code)
print(len(candidates) > 1, sorted(statuses))
"""
    result = await executor.execute(attack)
    assert result.text is not None
    tried, statuses = result.text.split(" ", 1)
    assert tried == "True"
    assert {int(status) for status in statuses.strip("[]").split(", ")} <= {401, 403}, statuses


@pytest.mark.slow
async def test_generated_mcptools_reach_the_kernel_without_a_shared_disk_and_stay_after_reset(
    executor: CodeExecutor, tmp_path: Path
) -> None:
    local = tmp_path / "build" / "mcptools"
    await generate_mcp_sources("demo", {"command": sys.executable, "args": [str(DEMO_SERVER)]}, local)
    assert await executor.upload(local) == "mcptools"
    check = "import mcptools.demo, os\nprint(os.path.dirname(mcptools.demo.__file__))"
    assert (await executor.execute(check)).text == f"{REMOTE_DIR}/mcptools/demo"
    await executor.reset()
    assert (await executor.execute(check)).text == f"{REMOTE_DIR}/mcptools/demo"


@pytest.mark.slow
async def test_tool_calls_from_the_remote_kernel_are_decided_here_and_answered_over_the_gateway(
    gateway: RemoteGateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel reaches nothing but its gateway: each call travels over the kernel's stdin
    channel, surfaces here as an `ApprovalRequest`, runs in this process, and its result (or the
    refusal) goes back the same way; calls gathered in one cell are in flight together."""
    # A remote executor runs the servers generated under the application's working directory.
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "mcptools"
    await generate_mcp_sources("demo", {"command": sys.executable, "args": [str(DEMO_SERVER)]}, local)
    async with remote(gateway, images_dir=tmp_path / "images") as executor:
        await executor.upload(local)
        code = (
            "from mcptools.demo import add, echo\n"
            "total = add.run(add.Params(a=2, b=3))\n"
            "print(type(total).__name__, total.sum)\n"
            "print(echo.run(echo.Params(text='hi')))"
        )
        asked: list[tuple[str, str, dict[str, Any]]] = []
        result: object = None
        async for item in executor.stream(code):
            if isinstance(item, ApprovalRequest):
                asked.append((item.server_name, item.tool_name, item.tool_args))
                await item.accept()
            else:
                result = item
        assert asked == [("demo", "add", {"a": 2, "b": 3}), ("demo", "echo", {"text": "hi"})]
        assert result == CodeExecutionResult(text="Result 5\nhi", images=[])
        with pytest.raises(CodeExecutionError, match="rejected"):
            async for item in executor.stream(
                "from mcptools.demo import echo\necho.run(echo.Params(text='no'))"
            ):
                if isinstance(item, ApprovalRequest):
                    await item.reject()
        # The kernel is still usable, and calls gathered in one cell all come back.
        gathered: object = None
        async for item in executor.stream(
            "import asyncio\nfrom mcptools.demo import add\n"
            "async def _all():\n"
            "    return await asyncio.gather(*(add.arun(add.Params(a=n, b=1)) for n in range(5)))\n"
            "print([r.sum for r in await _all()])",
            timeout=60,
        ):
            if isinstance(item, ApprovalRequest):
                await item.accept()
            else:
                gathered = item
        assert gathered == CodeExecutionResult(text="[1, 2, 3, 4, 5]", images=[])


async def test_shell_commands_of_the_remote_kernel_ask_here_and_run_there_only_once_accepted(
    gateway: RemoteGateway,
) -> None:
    """With approve_shell_cmds the kernel asks over its stdin channel, as it asks for tool calls."""
    async with remote(gateway, approve_shell_cmds=True) as executor:
        asked: list[tuple[str, str, dict[str, Any]]] = []
        result: object = None
        async for item in executor.stream("!echo hi there"):
            if isinstance(item, ApprovalRequest):
                asked.append((item.server_name, item.tool_name, item.tool_args))
                await item.accept()
            else:
                result = item
        assert asked == [("ipybox", "shell", {"cmd": "echo hi there"})]
        assert isinstance(result, CodeExecutionResult) and (result.text or "").strip() == "hi there"
        with pytest.raises(CodeExecutionError, match="was rejected by the application"):
            async for item in executor.stream("%%bash\ntouch rejected-ran\n"):
                if isinstance(item, ApprovalRequest):
                    assert (item.server_name, item.tool_name) == ("ipybox", "shell_magic")
                    await item.reject()
        seen = await executor.execute("import os\nprint(os.path.exists('rejected-ran'))")
        assert seen.text == "False"


@pytest.mark.slow
async def test_an_upload_replaces_the_earlier_one_at_the_same_place(
    executor: CodeExecutor, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "old.txt").write_text("old")
    await executor.upload(data, "inputs")
    (data / "old.txt").unlink()
    (data / "new.txt").write_text("new")
    await executor.upload(data, "inputs")
    assert (await executor.execute("import os\nprint(sorted(os.listdir('inputs')))")).text == "['new.txt']"
    with pytest.raises(ValueError, match="inside the kernel's working directory"):
        await executor.upload(data, "../elsewhere")
    with pytest.raises(ValueError, match="does not exist"):
        await executor.upload(tmp_path / "missing")


@pytest.mark.slow
async def test_a_killed_kernel_fails_its_execution_and_the_next_one_gets_a_fresh_kernel(
    executor: CodeExecutor,
) -> None:
    await executor.execute("gone = 1")
    with pytest.raises(CodeExecutionError, match="a fresh kernel has replaced it"):
        await executor.execute("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(CodeExecutionError, match="NameError"):
        await executor.execute("gone")
    assert (await executor.execute("import os\nprint(os.getcwd())")).text == REMOTE_DIR


@pytest.mark.slow
async def test_a_kernel_the_cluster_removes_between_cells_is_replaced_on_the_next_execution(
    gateway: RemoteGateway, executor: CodeExecutor
) -> None:
    await executor.execute("gone = 1")
    assert executor._kernels is not None
    kernel_id = executor._kernels.client.kernel_id
    # Shut down through the gateway's API, as culling or an eviction does, not by the executor.
    async with httpx2.AsyncClient(headers={"Authorization": f"token {gateway.token}"}) as client:
        assert (await client.delete(f"{gateway.url}/api/kernels/{kernel_id}")).status_code == 204
    with pytest.raises(CodeExecutionError, match="a fresh kernel has replaced it"):
        await executor.execute("gone")
    with pytest.raises(CodeExecutionError, match="NameError"):
        await executor.execute("gone")
    assert executor._kernels.client.kernel_id != kernel_id
    assert (await executor.execute("import os\nprint(os.getcwd())")).text == REMOTE_DIR


@pytest.mark.slow
async def test_a_kernel_that_never_starts_ends_in_a_bounded_wait_and_leaves_no_kernel(
    gateway: RemoteGateway,
) -> None:
    if gateway.kind.endswith("-docker"):
        pytest.skip("the Docker images hold no kernel spec that never starts")
    before = {kernel["id"] for kernel in await kernels_on(gateway)}
    with pytest.raises(KernelStartTimeoutError, match=r"kernel_start_timeout=2 s"):
        await remote(gateway, kernel_name=NEVER_STARTS, kernel_start_timeout=2).start()
    assert {kernel["id"] for kernel in await kernels_on(gateway)} <= before


@pytest.mark.slow
async def test_a_spare_kernel_given_up_while_the_gateway_makes_it_is_deleted(gateway: RemoteGateway) -> None:
    if gateway.kind.endswith("-docker"):
        pytest.skip("these gateways keep kernel listing off (as clusters do); the namespace kinds show this")
    # The spare's start begins after the first execution; stopping at once gives it up while the
    # gateway still makes it. The gateway finishes the kernel anyway: it must be deleted then (off
    # stop()'s path, which does not wait for a cluster to finish a start).
    before = {kernel["id"] for kernel in await kernels_on(gateway)}
    for _ in range(3):
        async with remote(gateway) as executor:
            assert (await executor.execute("print(1)")).text == "1"

    async def left() -> set[str]:
        return {kernel["id"] for kernel in await kernels_on(gateway)} - before

    # sleep: polled, the gateway's kernel list signals nothing; bounded (60 s) as a backstop only.
    for _ in range(600):
        if not await left():
            break
        await asyncio.sleep(0.1)
    assert await left() == set()


@pytest.mark.slow
async def test_stopping_during_a_running_cell_starts_no_kernel_that_is_left_behind(
    gateway: RemoteGateway,
) -> None:
    if gateway.kind.endswith("-docker"):
        pytest.skip("these gateways keep kernel listing off (as clusters do); the namespace kinds show this")
    before = {kernel["id"] for kernel in await kernels_on(gateway)}
    executor = remote(gateway)
    await executor.start()
    stream = executor.stream("print('running', flush=True)\nimport time\ntime.sleep(60)", chunks=True)
    assert isinstance(await anext(stream), CodeExecutionChunk)  # the cell runs
    collect = asyncio.create_task(anext(stream))
    await executor.stop()
    with pytest.raises(CodeExecutionError):
        await collect
    # Nothing was started on the way out (the ended cell used to start a spare, never deleted).
    assert {kernel["id"] for kernel in await kernels_on(gateway)} <= before


@pytest.mark.slow
async def test_an_unknown_kernel_name_or_a_wrong_token_is_a_clear_error(gateway: RemoteGateway) -> None:
    with pytest.raises(KernelConnectionError, match="refused to create a kernel"):
        await remote(gateway, kernel_name="no-such-kernel").start()
    with pytest.raises(KernelConnectionError, match="check its token"):
        await remote(gateway, kernel_gateway_token="wrong").start()


@pytest.mark.slow
@pytest.mark.parametrize("kind", EXECUTOR_GATEWAY_KINDS)
async def test_a_gateway_that_goes_away_fails_the_execution_with_a_clear_error_and_stop_works(
    kind: str,
) -> None:
    if kind.endswith("-docker"):
        # Its response port is fixed (the containers' firewall opens only it), and the module's
        # gateway of this kind holds it: a second one cannot start. The namespace kinds show this.
        pytest.skip("a second Docker-backed gateway of this kind cannot bind the response port")
    gateways = _started(kind)
    gateway = next(gateways)
    executor = remote(gateway, spare_kernel=False)
    await executor.start()
    try:
        await executor.execute("x = 1")
        running = asyncio.create_task(
            executor.execute("print('started', flush=True)\nimport time\ntime.sleep(600)")
        )
        gateways.close()  # the gateway and its kernels are gone
        with pytest.raises(CodeExecutionError, match="no fresh kernel could be started"):
            await running
        with pytest.raises(CodeExecutionError, match="no fresh kernel could be started"):
            await executor.execute("x")
    finally:
        await executor.stop()


@pytest.mark.slow
async def test_the_mcp_server_runs_its_sessions_kernel_on_the_gateway_with_mcptools_uploaded(
    gateway: RemoteGateway, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    params = remote_server(gateway, workspace, KERNEL_ENV_GREETING="hello")
    async with connected(params) as client:
        registered = await client.call_tool(
            "register_mcp_server",
            {"server_name": "demo", "server_params": {"command": sys.executable, "args": [str(DEMO_SERVER)]}},
        )
        assert not registered.is_error, text_of(registered)
        assert (workspace / "mcptools" / "demo").is_dir()  # generated here, then uploaded
        code = (
            "import mcptools.demo, os\n"
            "print(os.path.dirname(mcptools.demo.__file__) != "
            f"{str(workspace / 'mcptools' / 'demo')!r}, os.environ['GREETING'])\n"
            "print(repr(dict(os.environ)))"
        )
        result = await run(client, code)
        assert not result.is_error, text_of(result)
        first, environ = text_of(result).split("\n", 1)
        assert first == "True hello"
        assert gateway.token not in environ
        # Each session's kernel works in a folder of its own on the kernel's host.
        where = text_of(await run(client, "import os\nprint(os.getcwd())"))
        assert os.path.dirname(where) == "/tmp/ipybox-sessions", where


@pytest.mark.slow
async def test_the_mcp_servers_file_tools_act_in_the_remote_kernel_and_install_package_says_where_to_install(
    gateway: RemoteGateway, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    params = remote_server(gateway, workspace)
    async with connected(params) as client:
        content = base64.b64encode(b"sent from the client").decode()
        uploaded = await client.call_tool("upload_file", {"path": "in/data.txt", "content_base64": content})
        assert not uploaded.is_error, text_of(uploaded)
        assert text_of(await run(client, "print(open('in/data.txt').read())")) == "sent from the client"
        # Uploaded files are sent again to a fresh kernel.
        assert not (await client.call_tool("reset", {})).is_error
        assert text_of(await run(client, "print(open('in/data.txt').read())")) == "sent from the client"
        # A file the kernel wrote on its host, over several pieces of the read.
        wrote = "import hashlib, os\ndata = os.urandom(7 * 1024 * 1024 + 5)\nopen('out.bin', 'wb').write(data)\nprint(hashlib.sha256(data).hexdigest())"
        digest = text_of(await run(client, wrote))
        downloaded = await client.call_tool("download_file", {"path": "out.bin"})
        assert not downloaded.is_error, text_of(downloaded)
        blob = base64.b64decode(downloaded.content[1].resource.blob)  # type: ignore[union-attr]
        assert (len(blob), hashlib.sha256(blob).hexdigest()) == (7 * 1024 * 1024 + 5, digest)
        # Refused as locally: a link, a protected name, a folder.
        await run(client, "import os\nos.symlink('/etc/hostname', 'link')\nos.mkdir('folder')")
        for path, expected in [("link", "could not read"), (".env", ".env"), ("folder", "could not read")]:
            refused = await client.call_tool("download_file", {"path": path})
            assert refused.is_error and expected in text_of(refused), text_of(refused)
        refused = await client.call_tool("install_package", {"package_name": "requests"})
        assert refused.is_error and "deploy/kernel-image" in text_of(refused)


@pytest.mark.slow
async def test_the_mcp_servers_snapshot_tools_save_and_load_a_remote_kernels_state(
    gateway: RemoteGateway, tmp_path: Path
) -> None:
    workspace = tmp_path / "workspace"
    async with connected(remote_server(gateway, workspace)) as client:
        await run(client, "rows = [{'n': i} for i in range(100)]")
        saved = await client.call_tool("save_snapshot", {"name": "rows"})
        assert not saved.is_error and "1 names (rows)" in text_of(saved), text_of(saved)
        assert (workspace / "snapshots" / "rows.ipybox-snapshot").is_file()  # kept here, by the server
        assert not (await client.call_tool("reset", {})).is_error
        loaded = await client.call_tool("load_snapshot", {"name": "rows"})
        assert not loaded.is_error, text_of(loaded)
        assert text_of(await run(client, "print(rows[-1])")) == "{'n': 99}"


def test_the_cli_refuses_the_sandbox_and_a_bad_url_with_a_gateway() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--kernel-gateway-url", "http://gateway:8888", "--sandbox"])
    with pytest.raises(SystemExit):
        parse_args(["--kernel-gateway-url", "gateway:8888"])
    with pytest.raises(SystemExit):
        parse_args(["--kernel-name", "python3"])
    args = parse_args(["--kernel-gateway-url", "http://gateway:8888", "--kernel-name", "ipybox"])
    assert (args.kernel_gateway_url, args.kernel_name) == ("http://gateway:8888", "ipybox")
