"""S6 attacked from real kernel code in the real sandbox (srt), with controls that succeed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
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

# Private: the sandbox's per-user folder base, default settings and srt lookup, which the attacks
# aim at or stand in for.
from ipybox.app import sandbox as _sandbox
from ipybox.errors import SandboxUnavailableError
from ipybox.kernel_mgr.client import KernelClient
from ipybox.kernel_mgr.server import KernelGateway
from tests.conftest import DEMO_SERVER, command_line
from tests.sandbox_support import require_sandbox
from tests.servers.demo_server import png_bytes

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}

# Kernel code: one HTTP request through srt's proxy, sent by hand (urllib would go direct for
# the loopback hosts that srt's NO_PROXY lists). Prints the proxy's status line.
VIA_PROXY = """
import base64, os, socket, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
auth = base64.b64encode(f"{{proxy.username}}:{{proxy.password}}".encode()) if proxy.username else b""
with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as s:
    s.sendall(b"GET {url} HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n")
    s.sendall(b"Proxy-Authorization: Basic " + auth + b"\\r\\n\\r\\n" if auth else b"\\r\\n")
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
print(answer.split(b"\\r\\n")[0].decode(), answer.rsplit(b"\\r\\n\\r\\n", 1)[-1].decode())
"""


# Credential files an attacker looks for in the home folder (issue 20 found twelve readable).
CREDENTIALS = (
    ".ssh/id_test",
    ".config/git/credentials",
    ".claude.json",
    ".pgpass",
    ".my.cnf",
    ".bash_history",
    ".python_history",
    ".local/share/uv/credentials/credentials.toml",
    ".cache/huggingface/token",
    ".config/gcloud/credentials.db",
    ".vault-token",
    "notes/plans.txt",
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A working directory with a `.env`, generated `mcptools/demo`, a registry inside it (the
    sandbox must protect it there too) and a home directory of its own with a credential store."""
    require_sandbox()
    path = tmp_path_factory.mktemp("sandboxed")
    home = tmp_path_factory.mktemp("home")
    for name in CREDENTIALS:
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text("SECRET")
    (path / ".env").write_text("API_KEY=sandbox-secret\n")
    (path / "notes.txt").write_text("readable")
    saved = {name: os.environ.get(name) for name in ("IPYBOX_STATE_DIR", "HOME")}
    old_cwd = Path.cwd()
    os.chdir(path)
    os.environ["IPYBOX_STATE_DIR"] = str(path / "state")
    os.environ["HOME"] = str(home)
    try:
        yield path
    finally:
        os.chdir(old_cwd)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def executor(workdir: Path) -> AsyncIterator[CodeExecutor]:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    home = os.environ["HOME"]
    async with CodeExecutor(sandbox=True, images_dir=workdir / "images", kernel_env={"HOME": home}) as ex:
        yield ex


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def loopback_service() -> AsyncIterator[int]:
    """Another service on the host's loopback (port returned), answering any request with 'hello'."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def fails(ex: CodeExecutor, code: str, ename: str | tuple[str, ...]) -> CodeExecutionError:
    with pytest.raises(CodeExecutionError) as info:
        await ex.execute(code, timeout=60)
    names = (ename,) if isinstance(ename, str) else ename
    assert info.value.ename in names, info.value.traceback
    return info.value


async def test_dotenv_of_the_working_directory_cannot_be_read(executor: CodeExecutor) -> None:
    await fails(executor, "open('.env').read()", "PermissionError")
    assert (await executor.execute("print(open('notes.txt').read())")).text == "readable"


async def test_nothing_in_the_home_folder_can_be_read(executor: CodeExecutor) -> None:
    # srt hides the home folder under an empty one: the files are simply not there.
    for name in CREDENTIALS:
        read = f"import os\nopen(os.path.expanduser('~/{name}')).read()"
        await fails(executor, read, ("PermissionError", "FileNotFoundError"))
    listing = (
        "import os\nhome = os.path.expanduser('~')\nprint(os.listdir(home) if os.path.isdir(home) else [])"
    )
    assert (await executor.execute(listing)).text == "[]"


async def test_the_disk_outside_the_kernels_folders_and_the_system_cannot_be_read(workdir: Path) -> None:
    """Deny by default (issue 20): a secret in a folder made for the test outside the home folder
    and /tmp (in /srv, /opt or /mnt where writable) and the files of the clone ipybox runs from are hidden; the system,
    the kernel's own Python and its working directory stay readable."""
    if sys.platform != "linux":
        pytest.skip("the default settings hide the rest of the disk on Linux only")
    # Inside an existing top-level folder where one is writable: a new entry of "/" that vanishes
    # while another sandbox starts (a second test run on the machine) fails that start.
    parent = next((p for p in ("/srv", "/opt", "/mnt", "/") if os.access(p, os.W_OK)), None)
    secret_dir = Path(tempfile.mkdtemp(prefix="ipybox-disk-attack-", dir=parent)) if parent else None
    targets = [ROOT / "README.md", ROOT / "pyproject.toml"]
    if secret_dir is not None:
        (secret_dir / "secret.txt").write_text("SECRET")
        targets.append(secret_dir / "secret.txt")
    if os.getuid() == 0:  # root reads it unsandboxed; a missing one passes too
        targets.append(Path("/etc/shadow"))
    try:
        # The folder exists before the kernel starts: srt hides what is in "/" when it starts.
        async with CodeExecutor(sandbox=True) as ex:
            for target in targets:
                read = f"print(repr(open({str(target)!r}).read()))"
                try:
                    text = (await ex.execute(read)).text
                except CodeExecutionError as exc:
                    assert exc.ename in ("PermissionError", "FileNotFoundError"), exc.traceback
                else:
                    assert text == "''", f"{target} is readable in the sandbox: {str(text)[:80]}"
            for folder in [ROOT, *([secret_dir] if secret_dir else [])]:
                listing = f"import os\nprint(sorted(os.listdir({str(folder)!r})) if os.path.isdir({str(folder)!r}) else [])"
                names = (await ex.execute(listing)).text or ""
                assert "README.md" not in names and "secret.txt" not in names, f"{folder} lists {names}"
            assert (await ex.execute("print(open('/etc/os-release').read())")).text
            own = "import sys\nprint(open(sys.executable, 'rb').read(4))"
            assert (await ex.execute(own)).text == "b'\\x7fELF'"
            assert (await ex.execute("print(open('notes.txt').read())")).text == "readable"
            assert (await ex.execute("import numpy, ssl\nprint(numpy.arange(3).sum())")).text == "3"
            assert str((await ex.execute("!ls /usr/bin/env")).text).strip() == "/usr/bin/env"
    finally:
        if secret_dir is not None:
            shutil.rmtree(secret_dir)


