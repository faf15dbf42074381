"""The ipybox MCP server over stdio, spawned as ``python -m ipybox`` and driven by the SDK's client."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import mcp_types as types
import pytest
import pytest_asyncio
from mcp.client import Client
from PIL import Image

from ipybox.mcp_server._install import packages_dir  # private: where installed packages go
from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, own_state, run, server_env, stdio_params, text_of
from tests.servers.demo_server import png_bytes

pytestmark = pytest.mark.asyncio(loop_scope="module")
ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("workspace").resolve()
    (path / ".env").write_text("KERNEL_ENV_FROM_DOTENV=dotenv-value\nDOTENV_SECRET=hidden\n")
    with own_state(path):
        yield path


@pytest.fixture(autouse=True)
def state_dir(workspace: Path) -> Path:
    """This module's server and tests share one registry (see `workspace`)."""
    return Path(os.environ["IPYBOX_STATE_DIR"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(workspace: Path) -> AsyncIterator[Client]:
    env = server_env(KERNEL_ENV_GREETING="hello", SERVER_SECRET="do-not-leak")
    async with connected(stdio_params(workspace, env=env)) as client:
        yield client


async def test_lists_the_tools_with_annotations(client: Client) -> None:
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert {"execute_ipython_cell", "register_mcp_server", "install_package", "reset"} <= set(tools)
    assert {"upload_file", "download_file"} <= set(tools)
    execute = tools["execute_ipython_cell"]
    assert execute.input_schema["properties"]["timeout"]["default"] == 120
    assert execute.input_schema["properties"]["max_output_chars"]["default"] == 5000
    for tool in tools.values():
        assert tool.input_schema["additionalProperties"] is False
        assert all(spec.get("description") for spec in tool.input_schema["properties"].values())
    for tool in tools.values():
        assert tool.annotations is not None and tool.annotations.title
        assert tool.annotations.read_only_hint is not None
    assert (
        tools["download_file"].annotations is not None and tools["download_file"].annotations.read_only_hint
    )


async def test_code_runs_and_state_persists(client: Client) -> None:
    first = await run(client, "x = 41\nprint('set')")
    assert not first.is_error and text_of(first) == "set"
    second = await run(client, "x + 1")
    assert text_of(second) == "42"


async def test_an_error_is_a_tool_error_with_the_traceback(client: Client) -> None:
    result = await run(client, "print('before')\n{}['missing']")
    assert result.is_error
    text = text_of(result)
    assert text.startswith("before\n")
    assert "KeyError" in text and "'missing'" in text and "Traceback" in text


async def test_long_output_keeps_head_and_tail_and_saves_the_whole(client: Client, workspace: Path) -> None:
    code = "print('HEAD'); print('x' * 20000); print('TAIL')"
    result = await run(client, code, max_output_chars=1000)
    text = text_of(result)
    assert text.startswith("HEAD") and text.endswith("TAIL")
    assert len(text) < 1300
    marker = next(line for line in text.splitlines() if "omitted" in line)
    saved = workspace / marker.split(" is in ")[1].split(" in the workspace")[0]
    assert saved.read_text().count("x") == 20000


async def test_ansi_codes_are_removed_and_progress_bars_collapsed(client: Client) -> None:
    code = "import sys\nfor i in range(5): sys.stdout.write(f'\\r{i*25}%')\nprint()\nprint('\\x1b[31mred\\x1b[0m')"
    assert text_of(await run(client, code)) == "100%\nred"


async def test_a_plot_comes_back_as_scaled_image_content_and_a_saved_file(
    client: Client, workspace: Path
) -> None:
    code = (
        "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(20, 10), dpi=100)\n"
        "plt.plot([1, 2, 3])\nplt.show()"
    )
    result = await run(client, code)
    assert not result.is_error, text_of(result)
    images = [block for block in result.content if isinstance(block, types.ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    with Image.open(io.BytesIO(base64.b64decode(images[0].data))) as image:
        assert max(image.size) <= 768
    assert result.structured_content is None
    saved = text_of(result).split("Images saved in the workspace: ")[1].strip()
    with Image.open(workspace / saved) as original:
        assert max(original.size) > 768
    # A cell whose only output is the plot says nothing of "no output" beside it.
    assert "(no output)" not in text_of(result)


async def test_kernel_env_reaches_the_kernel_and_nothing_else_does(client: Client, workspace: Path) -> None:
    code = (
        "import os\nprint(os.environ.get('GREETING'), os.environ.get('FROM_DOTENV'))\n"
        "print(sorted(k for k in os.environ if 'SECRET' in k or k.startswith('KERNEL_ENV_')))\n"
        "print(os.path.isdir(os.environ['HOME']), os.getcwd())"
    )
    lines = text_of(await run(client, code)).splitlines()
    assert lines[0] == "hello dotenv-value"
    assert lines[1] == "[]"
    assert lines[2] == f"True {workspace}"


@pytest.mark.slow
async def test_progress_notifications_carry_the_latest_output_line(client: Client, workspace: Path) -> None:
    messages: list[str | None] = []
    seen = workspace / "progress-seen"

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message)
        if message and message.startswith("step"):
            seen.touch()

    # The cell runs until the client has seen its output line in a progress notification (the
    # kernel polls for the file the callback creates, under a deadline), however slow the machine.
    code = (
        "import os, time\nprint('step 0', flush=True)\ndeadline = time.monotonic() + 60\n"
        f"while not os.path.exists({str(seen)!r}) and time.monotonic() < deadline:\n    time.sleep(0.05)"
    )
    result = await client.call_tool("execute_ipython_cell", {"code": code}, progress_callback=on_progress)
    assert not result.is_error
    assert messages and all(m is not None and m.startswith(("step", "running")) for m in messages)
    assert any(m and m.startswith("step") for m in messages)


async def test_a_timeout_interrupts_returns_output_so_far_and_keeps_state(client: Client) -> None:
    await run(client, "kept = 'yes'")
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    result = await run(client, code, timeout=2)
    assert result.is_error
    text = text_of(result)
    assert text.startswith("started") and "Timed out" in text
    assert text_of(await run(client, "kept")) == "'yes'"


async def test_a_cancelled_call_interrupts_the_kernel_and_keeps_state(client: Client) -> None:
    await run(client, "survivor = 7")
    call = asyncio.create_task(run(client, "import time\nprint('go', flush=True)\ntime.sleep(60)"))
    # Cancel once the cell is certainly running: a probe through a second channel is not
    # available over stdio, so wait until the kernel has had the request for a moment.
    done, _ = await asyncio.wait({call}, timeout=2)
    assert not done
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The next call is served at once (the sleeping cell was interrupted) with state kept.
    result = await asyncio.wait_for(run(client, "survivor * 6"), timeout=30)
    assert text_of(result) == "42"


async def test_files_go_in_and_out_and_escapes_are_refused(
    client: Client, workspace: Path, tmp_path: Path
) -> None:
    payload = bytes(range(256)) * 10
    encoded = base64.b64encode(payload).decode()
    upload = await client.call_tool("upload_file", {"path": "data/in.bin", "content_base64": encoded})
    assert not upload.is_error, text_of(upload)
    result = await run(
        client, "data = open('data/in.bin', 'rb').read()\nopen('out.bin', 'wb').write(data[::-1])"
    )
    assert not result.is_error
    download = await client.call_tool("download_file", {"path": "out.bin"})
    blobs = [b.resource for b in download.content if isinstance(b, types.EmbeddedResource)]
    assert len(blobs) == 1 and isinstance(blobs[0], types.BlobResourceContents)
    assert base64.b64decode(blobs[0].blob) == payload[::-1]

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (workspace / "link").symlink_to(outside)
    (workspace / "filelink").symlink_to(outside / "secret.txt")
    for path in [
        "../escape.txt",
        "/etc/passwd",
        "data/../../escape.txt",
        "link/secret.txt",
        "filelink",
        "C:\\x",
    ]:
        down = await client.call_tool("download_file", {"path": path})
        up = await client.call_tool("upload_file", {"path": path, "content_base64": encoded})
        assert down.is_error and up.is_error, path
        assert "workspace" in text_of(down) and "workspace" in text_of(up)
    assert not (outside / "escape.txt").exists() and (outside / "secret.txt").read_text() == "secret"
    assert not (workspace.parent / "escape.txt").exists()

    too_big = base64.b64encode(b"\0" * (20 * 1024 * 1024 + 1)).decode()
    refused = await client.call_tool("upload_file", {"path": "big.bin", "content_base64": too_big})
    assert refused.is_error and "limit" in text_of(refused)
    assert not (workspace / "big.bin").exists()


@pytest.mark.slow
async def test_a_server_whose_arguments_name_the_workspace_is_registered_with_a_warning(
    client: Client, workspace: Path
) -> None:
    inside = workspace / "servers" / "demo_server.py"
    inside.parent.mkdir(exist_ok=True)
    shutil.copy(DEMO_SERVER, inside)
    params = {"command": sys.executable, "args": [str(inside)]}
    registered = await client.call_tool(
        "register_mcp_server", {"server_name": "inside", "server_params": params}
    )
    assert not registered.is_error, text_of(registered)
    text = text_of(registered)
    assert "Warning:" in text and "with sandbox=True it is refused at its first call" in text
    assert repr(str(inside)) in text
    outside = await client.call_tool(
        "register_mcp_server",
        {"server_name": "outside", "server_params": {"command": sys.executable, "args": [str(DEMO_SERVER)]}},
    )
    assert "Warning" not in text_of(outside)


@pytest.mark.slow
async def test_registered_servers_are_called_from_code(client: Client, workspace: Path) -> None:
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
    registered = await client.call_tool("register_mcp_server", {"server_name": "demo", "server_params": demo})
    assert not registered.is_error, text_of(registered)
    assert registered.structured_content is not None and "greet" in registered.structured_content["tools"]
    assert (workspace / "mcptools" / "demo" / "greet.py").is_file()
    result = await run(client, "from mcptools.demo.greet import Params, run\nrun(Params(name='agent'))")
    assert not result.is_error, text_of(result)
    assert text_of(result) == "'Hello, agent!'"

    time_server = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
    registered = await client.call_tool(
        "register_mcp_server", {"server_name": "time", "server_params": time_server}
    )
    assert not registered.is_error, text_of(registered)
    code = (
        "from mcptools.time.get_current_time import Params, run\nprint(run(Params(timezone='Europe/Berlin')))"
    )
    result = await run(client, code)
    assert not result.is_error and "Europe/Berlin" in text_of(result)


async def test_placeholders_are_filled_from_the_workspace_env_file_and_not_shown_to_the_kernel(
    client: Client, workspace: Path
) -> None:
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)], "env": {"DEMO_SECRET": "${DOTENV_SECRET}"}}
    registered = await client.call_tool(
        "register_mcp_server", {"server_name": "demo_env", "server_params": demo}
    )
    assert not registered.is_error, text_of(registered)
    result = await run(
        client, "from mcptools.demo_env.getenv import Params, run\nrun(Params(name='DEMO_SECRET'))"
    )
    assert text_of(result) == "'hidden'"
    generated = "".join(path.read_text() for path in (workspace / "mcptools" / "demo_env").glob("*.py"))
    assert "hidden" not in generated
    leaked = await run(client, "import os\n'hidden' in str(os.environ) or 'DOTENV_SECRET' in os.environ")
    assert text_of(leaked) == "False"


