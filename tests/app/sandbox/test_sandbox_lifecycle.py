"""The sandbox's settings and life cycle attacked from real kernel code: host sockets, agent and git
configuration in the project, trusted processes' working directories, leftovers after any exit."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from ipybox import CodeExecutionError, CodeExecutor
from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway
from tests.sandbox_support import require_sandbox
from tests.system.test_plugin_manifest import CLAUDE_CODE

pytestmark = pytest.mark.slow

_TIMEOUT = 60
# What git, editors, agents, shells and ipybox itself read from a project.
PROTECTED = {
    ".git",
    ".vscode",
    ".idea",
    ".claude",
    ".mcp.json",
    ".env",
    "sandbox-config.json",
    ".gitconfig",
    ".bashrc",
}

# Kernel code: connect to a Unix socket on the host and print what it says first.
CONNECT = """
import socket
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect({path!r})
print(s.recv(100).decode())
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A fresh project folder with none of the protected names in it."""
    require_sandbox()
    path = tmp_path / "project"
    path.mkdir()
    (path / "main.py").write_text("print('hello')\n")
    return path


async def fails(ex: CodeExecutor, code: str, *enames: str) -> None:
    with pytest.raises(CodeExecutionError) as info:
        await ex.execute(code, timeout=60)
    assert info.value.ename in enames, info.value.traceback


async def _shell_server(path: Path) -> asyncio.AbstractServer:
    """A stand-in for a terminal multiplexer's socket: whoever connects gets a 'shell'."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"host shell$ ")
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(greet, path=str(path))


async def test_unix_sockets_of_the_host_and_of_other_executors_are_unreachable(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sockets = []
    # The user's runtime folder, here in a place the sandbox does not otherwise hide.
    runtime = Path(tempfile.mkdtemp(prefix=".runtime-", dir=Path(__file__).parent))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    folders = [
        Path(tempfile.mkdtemp(prefix="tmux-")),
        Path(tempfile.mkdtemp(prefix="shell-", dir="/dev/shm")),
        runtime,
    ]
    servers = []
    try:
        for folder in folders:
            sockets.append(folder / "default")
            servers.append(await _shell_server(sockets[-1]))
        # The control: the socket answers on the host.
        reader, writer = await asyncio.open_unix_connection(str(sockets[0]))
        assert await reader.read() == b"host shell$ "
        writer.close()
        async with (
            CodeExecutor(sandbox=True, working_dir=project) as ex,
            CodeExecutor(sandbox=True, working_dir=project) as other,
        ):
            # Private: the executors do not expose their tool servers' sockets, which are the targets.
            assert other._tool_server is not None and other._tool_server.uds is not None
            for path in [*sockets, other._tool_server.uds]:
                await fails(ex, CONNECT.format(path=str(path)), "FileNotFoundError", "PermissionError")
            # The kernel's own tool socket stays reachable.
            assert ex._tool_server is not None and ex._tool_server.uds is not None
            own = f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(ex._tool_server.uds)!r})\nprint('ok')"
            assert (await ex.execute(own)).text == "ok"
    finally:
        for server in servers:
            server.close()
        for folder in folders:
            for child in folder.iterdir():
                child.unlink()
            folder.rmdir()


