"""Attacks from a sandboxed kernel on the trusted side: MCP servers started from places the
kernel can write, and servers another application registered."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources
from tests.conftest import DEMO_SERVER
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.slow]

CALL_ADD = "from ipybox.tool_exec.client import run_tool\nprint(run_tool('demo', 'add', {'a': 1, 'b': 1}))"


def planted_server(marker: Path) -> str:
    """What hostile kernel code writes where a trusted program might run it: it leaves a mark."""
    return f"open({str(marker)!r}, 'w').write('ran outside the sandbox')\n"


async def test_a_module_planted_in_the_workspace_is_not_imported_by_a_python_m_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_sandbox()
    work, marker = tmp_path / "work", tmp_path / "pwned"
    work.mkdir()
    # As in the README: the application runs in its project folder, the kernel's working directory.
    monkeypatch.chdir(work)
    # `python -m demo_server`: Python puts the server's working directory first on its path.
    params = {
        "command": sys.executable,
        "args": ["-m", "demo_server"],
        "env": {"PYTHONPATH": str(DEMO_SERVER.parent)},
    }
    await generate_mcp_sources("demo", params, Path("mcptools"))
    async with CodeExecutor(sandbox=True, approve_tool_calls=False) as ex:
        await ex.execute(f"open('demo_server.py', 'w').write({planted_server(marker)!r})")
        result = await ex.execute(CALL_ADD, timeout=60)
    assert not marker.exists()
    assert result.text == "{'sum': 2}"


async def test_a_server_script_in_the_working_directory_is_refused_and_its_rewrite_never_runs(
    tmp_path: Path,
) -> None:
    require_sandbox()
    work, marker = tmp_path / "work", tmp_path / "pwned"
    work.mkdir()
    shutil.copy(DEMO_SERVER, work / "server.py")
    await generate_mcp_sources(
        "demo", {"command": sys.executable, "args": [str(work / "server.py")]}, work / "mcptools"
    )
    async with CodeExecutor(sandbox=True, working_dir=work, approve_tool_calls=False) as ex:
        await ex.execute(f"open('server.py', 'w').write({planted_server(marker)!r})")
        with pytest.raises(CodeExecutionError) as info:
            await ex.execute(CALL_ADD, timeout=60)
    assert not marker.exists()
    message = str(info.value)
    assert "refused" in message and "sandboxed kernel can write" in message and str(work) in message


async def test_a_script_relative_to_uv_directory_in_the_working_directory_is_refused(tmp_path: Path) -> None:
    """The MCP docs' form for a local server, ``uv --directory DIR run SCRIPT``: SCRIPT is taken
    from DIR, so no argument names it; DIR in the working directory is enough to refuse it."""
    require_sandbox()
    work, marker = tmp_path / "work", tmp_path / "pwned"
    (work / "srv").mkdir(parents=True)
    shutil.copy(DEMO_SERVER, work / "srv" / "demo_server.py")
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "uv is needed to start this server"
    args = [
        "--directory",
        str(work / "srv"),
        "run",
        "--no-project",
        "--python",
        sys.executable,
        "demo_server.py",
    ]
    await generate_mcp_sources("demo", {"command": uv, "args": args}, work / "mcptools")
    async with CodeExecutor(sandbox=True, working_dir=work, approve_tool_calls=False) as ex:
        await ex.execute(f"open('srv/demo_server.py', 'w').write({planted_server(marker)!r})")
        with pytest.raises(CodeExecutionError) as info:
            await ex.execute(CALL_ADD, timeout=60)
    assert not marker.exists()
    message = str(info.value)
    assert "refused" in message and repr(str(work / "srv")) in message and '"command": "' in message


async def test_a_kernel_cannot_call_a_server_another_application_registered(tmp_path: Path) -> None:
    require_sandbox()
    other, mine = tmp_path / "other-app", tmp_path / "my-app"
    other.mkdir()
    mine.mkdir()
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
    await generate_mcp_sources("demo", demo, other / "mcptools")
    await generate_mcp_sources("mine", demo, mine / "mcptools")
    async with CodeExecutor(sandbox=True, working_dir=mine, approve_tool_calls=False) as ex:
        with pytest.raises(CodeExecutionError) as info:
            await ex.execute(CALL_ADD, timeout=60)
        own = await ex.execute(CALL_ADD.replace("'demo'", "'mine'"), timeout=60)
    assert "'demo' is not registered for this executor" in str(info.value)
    assert "generate_mcp_sources" in str(info.value)
    assert own.text == "{'sum': 2}"


REACH = """
import os, socket
def reach(path):
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
        return 'reached'
    except OSError as exc:
        return type(exc).__name__