async def test_an_image_a_tool_returned_and_a_cell_displayed_comes_back_as_image_content(
    client: Client,
) -> None:
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
    registered = await client.call_tool("register_mcp_server", {"server_name": "demo", "server_params": demo})
    assert not registered.is_error, text_of(registered)
    code = (
        "from IPython.display import display\nfrom mcptools.demo import image\n"
        "picture = await image.arun_content(image.Params())\ndisplay(picture.images[0])"
    )
    result = await run(client, code)
    assert not result.is_error, text_of(result)
    [block] = [block for block in result.content if isinstance(block, types.ImageContent)]
    with (
        Image.open(io.BytesIO(base64.b64decode(block.data))) as shown,
        Image.open(io.BytesIO(png_bytes())) as sent,
    ):
        assert shown.size == sent.size == (4, 3)
        assert list(shown.convert("RGB").getdata()) == list(sent.convert("RGB").getdata())


async def test_registering_with_bad_params_is_a_clear_tool_error(client: Client) -> None:
    result = await client.call_tool("register_mcp_server", {"server_name": "1bad", "server_params": {}})
    assert result.is_error and "server_name" in text_of(result)
    result = await client.call_tool(
        "register_mcp_server",
        {"server_name": "nope", "server_params": {"command": "true", "env": {"K": "${UNSET_X}"}}},
    )
    assert result.is_error and "UNSET_X" in text_of(result)


