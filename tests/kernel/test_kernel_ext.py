"""Shell commands under approval, the shell-escape guard, a kept working directory and colourless output.

Real executors and kernels: the kernel extension (``ipybox.kernel._ext``) is loaded by
every ipybox kernel, and `CodeExecutor` switches its parts on through the kernel's environment.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import os
import shutil
import sys
import uuid
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import (
    ApprovalRequest,
    CodeExecutionChunk,
    CodeExecutionError,
    CodeExecutionResult,
    CodeExecutor,
    generate_mcp_sources,
)
from tests.conftest import DEMO_SERVER

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
APPROVAL_TIMEOUT = 2


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["http", "stdin"])
async def guarded(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[CodeExecutor]:
    """Shell commands ask, tool calls don't, processes only through `!`, and a kept working directory.

    Each test runs with the kernel asking over HTTP and over its stdin channel (``tool_channel``)."""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    (workdir / "cells").mkdir(exist_ok=True)
    async with CodeExecutor(
        tool_channel=request.param,
        approval_timeout=APPROVAL_TIMEOUT,
        approve_tool_calls=False,
        approve_shell_cmds=True,
        require_shell_escape=True,
        working_dir=workdir,
        kernel_env={"FORCE_COLOR": "1", "KEPT": "yes"},
    ) as ex:
        yield ex


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain(workdir: Path) -> AsyncIterator[CodeExecutor]:
    async with CodeExecutor() as ex:
        yield ex


async def run(ex: CodeExecutor, code: str, decide: bool | None = True) -> list[object]:
    """Stream `code`, deciding every approval request (None: leave it to expire)."""
    items: list[object] = []
    async for item in ex.stream(code, chunks=True):
        items.append(item)
        if isinstance(item, ApprovalRequest) and decide is not None:
            await (item.accept() if decide else item.reject())
    return items


def requests(items: list[object]) -> list[tuple[str, str, dict[str, object]]]:
    return [(i.server_name, i.tool_name, i.tool_args) for i in items if isinstance(i, ApprovalRequest)]


SHELL_FORMS = {
    "bang": ("word = 'hi'\n!echo {word} there", ("shell", {"cmd": "echo hi there"}), "hi there"),
    "capture": (
        "word = 'hi'\nlines = !echo {word} captured\nprint(lines)",
        ("shell", {"cmd": "echo hi captured"}),
        "['hi captured']",
    ),
    "bash": (
        "%%bash\necho from bash",
        ("shell_magic", {"magic": "bash", "cmd": "echo from bash\n"}),
        "from bash",
    ),
    "sh": ("%%sh\necho from sh", ("shell_magic", {"magic": "sh", "cmd": "echo from sh\n"}), "from sh"),
}


@pytest.mark.parametrize("form", SHELL_FORMS)
async def test_an_accepted_shell_command_runs_after_its_approval_request(
    guarded: CodeExecutor, form: str
) -> None:
    code, (tool_name, tool_args), output = SHELL_FORMS[form]
    items = await run(guarded, code)
    assert requests(items) == [("ipybox", tool_name, tool_args)]
    result = items[-1]
    assert isinstance(result, CodeExecutionResult)
    assert result.text is not None and result.text.strip() == output


@pytest.mark.parametrize("form", SHELL_FORMS)
async def test_a_rejected_shell_command_does_not_run_and_the_cell_says_so(
    guarded: CodeExecutor, workdir: Path, form: str
) -> None:
    code = SHELL_FORMS[form][0].replace("echo", "touch rejected-ran; echo")
    with pytest.raises(CodeExecutionError, match="rejected by the application") as info:
        await run(guarded, code, decide=False)
    assert info.value.ename == "ToolRunnerError"
    assert not (workdir / "rejected-ran").exists()


@pytest.mark.parametrize("form", SHELL_FORMS)
@pytest.mark.slow
async def test_a_shell_command_without_a_decision_expires_and_does_not_run(
    guarded: CodeExecutor, workdir: Path, form: str
) -> None:
    code = SHELL_FORMS[form][0].replace("echo", "touch expired-ran; echo")
    with pytest.raises(CodeExecutionError, match="expired") as info:
        await run(guarded, code, decide=None)
    assert info.value.ename == "ToolRunnerError"
    assert not (workdir / "expired-ran").exists()


async def test_execute_approves_shell_commands_as_it_approves_tool_calls(guarded: CodeExecutor) -> None:
    result = await guarded.execute("n = 3\nfiles = !seq {n}\nprint(files)")
    assert result.text == "['1', '2', '3']"


async def test_tool_calls_run_unasked_while_shell_commands_still_ask(guarded: CodeExecutor) -> None:
    code = "from mcptools.demo import echo\nprint(echo.run(echo.Params(text='unasked')))\n!echo asked"
    items = await run(guarded, code)
    assert requests(items) == [("ipybox", "shell", {"cmd": "echo asked"})]
    assert isinstance(items[-1], CodeExecutionResult)
    assert items[-1].text is not None and items[-1].text.split() == ["unasked", "asked"]


GUARDED_CALLS = {
    "subprocess.run": "import subprocess\nprint(subprocess.run(['true']).returncode)",
    "subprocess.call": "import subprocess\nprint(subprocess.call(['true']))",
    "subprocess.check_call": "import subprocess\nprint(subprocess.check_call(['true']))",
    "subprocess.check_output": "import subprocess\nprint(subprocess.check_output(['echo', '0']).decode().strip())",
    "subprocess.getoutput": "import subprocess\nprint(subprocess.getoutput('echo 0'))",
    "subprocess.getstatusoutput": "import subprocess\nprint(subprocess.getstatusoutput('true')[0])",
    "subprocess.Popen": "import subprocess\nprint(subprocess.Popen(['true']).wait())",
    "from subprocess import run": "from subprocess import run\nprint(run(['true']).returncode)",
    "os.system": "import os\nprint(os.system('true'))",
    "os.popen": "import os\nprint(os.popen('echo 0').read().strip())",
    "os.spawnv": "import os\nprint(os.spawnv(os.P_WAIT, '/bin/true', ['true']))",
    "os.spawnlp": "import os\nprint(os.spawnlp(os.P_WAIT, 'true', 'true'))",
    "os.posix_spawn": (
        "import os\npid = os.posix_spawn('/bin/true', ['true'], {})\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    ),
    "os.posix_spawnp": (
        "import os\npid = os.posix_spawnp('true', ['true'], {})\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    ),
    # exec replaces the process it runs in: try it in a forked child, which reports 3 if exec raised.
    "os.execv": (
        "import os\npid = os.fork()\nif pid == 0:\n    try:\n        os.execv('/bin/true', ['true'])\n"
        "    finally:\n        os._exit(3)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    ),
    "os.execvp": (
        "import os\npid = os.fork()\nif pid == 0:\n    try:\n        os.execvp('true', ['true'])\n"
        "    finally:\n        os._exit(3)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    ),
    "pty.spawn": "import pty\nprint(pty.spawn(['true']))",
    "asyncio.create_subprocess_exec": (
        "import asyncio\nproc = await asyncio.create_subprocess_exec('true')\nprint(await proc.wait())"
    ),
    "asyncio.create_subprocess_shell": (
        "import asyncio\nproc = await asyncio.create_subprocess_shell('true')\nprint(await proc.wait())"
    ),
}


@pytest.mark.parametrize("call", GUARDED_CALLS)
async def test_starting_a_process_directly_is_refused_with_a_pointer_to_the_shell_escape(
    guarded: CodeExecutor, call: str
) -> None:
    code = GUARDED_CALLS[call]
    if call.startswith("os.exec"):
        assert (await guarded.execute(code)).text == "3"
        return
    with pytest.raises(CodeExecutionError, match="`!ls -l`") as info:
        await guarded.execute(code)
    assert info.value.ename == "ShellEscapeRequiredError"


@pytest.mark.parametrize("call", GUARDED_CALLS)
async def test_starting_a_process_directly_works_without_the_guard(plain: CodeExecutor, call: str) -> None:
    assert (await plain.execute(GUARDED_CALLS[call])).text == "0"


async def test_libraries_called_by_a_cell_may_still_start_processes(guarded: CodeExecutor) -> None:
    code = "import ctypes.util, platform\nprint(ctypes.util.find_library('c') is not None, bool(platform.uname()))"
    assert (await guarded.execute(code)).text == "True True"


async def test_the_kernel_starts_in_the_working_directory(guarded: CodeExecutor, workdir: Path) -> None:
    assert (await guarded.execute("import os\nprint(os.getcwd())")).text == str(workdir)


async def test_the_working_directory_is_restored_after_a_cell_changes_it(
    guarded: CodeExecutor, workdir: Path
) -> None:
    result = await guarded.execute("import os\nos.chdir('cells')\nprint(os.getcwd())")
    assert result.text == (
        f"{workdir / 'cells'}\n[ipybox] The cell left the working directory in {workdir / 'cells'}; "
        f"it is back in {workdir}."
    )
    assert (await guarded.execute("print(os.getcwd())")).text == str(workdir)
    assert (await guarded.execute("print('no note when it stays')")).text == "no note when it stays"


async def test_the_working_directory_is_restored_after_the_folder_a_cell_moved_to_is_deleted(
    guarded: CodeExecutor, workdir: Path
) -> None:
    code = "import os, shutil\nos.makedirs('doomed')\nos.chdir('doomed')\nshutil.rmtree(os.getcwd())"
    result = await guarded.execute(code)
    assert result.text == (
        f"[ipybox] The cell left the working directory in a directory that no longer exists; it is back in {workdir}."
    )
    assert (await guarded.execute("print(os.getcwd())")).text == str(workdir)


async def test_without_a_working_directory_a_change_persists(plain: CodeExecutor, workdir: Path) -> None:
    await plain.execute("import os\nos.makedirs('moved', exist_ok=True)\nos.chdir('moved')")
    assert (await plain.execute("print(os.getcwd())")).text == str(workdir / "moved")
    await plain.execute(f"os.chdir({str(workdir)!r})")


COLOURED = {
    "an error": "raise ValueError('plain')",
    "a %%bash cell": "%%bash\nprintf '\\033[31mred\\033[0m\\n'; ls --color=always /",
    "a coloured library": (
        "from pygments import highlight\nfrom pygments.lexers import PythonLexer\n"
        "from pygments.formatters import TerminalFormatter\nprint(highlight('x = 1', PythonLexer(), TerminalFormatter()))"
    ),
    "raw escape sequences": "print('\\x1b[1;32mgreen\\x1b[0m \\x1b]8;;https://example.com\\x1b\\\\link\\x1b]8;;\\x1b\\\\')",
}


@pytest.mark.parametrize("source", COLOURED)
async def test_no_colour_codes_reach_the_agent(guarded: CodeExecutor, source: str) -> None:
    try:
        items = await run(guarded, COLOURED[source])
    except CodeExecutionError as exc:
        assert source == "an error"
        texts = [str(exc), exc.traceback, exc.evalue]
        assert "ValueError" in exc.traceback and "plain" in exc.traceback
    else:
        texts = [i.text or "" for i in items if isinstance(i, CodeExecutionChunk | CodeExecutionResult)]
        assert texts[-1]
    for text in texts:
        assert "\x1b" not in text


async def test_colour_forcing_variables_do_not_reach_the_kernel(guarded: CodeExecutor) -> None:
    code = (
        "import os\nprint(os.environ.get('FORCE_COLOR'), os.environ.get('NO_COLOR'), os.environ.get('KEPT'))"
    )
    assert (await guarded.execute(code)).text == "None 1 yes"


def _wheel(folder: Path, name: str) -> Path:
    """A minimal wheel of one module, `name`, with ``VALUE = 42``: installing it needs no network."""
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
        f"{name}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{name}-0.1.dist-info/RECORD"] = (
        "\n".join([*record, f"{name}-0.1.dist-info/RECORD,,"]) + "\n"
    ).encode()
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path


@pytest.mark.timeout(300)
async def test_pip_and_python_in_a_cell_reach_the_kernels_own_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The application runs as `.venv/bin/python app.py`, its environment not activated: `python` and
    # `pip` on its PATH belong to other interpreters.
    venv_bin = str(Path(sys.executable).parent)
    monkeypatch.setenv(
        "PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin)
    )
    name = f"ipybox_pip_probe_{uuid.uuid4().hex[:8]}"
    wheel = _wheel(tmp_path, name)
    async with CodeExecutor() as ex:
        found = await ex.execute("!python -c 'import sys; print(sys.executable)'", timeout=60)
        assert (found.text or "").strip() == sys.executable
        try:
            await ex.execute(f"!pip install {wheel}", timeout=60)
            assert (await ex.execute(f"import {name}\nprint({name}.VALUE)")).text == "42"
            removed = await ex.execute(f"%pip uninstall -y {name}", timeout=60)
            assert "Uninstalled 1 package" in (removed.text or "") or "Successfully uninstalled" in (
                removed.text or ""
            )
        finally:
            uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
            uninstall = await asyncio.create_subprocess_exec(
                uv, "pip", "uninstall", "--python", sys.executable, name,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            await uninstall.wait()


async def test_pip_version_says_what_pip_is_for_the_kernel() -> None:
    # `pip --version` is the first thing many users type; uv's pip interface has no such option.
    if importlib.util.find_spec("pip") is not None:
        pytest.skip("this environment has pip of its own: no shim")
    async with CodeExecutor() as ex:
        for cell in ("!pip --version", "%pip -V"):
            text = (await ex.execute(cell, timeout=60)).text or ""
            assert sys.executable in text and "uv" in text and "error" not in text, (cell, text)


async def test_the_kernel_keeps_no_copy_of_the_output_it_sent(plain: CodeExecutor) -> None:
    # IPython's history manager (private to IPython, read from inside the kernel: no public
    # API shows a kernel's own memory) recorded every write, result and display of every cell.
    for _ in range(3):
        await plain.execute('print("x" * 100_000); display("shown"); 42')
    result = await plain.execute(
        "print(sum(len(outs) for outs in get_ipython().history_manager.outputs.values()))"
    )
    assert result.text == "0"