"""


async def test_a_kernel_reaches_only_its_own_tool_server_and_its_token_opens_no_approval(
    tmp_path: Path,
) -> None:
    require_sandbox()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    async with (
        CodeExecutor(sandbox=True, working_dir=one) as first,
        CodeExecutor(sandbox=True, working_dir=two) as second,
    ):
        await first.execute(REACH)
        other = await second.execute("import os\nprint(os.environ['TOOL_SERVER_SOCKET'])")
        own = await first.execute("print(reach(os.environ['TOOL_SERVER_SOCKET']))")
        foreign = await first.execute(f"print(reach({other.text!r}))")
        # The kernel's token is not the approval secret: it cannot become the approval client.
        approval = await first.execute(
            "from websockets.sync.client import unix_connect\n"
            "try:\n"
            "    with unix_connect(os.environ['TOOL_SERVER_SOCKET'], 'ws://localhost/approval',\n"
            "                      additional_headers={'Authorization': 'Bearer ' + os.environ['TOOL_SERVER_TOKEN']}) as ws:\n"
            "        ws.recv(timeout=5)\n"
            "    print('connected')\n"
            "except Exception as exc:\n"
            "    print('refused', type(exc).__name__)\n"
        )
    assert own.text == "reached"
    assert foreign.text != "reached"
    assert (approval.text or "").startswith("refused")


async def test_a_package_planted_in_a_shared_working_directory_does_not_run_in_the_next_kernel(
    tmp_path: Path,
) -> None:
    """Sessions of the MCP server share the workspace: one kernel's files must not run in another's."""
    require_sandbox()
    work = tmp_path / "work"
    work.mkdir()
    plant = (
        "import os\n"
        "for name in ['ipybox']:\n"
        "    os.makedirs(name, exist_ok=True)\n"
        "    open(os.path.join(name, '__init__.py'), 'w').write(\n"
        '        \'import os\\nopen("stolen-\' + name + \'", "w").write(os.environ.get("TOOL_SERVER_TOKEN", ""))\\n\'\n'
        "    )\n"
        "os.makedirs('mcptools/mine', exist_ok=True)\n"
        "open('mcptools/__init__.py', 'w').close()\n"
        "open('mcptools/mine/__init__.py', 'w').write('VALUE = 42')\n"
    )
    async with CodeExecutor(sandbox=True, working_dir=work) as first:
        await first.execute(plant)
    async with CodeExecutor(sandbox=True, working_dir=work) as second:
        imported = await second.execute(
            "import ipybox.tool_exec.client\nfrom mcptools.mine import VALUE\nprint(VALUE)"
        )
    assert imported.text == "42"
    assert sorted(path.name for path in work.iterdir() if path.name.startswith("stolen")) == []


def installation() -> tuple[list[Path], Path]:
    """The Python environment, ipybox's package and srt's code, and the folder holding all three
    (a checkout run with `uv run`)."""
    import ipybox

    # Private: where srt is installed, one of the three folders looked for.
    from ipybox.app import sandbox as _sandbox

    targets = [Path(sys.prefix), Path(ipybox.__file__).parent, Path(_sandbox.find_srt()).resolve().parent]
    common = targets[0]
    while not all(common in target.parents for target in targets):
        common = common.parent
    return targets, common


async def test_a_kernel_working_in_a_checkout_cannot_change_what_the_application_runs(tmp_path: Path) -> None:
    """The README's quickstart runs from a clone, whose `.venv`, `src/ipybox` and srt lie in the
    kernel's working directory when it is the clone: the next start would run a change unsandboxed."""
    require_sandbox()
    targets, common = installation()
    name = f"ipybox-attack-{tmp_path.name}"
    code = (
        "import os\n"
        f"for folder in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        f"        open(os.path.join(folder, {name!r}), 'w').write('x')\n"
        "        print('wrote', folder)\n"
        "    except OSError:\n"
        "        print('refused')\n"
    )
    try:
        async with CodeExecutor(sandbox=True, working_dir=common) as ex:
            result = await ex.execute(code)
    finally:
        for target in targets:
            (target / name).unlink(missing_ok=True)
    assert (result.text or "").splitlines() == ["refused"] * 3