async def test_registering_a_server_that_fails_to_start_shows_its_exit_code_and_stderr(
    client: Client,
) -> None:
    without_mcp = {"command": sys.executable, "args": ["-S", str(DEMO_SERVER)]}
    result = await client.call_tool(
        "register_mcp_server", {"server_name": "nomcp", "server_params": without_mcp}
    )
    assert result.is_error
    assert "exited with code 1" in text_of(result)
    assert "ModuleNotFoundError: No module named" in text_of(result)


@pytest.mark.timeout(300)
async def test_install_makes_a_package_importable_and_reset_keeps_it(client: Client, workspace: Path) -> None:
    bad = await client.call_tool("install_package", {"package_name": "--index-url http://evil"})
    assert bad.is_error and "not a package requirement" in text_of(bad)
    missing = await client.call_tool("install_package", {"package_name": "ipybox-no-such-package-xyz==1.0"})
    assert missing.is_error and "failed" in text_of(missing)
    installed = await client.call_tool("install_package", {"package_name": "cowsay==6.1"})
    assert not installed.is_error, text_of(installed)
    assert text_of(await run(client, "import cowsay\ncowsay.__version__")) == "'6.1'"
    where = Path(text_of(await run(client, "print(cowsay.__file__)")))
    assert where.parent.parent == packages_dir(workspace)

    await run(client, "before_reset = 1")
    reset = await client.call_tool("reset", {})
    assert not reset.is_error
    gone = await run(client, "before_reset")
    assert gone.is_error and "NameError" in text_of(gone)
    assert text_of(await run(client, "import cowsay\ncowsay.__version__")) == "'6.1'"
    assert (workspace / "mcptools").is_dir()
    after = await run(client, "import os\nos.getcwd()")
    assert text_of(after) == repr(str(workspace))


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_an_installed_package_survives_the_clones_set_up_which_resyncs_its_environment(
    client: Client,
) -> None:
    """Every README command runs scripts/setup.sh, whose `uv sync --frozen` removes packages the
    lock file does not name from the clone's environment, the one the server runs from."""
    if Path(sys.prefix) != ROOT / ".venv":
        pytest.skip("the tests do not run from the clone's own environment")
    installed = await client.call_tool("install_package", {"package_name": "text-unidecode==1.3"})
    assert not installed.is_error, text_of(installed)
    uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    sync = await asyncio.create_subprocess_exec(
        uv, "sync", "--frozen", "--quiet", cwd=ROOT, stderr=asyncio.subprocess.PIPE
    )
    _, errors = await sync.communicate()
    assert sync.returncode == 0, errors.decode()
    assert not (await client.call_tool("reset", {})).is_error
    result = await run(client, "import text_unidecode\nprint(text_unidecode.unidecode('caf\u00e9'))")
    assert text_of(result) == "cafe"
    # The clone's environment itself stays as the lock file says.
    check = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", "import text_unidecode", stderr=asyncio.subprocess.DEVNULL
    )
    assert await check.wait() != 0