async def test_git_editor_and_agent_configuration_cannot_be_created_in_a_project_without_it(
    project: Path,
) -> None:
    """A `.git/config` with ``core.fsmonitor`` runs its command on the host's next ``git status``;
    `.vscode`, `.claude` and `.mcp.json` are read by editors and agents on the host."""
    marker = project.parent / "pwned"
    nested = project / "sub" / ".git"
    nested.mkdir(parents=True)
    (nested / "config").write_text("[core]\n\trepositoryformatversion = 0\n")
    fsmonitor = f"[core]\\n\\tfsmonitor = touch {marker}\\n"
    attacks = [
        f"import os\nos.makedirs('.git', exist_ok=True)\nopen('.git/config', 'w').write({fsmonitor!r})",
        "import os\nos.rmdir('.git')",
        "import os\nos.rename('.git', 'git-old')",
        "import os\nos.makedirs('.vscode', exist_ok=True)\nopen('.vscode/settings.json', 'w').write('{}')",
        "import os\nos.makedirs('.claude', exist_ok=True)\nopen('.claude/settings.json', 'w').write('{}')",
        "import os\nos.makedirs('.idea', exist_ok=True)\nopen('.idea/workspace.xml', 'w').write('x')",
        "open('.mcp.json', 'w').write('{\"mcpServers\": {}}')",
        "import os\nos.remove('.mcp.json')",
        "open('.gitconfig', 'w').write('[core]\\n')",
        f"open('sub/.git/config', 'a').write({fsmonitor!r})",
    ]
    async with CodeExecutor(sandbox=True, working_dir=project) as ex:
        for code in attacks:
            await fails(ex, code, "OSError", "PermissionError", "FileExistsError", "FileNotFoundError")
        # The control: the rest of the project is writable.
        await ex.execute("open('notes.txt', 'w').write('x')")
    # What the user does next on the host: git runs core.fsmonitor of a config the kernel wrote.
    for args in (
        ["init", "-q", str(project)],
        ["-C", str(project), "status"],
        ["-C", str(nested.parent), "status"],
    ):
        git = await asyncio.create_subprocess_exec(
            "git", *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        await git.wait()
    assert not marker.exists()
    assert (nested / "config").read_text() == "[core]\n\trepositoryformatversion = 0\n"


async def test_trusted_processes_do_not_run_in_the_working_directory(project: Path) -> None:
    """The gateway, and srt which reads its working directory to choose what to protect, start in a
    private folder; the kernel still starts in the working directory."""
    for sandbox in (True, False):
        async with (
            KernelGateway(port=None, sandbox=sandbox, working_dir=project) as gateway,
            # No spare kernel: nothing starts while the processes are looked at.
            KernelClient(port=gateway.port, spare_kernel=False) as client,
        ):
            assert (await client.execute("import os\nprint(os.getcwd())")).text == str(project)
            assert gateway.pid is not None
            process = psutil.Process(gateway.pid)
            cwds = {}
            for proc in [process, *process.children(recursive=True)]:
                try:
                    # The kernel itself (its own argument list, not srt's -c string) runs there.
                    if "ipykernel_launcher" not in proc.cmdline():
                        cwds[" ".join(proc.cmdline())[:80]] = proc.cwd()
                except psutil.Error:
                    continue  # a short-lived helper already gone
            assert len(cwds) >= (2 if sandbox else 1)
            assert all(not Path(cwd).is_relative_to(project) for cwd in cwds.values()), cwds


def test_a_sandbox_config_without_sandbox_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    for make in (CodeExecutor, KernelGateway):
        with pytest.raises(ValueError, match="sandbox=True"):
            make(sandbox_config=config)


_APP = """
import asyncio, sys
from ipybox import CodeExecutor

async def main():
    async with CodeExecutor(sandbox=True, working_dir=sys.argv[1]) as ex:
        await ex.execute("x = 1")
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def _wait_gone(pids: list[psutil.Process]) -> None:
    _, alive = await asyncio.to_thread(psutil.wait_procs, pids, timeout=_TIMEOUT)
    assert alive == [], alive


async def test_nothing_is_left_in_the_project_when_the_application_is_killed(
    project: Path, tmp_path: Path
) -> None:
    before = sorted(os.listdir(project))
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(_APP))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(app),
        str(project),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        assert await asyncio.wait_for(process.stdout.readline(), _TIMEOUT) == b"ready\n"
        tree = psutil.Process(process.pid).children(recursive=True)
        # While it runs, the protected names are held by empty stand-ins.
        assert (project / ".mcp.json").exists()
        process.kill()
        await process.wait()
        await _wait_gone(tree)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    # Any sandboxed executor of the same user cleans up at its start.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    async with CodeExecutor(sandbox=True, working_dir=elsewhere) as ex:
        assert sorted(os.listdir(project)) == before
        assert (await ex.execute("print(1)")).text == "1"
    assert os.listdir(elsewhere) == []


def _mcp(process: subprocess.Popen[bytes], request_id: int, method: str, params: dict[str, Any]) -> None:
    assert process.stdin is not None and process.stdout is not None
    message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    process.stdin.write(json.dumps(message).encode() + b"\n")
    process.stdin.flush()
    while line := process.stdout.readline():
        answer = json.loads(line)
        if answer.get("id") == request_id:
            assert "result" in answer and not answer["result"].get("isError"), answer
            return
    raise AssertionError("the server closed stdout before answering")


@pytest.mark.parametrize("ending", ["stdin closed", "SIGTERM"])
def test_nothing_is_left_in_the_project_when_the_sandboxed_mcp_server_exits(
    project: Path, ending: str
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "ipybox", "--workspace", str(project), "--sandbox", "--log-level", "ERROR"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        info = {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        }
        _mcp(process, 1, "initialize", info)
        assert process.stdin is not None
        process.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        _mcp(process, 2, "tools/call", {"name": "execute_ipython_cell", "arguments": {"code": "print(1)"}})
        assert (project / ".mcp.json").exists()
        tree = psutil.Process(process.pid).children(recursive=True)
        if ending == "SIGTERM":
            process.send_signal(signal.SIGTERM)
        else:
            process.stdin.close()
        process.wait(timeout=_TIMEOUT)
        _, alive = psutil.wait_procs(tree, timeout=_TIMEOUT)
        assert alive == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None and not stream.closed:
                stream.close()
    left = [name for name in os.listdir(project) if name in PROTECTED or (project / name).stat().st_size == 0]
    assert left == []


async def test_claude_code_reads_the_projects_mcp_json_while_a_sandboxed_kernel_works_there(
    project: Path, tmp_path: Path
) -> None:
    """Found in a newcomer's trial of the codeact-sandbox plugin, whose workspace is the Claude Code
    project: while its kernel ran, `claude mcp list` there refused the empty `.mcp.json` stand-in
    ("MCP config is not a valid JSON") and listed no server at all. The stand-in holds no servers."""
    if shutil.which("npx") is None:
        pytest.skip("npx is not installed: Claude Code's CLI cannot run")
    env = {**os.environ, "CLAUDE_CONFIG_DIR": str(tmp_path / "claude"), "DISABLE_TELEMETRY": "1"}
    async with CodeExecutor(sandbox=True, working_dir=project) as ex:
        assert json.loads((project / ".mcp.json").read_text()) == {"mcpServers": {}}
        listed = await asyncio.to_thread(
            subprocess.run,
            ["npx", "--yes", CLAUDE_CODE, "mcp", "list"],
            capture_output=True,
            text=True,
            env=env,
            cwd=project,
            timeout=400,
            check=False,
        )
        output = listed.stdout + listed.stderr
        assert listed.returncode == 0 and "Failed to parse" not in output, output
        await fails(ex, "open('.mcp.json', 'w').write('{}')", "OSError", "PermissionError")
    assert sorted(os.listdir(project)) == ["main.py"]


async def test_two_executors_in_one_project_keep_each_others_protection(project: Path) -> None:
    """The placeholders are shared: the first executor to stop must not take them from under the
    other's sandbox (removing a mount point on the host detaches it inside)."""
    async with CodeExecutor(sandbox=True, working_dir=project) as first:
        async with CodeExecutor(sandbox=True, working_dir=project):
            pass
        await first.reset()
        await fails(first, "open('.mcp.json', 'w').write('{}')", "OSError", "PermissionError")
        await fails(
            first, "open('.claude', 'w').write('{}')", "OSError", "PermissionError", "IsADirectoryError"
        )
    assert sorted(os.listdir(project)) == ["main.py"]


async def test_the_working_directory_cannot_be_made_a_bare_repository_nor_other_agents_configured(
    project: Path,
) -> None:
    """Found by an attack review: with ``.git`` held by an empty stand-in, git took the working
    directory itself for a bare repository the kernel wrote (``HEAD``, ``objects``, ``refs``,
    ``config`` with ``core.worktree`` and ``core.fsmonitor``) and ran its fsmonitor command on
    the host's next ``git status``. Other agents' configuration folders and a ``.env`` in a
    folder above the working directory were open too."""
    marker = project.parent / "pwned-bare"
    (project.parent / ".env").write_text("PARENT_SECRET=s3cret\n")
    config = f"[core]\\n\\trepositoryformatversion = 0\\n\\tbare = false\\n\\tworktree = .\\n\\tfsmonitor = touch {marker}; false\\n"
    bare = (
        "import os\n"
        "os.makedirs('objects', exist_ok=True)\n"
        "os.makedirs('refs/heads', exist_ok=True)\n"
        f"open('config', 'w').write({config!r})\n"
        "open('HEAD', 'w').write('ref: refs/heads/main\\n')\n"
    )
    async with CodeExecutor(sandbox=True, working_dir=project) as ex:
        await fails(ex, bare, "OSError", "PermissionError")
        for code in [
            "import os\nos.makedirs('.cursor', exist_ok=True)\nopen('.cursor/mcp.json', 'w').write('{}')",
            "import os\nos.makedirs('.gemini', exist_ok=True)\nopen('.gemini/settings.json', 'w').write('{}')",
            "import os\nos.makedirs('.husky', exist_ok=True)\nopen('.husky/pre-commit', 'w').write('id')",
            "open('../.env').read()",
        ]:
            await fails(ex, code, "OSError", "PermissionError", "FileNotFoundError")
    git = await asyncio.create_subprocess_exec(
        "git", "-C", str(project), "status", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    await git.wait()
    assert not marker.exists()
    assert not (project / "HEAD").exists() and not (project / ".cursor").exists()