# Kernel code: what each of PATHS (a list) gives, its first bytes or the error's class name.
READ_EACH = """
import json, os
found = {{}}
for path in {paths!r}:
    try:
        if os.path.isdir(path):
            found[path] = sorted(os.listdir(path))
        else:
            with open(path, "rb") as f:
                found[path] = f.read(40).decode(errors="replace")
    except OSError as exc:
        found[path] = type(exc).__name__
print(json.dumps(found))
"""


def _unread(found: object) -> bool:
    """Whether what READ_EACH found shows nothing of a secret (an error, an empty stand-in)."""
    return found in ("PermissionError", "FileNotFoundError", "", [])


@pytest.fixture
def root_only_in_etc() -> Iterator[list[Path]]:
    """A file and a folder (with a file readable by all inside) in /etc that only root may read."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("root-only files in /etc are hidden from kernels started as root, on Linux")
    name = f"/etc/ipybox-test-{os.urandom(6).hex()}"
    secret_file, secret_dir = Path(name), Path(name + "-dir")
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"ROOT-SECRET")
    os.close(fd)
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "key.json").write_text("ROOT-SECRET")
    os.chmod(secret_dir / "key.json", 0o644)
    try:
        yield [secret_file, secret_dir, secret_dir / "key.json"]
    finally:
        secret_file.unlink()
        shutil.rmtree(secret_dir)


async def test_a_root_kernel_reads_in_etc_only_what_any_user_could(
    workdir: Path, root_only_in_etc: list[Path]
) -> None:
    """S-C (issue 20): a kernel started as root has every file of /etc hidden that an unprivileged
    user could not read, not only the known secrets: a root-only file and a folder only root may
    enter, both made for the test (also under a custom config); the system's configuration stays
    readable."""
    async with CodeExecutor(sandbox=True) as ex:
        targets = [str(path) for path in root_only_in_etc]
        found = json.loads(str((await ex.execute(READ_EACH.format(paths=targets))).text))
        assert all(_unread(found[path]) for path in targets), found
        checks = (
            "import getpass, json, locale, pwd, grp, socket, ssl, time\n"
            "ssl.create_default_context()\n"
            "locale.setlocale(locale.LC_ALL, '')\n"
            "print(json.dumps([pwd.getpwuid(0).pw_name, grp.getgrgid(0).gr_name, getpass.getuser(),"
            " bool(open('/etc/os-release').read()), bool(time.tzname)]))"
        )
        assert json.loads(str((await ex.execute(checks)).text)) == ["root", "root", "root", True, True]
        assert "os-release" in str((await ex.execute("!ls /etc")).text)
    # A rule of ipybox's own, kept under a custom config.
    async with CodeExecutor(sandbox=True, sandbox_config=ROOT / "examples" / "sandbox-kernel.json") as ex:
        found = json.loads(str((await ex.execute(READ_EACH.format(paths=targets))).text))
        assert all(_unread(found[path]) for path in targets), found


@pytest.fixture
def scratch_venv(tmp_path: Path) -> Path:
    """The Python of a new virtual environment whose path holds this one's packages."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site_packages = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(site_packages) / "ipybox_test_packages.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def _project(folder: Path, module: str) -> Path:
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "config").write_text("[remote] url = https://token@example.com\n")
    (folder / ".env").write_text("API_KEY=import-path-secret\n")
    (folder / ".env.local").write_text("API_KEY=import-path-secret\n")
    (folder / f"{module}.py").write_text("VALUE = 42\n")
    return folder