async def test_bad_arguments_get_a_clear_error(client: Client) -> None:
    result = await client.call_tool("execute_ipython_cell", {"code": 1})
    assert result.is_error and "'code'" in text_of(result)
    result = await client.call_tool("execute_ipython_cell", {})
    assert result.is_error and "missing" in text_of(result)
    result = await client.call_tool("execute_ipython_cell", {"code": "1", "max_output_chars": 10})
    assert result.is_error and "at least 200" in text_of(result)
    result = await client.call_tool("no_such_tool", {})
    assert result.is_error and "execute_ipython_cell" in text_of(result)


async def test_an_unknown_argument_or_a_value_of_the_wrong_json_type_is_refused_by_name(
    client: Client, workspace: Path
) -> None:
    result = await client.call_tool("execute_ipython_cell", {"code": "ran = 1", "timout": 5})
    assert result.is_error and "no argument 'timout'" in text_of(result)
    assert "execute_ipython_cell(code, timeout=120, max_output_chars=5000)" in text_of(result)
    assert text_of(await run(client, "'ran' in dir()")) == "False"
    for name, value, kind in [
        ("timeout", "10", "str"),
        ("timeout", True, "bool"),
        ("max_output_chars", 5e3, "float"),
    ]:
        result = await client.call_tool("execute_ipython_cell", {"code": "1", name: value})
        assert result.is_error and f"'{name}'" in text_of(result) and f"not {kind}" in text_of(result)
    result = await client.call_tool("register_mcp_server", {"server_name": "x", "server_params": "{}"})
    assert result.is_error and "'server_params' must be a valid dictionary" in text_of(result)
    result = await client.call_tool("reset", {"hard": True})
    assert result.is_error and "reset takes no argument 'hard'" in text_of(result)
    assert not (workspace / "mcptools" / "x").exists()


_CALL = re.compile(r"`(\w+)\(([^`]*)\)`")


def _documented_calls(markdown: Path) -> list[tuple[str, str]]:
    """``(name, "name(arguments)")`` for every tool written as a call in the tool table."""
    rows = [line for line in markdown.read_text().splitlines() if line.startswith("| `")]
    return [(m[1], m[0].strip("`")) for row in rows for m in _CALL.finditer(row.split(" | ")[0])]


async def test_the_guide_and_the_skill_state_the_tools_as_the_server_declares_them(client: Client) -> None:
    """The tool tables of the user guide's MCP server page and of the codeact skill against what
    ``tools/list`` says: the same argument names, in order, with the same defaults."""
    listed = {}
    for tool in (await client.list_tools()).tools:
        required = tool.input_schema.get("required", [])
        arguments = [
            name if name in required else f"{name}={spec['default']!r}"
            for name, spec in tool.input_schema["properties"].items()
        ]
        listed[tool.name] = f"{tool.name}({', '.join(arguments)})"
    guide = dict(_documented_calls(ROOT / "docs" / "guide" / "mcp-server.md"))
    assert guide == listed
    skill = ROOT / "plugins" / "codeact" / "skills" / "codeact" / "SKILL.md"
    calls = _documented_calls(skill)
    stale = [call for name, call in calls if listed.get(name) != call]
    assert calls and not stale, (
        f"the skill's tool table says {stale}; the server lists {list(listed.values())}"
    )
    table = "\n".join(line for line in skill.read_text().splitlines() if line.startswith("| `"))
    assert all(f"`{name}" in table for name in listed)