async def test_a_folder_the_kernel_imports_from_keeps_its_secrets(
    workdir: Path, tmp_path: Path, scratch_venv: Path
) -> None:
    """S-D (issue 20): a project opened through a `.pth` in the interpreter's site-packages (a
    flat-layout editable install), and another through PYTHONPATH, are importable but their `.env`,
    `.env.*` and `.git` stay hidden. The kernel's Python is the application's: the application runs
    here with a scratch virtual environment's Python (this one's is left as it is)."""
    flat = _project(tmp_path / "flat-project", "flat_module")
    on_path = _project(tmp_path / "pythonpath-project", "pythonpath_module")
    site_packages = next(scratch_venv.parent.parent.glob("lib/python*/site-packages"))
    (site_packages / "flat_project.pth").write_text(f"{flat}\n")
    secrets = [str(p / n) for p in (flat, on_path) for n in (".env", ".env.local", ".git/config", ".git")]
    kernel = READ_EACH.format(paths=secrets) + (
        "import flat_module, pythonpath_module\nprint(flat_module.VALUE + pythonpath_module.VALUE)\n"
    )
    driver = (
        "import asyncio\n"
        "from ipybox import CodeExecutor\n"
        "async def main():\n"
        f"    async with CodeExecutor(sandbox=True, kernel_env={{'PYTHONPATH': {str(on_path)!r}}}) as ex:\n"
        f"        print((await ex.execute({kernel!r}, timeout=60)).text)\n"
        "asyncio.run(main())\n"
    )
    process = await asyncio.create_subprocess_exec(
        str(scratch_venv),
        "-c",
        driver,
        cwd=workdir,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, stderr.decode()[-3000:]
    lines = stdout.decode().strip().splitlines()
    assert lines[-1] == "84", lines
    found = json.loads(lines[-2])
    assert all(_unread(found[path]) for path in secrets), found


async def test_credential_files_stay_hidden_under_a_config_that_opens_the_home_folder(workdir: Path) -> None:
    config = workdir / "open-home.json"
    config.write_text(json.dumps({"filesystem": {"allowWrite": ["."]}}))
    try:
        async with CodeExecutor(
            sandbox=True, sandbox_config=config, kernel_env={"HOME": os.environ["HOME"]}
        ) as ex:
            listing = (await ex.execute("import os\nprint(sorted(os.listdir(os.path.expanduser('~'))))")).text
            assert listing is not None and "notes" in listing
            assert (
                await ex.execute("print(open(os.path.expanduser('~/notes/plans.txt')).read())")
            ).text == "SECRET"
            for name in CREDENTIALS[:-1]:
                read = f"open(os.path.expanduser('~/{name}')).read()"
                await fails(ex, read, ("PermissionError", "FileNotFoundError", "IsADirectoryError"))
    finally:
        config.unlink()


async def test_writes_outside_the_working_directory_fail_and_inside_succeed(
    executor: CodeExecutor, workdir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "escaped.txt"
    await fails(executor, f"open({str(outside)!r}, 'w').write('x')", ("OSError", "FileNotFoundError"))
    await fails(executor, "open('/usr/escaped.txt', 'w').write('x')", ("OSError", "PermissionError"))
    assert not outside.exists()
    await executor.execute("open('written.txt', 'w').write('inside')")
    assert (workdir / "written.txt").read_text() == "inside"
    tmp = (await executor.execute("import tempfile\nprint(tempfile.mkstemp()[1])")).text
    assert tmp is not None and "ipybox-jupyter-" in tmp


async def test_the_trusted_registry_cannot_be_written_even_inside_the_working_directory(
    executor: CodeExecutor, state_dir: Path
) -> None:
    registry = state_dir / "servers.json"
    before = registry.read_text()
    evil = json.dumps({"version": 1, "servers": {"demo": {"command": "sh", "env": {"X": "${SECRET}"}}}})
    await fails(executor, f"open({str(registry)!r}, 'w').write({evil!r})", "OSError")
    await fails(executor, f"open({str(state_dir / 'new.json')!r}, 'w')", "OSError")
    await fails(executor, f"import os\nos.replace('notes.txt', {str(registry)!r})", "OSError")
    assert registry.read_text() == before


async def test_configuration_that_trusted_programs_read_cannot_be_written_or_created(
    executor: CodeExecutor, workdir: Path
) -> None:
    before = (workdir / ".env").read_text()
    await fails(
        executor, "open('.env', 'w').write('KERNEL_ENV_LD_PRELOAD=/tmp/x.so')", ("OSError", "PermissionError")
    )
    await fails(executor, "open('sandbox-config.json', 'w').write('{}')", ("OSError", "PermissionError"))
    await fails(
        executor,
        "import os\nos.makedirs('.claude', exist_ok=True)\nopen('.claude/settings.json', 'w').write('{}')",
        ("OSError", "FileExistsError", "PermissionError"),
    )
    assert (workdir / ".env").read_text() == before
    # While the kernel runs, srt keeps empty placeholders where the files did not exist.
    placeholder = workdir / "sandbox-config.json"
    assert not placeholder.exists() or placeholder.read_text() == ""
    assert not (workdir / ".claude" / "settings.json").exists()


async def test_ipython_and_jupyter_folders_are_private(executor: CodeExecutor) -> None:
    code = (
        "import os\nfrom IPython.paths import get_ipython_dir\nfrom jupyter_core.paths import jupyter_data_dir\n"
        "print(get_ipython_dir(), jupyter_data_dir())"
    )
    ipython_dir, data_dir = str((await executor.execute(code)).text).split()
    assert "ipybox-jupyter-" in ipython_dir and "ipybox-jupyter-" in data_dir
    # The home folder the kernel sees is an empty one of its own: what it writes there stays in it.
    startup = (
        "import os\nos.makedirs(os.path.expanduser('~/.ipython/profile_default/startup'), exist_ok=True)"
    )
    with contextlib.suppress(CodeExecutionError):
        await executor.execute(startup)
    assert not (Path(os.environ["HOME"]) / ".ipython").exists()


async def test_the_gateway_imports_nothing_the_kernel_planted(executor: CodeExecutor, workdir: Path) -> None:
    """Kernel code plants a fake ``ipybox`` package in a working directory and a ``sitecustomize``
    in a folder that ``kernel_env`` puts on ``PYTHONPATH``; a gateway started there (outside the
    sandbox) must import neither."""
    marker = workdir / "hijacked.txt"
    plant = f"""
import os
payload = "import sys\\nif any('ipybox.gateway._main' in a for a in sys.orig_argv): open({str(marker)!r}, 'a').write('x')\\n"
os.makedirs('project/ipybox', exist_ok=True)
os.makedirs('project/site', exist_ok=True)
open('project/ipybox/__init__.py', 'w').write(payload)
open('project/site/sitecustomize.py', 'w').write(payload)
"""
    await executor.execute(plant)
    project = workdir / "project"
    try:
        async with KernelGateway(working_dir=project, env={"PYTHONPATH": str(project / "site")}) as gateway:
            assert gateway.running
        assert not marker.exists()
    finally:
        await executor.execute("import shutil\nshutil.rmtree('project')")


async def test_other_executors_private_folders_cannot_be_read(executor: CodeExecutor) -> None:
    """Another executor's kernels keep their connection files (keys) and sockets in a private folder
    under the same per-user base; this kernel must not see them."""
    other = Path(tempfile.mkdtemp(prefix="ipybox-jupyter-", dir=_sandbox.private_base()))
    try:
        (other / "runtime").mkdir()
        (other / "runtime" / "kernel-other.json").write_text('{"key": "secret"}')
        read = f"open({str(other / 'runtime' / 'kernel-other.json')!r}).read()"
        await fails(executor, read, ("PermissionError", "FileNotFoundError"))
        listing = f"import os\nprint({other.name!r} in os.listdir({str(other.parent)!r}))"
        assert (await executor.execute(listing)).text == "False"
    finally:
        shutil.rmtree(other, ignore_errors=True)


async def test_kernel_env_cannot_make_trusted_processes_load_code() -> None:
    for name in ("LD_PRELOAD", "DYLD_INSERT_LIBRARIES", "NODE_OPTIONS"):
        with pytest.raises(ValueError, match=name):
            KernelGateway(env={name: "/tmp/evil"})


async def test_the_applications_processes_are_invisible(executor: CodeExecutor) -> None:
    pid = os.getpid()
    await fails(executor, f"import os\nos.kill({pid}, 0)", "ProcessLookupError")
    await fails(executor, f"open('/proc/{pid}/environ').read()", "FileNotFoundError")
    pids = (
        await executor.execute("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    ).text
    assert pids is not None and max(json.loads(pids)) < 100


async def test_the_kernel_runs_without_capabilities(executor: CodeExecutor) -> None:
    status = (await executor.execute("print(open('/proc/self/status').read())")).text or ""
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert int(fields["CapEff"], 16) == 0
    assert int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"


async def test_another_loopback_service_is_unreachable_directly_and_through_the_proxy(
    executor: CodeExecutor, loopback_service: int
) -> None:
    direct = f"import socket\nsocket.create_connection(('127.0.0.1', {loopback_service}), timeout=5)"
    await fails(executor, direct, ("ConnectionRefusedError", "OSError", "TimeoutError"))
    url = f"http://127.0.0.1:{loopback_service}/"
    answer = (await executor.execute(VIA_PROXY.format(url=url, host=f"127.0.0.1:{loopback_service}"))).text
    assert answer is not None and " 403 " in answer and "hello" not in answer


async def test_an_internet_host_is_unreachable(executor: CodeExecutor) -> None:
    answer = (await executor.execute(VIA_PROXY.format(url="http://example.com/", host="example.com"))).text
    assert answer is not None and " 403 " in answer
    direct = "import socket\nsocket.create_connection(('93.184.215.14', 80), timeout=5)"
    await fails(executor, direct, ("OSError", "TimeoutError"))


async def test_tool_calls_with_approval_reach_the_tool_server(executor: CodeExecutor) -> None:
    code = "from mcptools.demo import add\nprint(add.run(add.Params(a=2, b=3)).sum)"
    items = [item async for item in _accepting(executor.stream(code))]
    assert [(i.server_name, i.tool_name) for i in items if isinstance(i, ApprovalRequest)] == [
        ("demo", "add")
    ]
    assert items[-1] == CodeExecutionResult(text="5", images=[])
    # The async client path takes the same socket.
    async_code = (
        "from ipybox.tool_exec.client import ToolRunner\n"
        "print((await ToolRunner('demo', {}).run('add', {'a': 1, 'b': 1}))['sum'])"
    )
    assert (await executor.execute(async_code)).text == "2"


async def test_gathered_async_calls_and_media_results_work_in_the_sandbox(executor: CodeExecutor) -> None:
    code = """
import asyncio
from IPython.display import display
from mcptools.demo import add, image
sums = await asyncio.gather(*(add.arun(add.Params(a=n, b=n)) for n in range(5)))
picture = await image.arun_content(image.Params())
display(picture.images[0])
print([s.sum for s in sums])
"""
    result = await executor.execute(code)
    assert result.text == "[0, 2, 4, 6, 8]"
    assert [path.read_bytes() for path in result.images] == [png_bytes()]


async def _accepting(items: AsyncIterator[object]) -> AsyncIterator[object]:
    async for item in items:
        if isinstance(item, ApprovalRequest):
            await item.accept()
        yield item


async def test_a_custom_config_can_allow_one_more_host(
    workdir: Path, loopback_service: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extra-domain mechanism, against a host loopback service allowed in the config."""
    monkeypatch.setenv("IPYBOX_APPLICATION_SECRET", "app-secret")
    config = workdir / "extra-host.json"
    config.write_text(
        json.dumps(
            {
                "network": {"allowedDomains": [f"127.0.0.1:{loopback_service}"]},
                "filesystem": {"denyRead": [str(workdir / ".env")], "allowWrite": [str(workdir)]},
            }
        )
    )
    url = f"http://127.0.0.1:{loopback_service}/"
    async with CodeExecutor(sandbox=True, sandbox_config=config) as ex:
        answer = (await ex.execute(VIA_PROXY.format(url=url, host=f"127.0.0.1:{loopback_service}"))).text
        assert answer is not None and " 200 " in answer and "hello" in answer
        # The fixed rules hold whatever the config says: nothing of the application's
        # environment reaches the kernel, and the registry stays unwritable.
        leaked = (
            "import os\nprint([k for k, v in os.environ.items() if 'app-secret' in v or 'APPLICATION' in k])"
        )
        assert (await ex.execute(leaked)).text == "[]"
        registry = os.environ["IPYBOX_STATE_DIR"] + "/servers.json"
        await fails(ex, f"open({registry!r}, 'a').write('x')", "OSError")


async def test_the_shipped_example_config_allows_its_extra_domain_and_nothing_else(workdir: Path) -> None:
    """The proxy's decision is checked, not the internet: an allowed CONNECT is not refused
    with 403 (it may still fail upstream where there is no internet), a denied one is."""
    example = ROOT / "examples" / "sandbox-kernel.json"
    domains = json.loads(example.read_text())["network"]["allowedDomains"]
    assert len(domains) == 1
    if sys.platform == "linux":  # the example is the Linux defaults plus that domain
        defaults = _sandbox.default_settings(workdir)["filesystem"]
        runtime_dir = {os.environ["XDG_RUNTIME_DIR"]} if os.environ.get("XDG_RUNTIME_DIR") else set()
        for key, paths in json.loads(example.read_text())["filesystem"].items():
            expanded = {
                p.replace("~", os.environ["HOME"], 1) if p.startswith("~") else str(workdir / p)
                for p in paths
            }
            assert expanded == set(defaults[key]) - runtime_dir, key
    code = """
import base64, os, socket, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode() if proxy.username else ""
def connect(host):
    with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as s:
        head = f"CONNECT {host}:443 HTTP/1.1\\r\\nHost: {host}:443\\r\\n"
        head += f"Proxy-Authorization: Basic {auth}\\r\\n" if auth else ""
        s.sendall(head.encode() + b"\\r\\n")
        try:
            return s.recv(200).split(b"\\r\\n")[0].decode() or "closed"
        except TimeoutError:
            return "no answer within 10 s (not refused)"
"""
    code += f"print(connect({domains[0]!r}), '|', connect('example.org'))"
    async with CodeExecutor(sandbox=True, sandbox_config=example) as ex:
        allowed, denied = ((await ex.execute(code, timeout=60)).text or "").split(" | ")
        assert " 403 " not in allowed, f"the proxy refused {domains[0]}, which the example allows: {allowed}"
        assert " 403 " in denied, f"the proxy let example.org through: {denied}"
        await fails(ex, "open('.env').read()", "PermissionError")


async def test_sandboxed_kernels_end_when_their_gateway_is_killed(workdir: Path) -> None:
    """ipykernel's parent check cannot see the gateway from the sandbox: the watcher its launcher
    leaves outside does (it waits on the gateway's lock)."""
    async with KernelGateway(port=None, sandbox=True) as gateway, KernelClient(port=gateway.port) as client:
        assert (await client.execute("print(1)")).text == "1"
        assert gateway.pid is not None
        process = psutil.Process(gateway.pid)
        kernels = process.children(recursive=True)
        assert any("ipykernel_launcher" in command_line(p) for p in kernels)
        process.kill()
        _, alive = await asyncio.to_thread(psutil.wait_procs, kernels, timeout=30)
        assert alive == [], f"still running after the gateway was killed: {alive}"


async def test_a_missing_tool_fails_at_start_naming_it_and_its_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("IPYBOX_SRT", raising=False)
    # Private: the copy of srt in a clone has no setting of its own to turn it off.
    monkeypatch.setattr(_sandbox._srt, "_REPO_SRT", tmp_path / "no-srt")
    gateway = KernelGateway(port=None, sandbox=True)
    with pytest.raises(SandboxUnavailableError) as info:
        await gateway.start()
    message = str(info.value)
    for name in ("srt", "bwrap", "socat"):
        assert name in message
    assert "apt-get install bubblewrap socat ripgrep" in message and "npm" in message
    assert not gateway.running
    with pytest.raises(SandboxUnavailableError, match="bwrap"):
        await CodeExecutor(sandbox=True).start()


async def test_a_broken_config_fails_at_start_with_what_to_fix(tmp_path: Path) -> None:
    require_sandbox()
    config = tmp_path / "broken.json"
    config.write_text("{not json")
    with pytest.raises(SandboxUnavailableError, match="not valid JSON"):
        async with CodeExecutor(sandbox=True, sandbox_config=config):
            pass
