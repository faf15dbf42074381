"""Attacks from a sandboxed kernel on the MCP server's trusted file access (upload, download,
``mcptools/`` generation, the images folder): links planted in the workspace, folders swapped
for links while a tool runs, hard links to secrets, and the files the sandbox protects."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import mcp_types as types
import pytest
import pytest_asyncio
from mcp.client import Client
from mcp.shared.exceptions import MCPError

from tests.conftest import DEMO_SERVER
from tests.mcp_server.support import connected, run, server_env, stdio_params, text_of
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]

SECRET = "DOTENV_SECRET=hidden-from-the-kernel"
# Each race runs at most this many swaps in the kernel (a short pause between two, so that they
# last while the test calls the tool over and over; the test stops them when its calls are done).
SWAPS = 20000
SWAP_PAUSE = 0.0002
CALLS = 150


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    require_sandbox()
    path = tmp_path_factory.mktemp("confined").resolve()
    (path / "workspace").mkdir()
    (path / "workspace" / ".env").write_text(SECRET + "\n")
    (path / "outside").mkdir()
    (path / "outside" / "secret.txt").write_text("outside secret")
    yield path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(root: Path) -> AsyncIterator[Client]:
    env = server_env(IPYBOX_STATE_DIR=str(root / "state"))
    async with connected(stdio_params(root / "workspace", "--sandbox", env=env)) as client:
        yield client


@pytest.fixture
def outside(root: Path) -> Iterator[Path]:
    """A folder outside the workspace, as kernel code would aim a link at; checked unchanged after."""
    before = _tree(root / "outside")
    yield root / "outside"
    assert _tree(root / "outside") == before, "something was written or deleted outside the workspace"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _blob(result: types.CallToolResult) -> bytes:
    blobs = [b.resource for b in result.content if isinstance(b, types.EmbeddedResource)]
    assert len(blobs) == 1 and isinstance(blobs[0], types.BlobResourceContents), text_of(result)
    return base64.b64decode(blobs[0].blob)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def _start_swapping(client: Client, name: str, target: Path) -> None:
    """Start a thread in the kernel that swaps the folder `name` with a link to `target`, over and over.

    Each swap is one atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``), so `name` is always
    there, a folder or a link, never missing.
    """
    code = (
        "import ctypes, os, threading, time\n"
        f"os.makedirs({name!r}, exist_ok=True)\n"
        f"os.symlink({str(target)!r}, {name + '.link'!r})\n"
        "_libc = ctypes.CDLL(None, use_errno=True)\n"
        "_stop = threading.Event()\n"
        "_swaps = 0\n"
        "def _swap():\n"
        "    global _swaps\n"
        f"    for _ in range({SWAPS}):\n"
        "        if _stop.is_set():\n"
        "            break\n"
        f"        if _libc.renameat2(-100, {name.encode()!r}, -100, {(name + '.link').encode()!r}, 2) != 0:\n"
        "            raise OSError(ctypes.get_errno(), 'renameat2')\n"
        "        _swaps += 1\n"
        f"        time.sleep({SWAP_PAUSE})\n"
        "_swapper = threading.Thread(target=_swap)\n"
        "_swapper.start()\n"
    )
    result = await run(client, code)
    assert not result.is_error, text_of(result)


async def _stop_swapping(client: Client, name: str) -> None:
    """Stop the swapping thread and leave `name` a folder again; the swaps must have happened."""
    code = (
        "_stop.set(); _swapper.join()\n"
        f"if os.path.islink({name!r}):\n"
        f"    _libc.renameat2(-100, {name.encode()!r}, -100, {(name + '.link').encode()!r}, 2)\n"
        f"os.unlink({name + '.link'!r})\n"
        "print(_swaps)\n"
    )
    result = await run(client, code)
    assert not result.is_error and int(text_of(result)) > 0, text_of(result)


async def test_uploads_and_downloads_never_leave_the_workspace_while_a_folder_is_swapped_for_a_link(
    client: Client, root: Path, outside: Path
) -> None:
    workspace = root / "workspace"
    (workspace / "data").mkdir()
    (workspace / "data" / "secret.txt").write_text("inside")
    before = _tree(outside)
    read: list[bytes] = []
    crashes: list[str] = []
    await _start_swapping(client, "data", outside)
    for index in range(CALLS):
        try:
            up = await client.call_tool(
                "upload_file", {"path": f"data/up-{index}.txt", "content_base64": _b64(b"x")}
            )
            assert not up.is_error or "symbolic link" in text_of(up), text_of(up)
            down = await client.call_tool("download_file", {"path": "data/secret.txt"})
        except MCPError as exc:
            crashes.append(str(exc))
            continue
        if down.is_error:
            assert "symbolic link" in text_of(down), text_of(down)
        else:
            read.append(_blob(down))
    await _stop_swapping(client, "data")
    assert _tree(outside) == before, "an upload was written outside the workspace"
    assert set(read) <= {b"inside"}, "a download read a file outside the workspace"
    assert not crashes, crashes


async def test_register_never_writes_or_deletes_outside_while_mcptools_is_swapped_for_a_link(
    client: Client, outside: Path, root: Path
) -> None:
    # What an rmtree through the link would delete, and a package written through it would replace.
    (outside / "demo").mkdir()
    (outside / "demo" / "keep.txt").write_text("precious")
    try:
        await _start_swapping(client, "mcptools", outside)
        demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
        # A folder's modification time changes with every entry made or removed in it, so even a
        # write outside that was cleaned up again shows.
        stamps = [os.stat(folder).st_mtime_ns for folder in (outside, outside / "demo")]
        crashes: list[str] = []
        for _ in range(8):
            try:
                registered = await client.call_tool(
                    "register_mcp_server", {"server_name": "demo", "server_params": demo}
                )
            except MCPError as exc:
                crashes.append(str(exc))
                continue
            if registered.is_error:
                crashes.append(text_of(registered))
        await _stop_swapping(client, "mcptools")
        assert [os.stat(folder).st_mtime_ns for folder in (outside, outside / "demo")] == stamps
        assert (outside / "demo").is_dir() and os.listdir(outside / "demo") == ["keep.txt"]
        assert (outside / "demo" / "keep.txt").read_text() == "precious"
        assert sorted(os.listdir(outside)) == ["demo", "secret.txt"]
        # Refused while a link stood in place of mcptools/ is fine; anything else is not.
        assert all("symbolic link" in text for text in crashes), crashes
        registered = await client.call_tool(
            "register_mcp_server", {"server_name": "demo", "server_params": demo}
        )
        assert not registered.is_error, text_of(registered)
        assert (root / "workspace" / "mcptools" / "demo" / "echo.py").is_file()
    finally:
        (outside / "demo" / "keep.txt").unlink()
        (outside / "demo").rmdir()


async def test_a_link_planted_in_place_of_a_package_is_replaced_not_followed(
    client: Client, outside: Path
) -> None:
    demo = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
    planted = await run(
        client,
        "import os, shutil\nos.makedirs('mcptools', exist_ok=True)\nshutil.rmtree('mcptools/demo', ignore_errors=True)\n"
        f"os.symlink({str(outside)!r}, 'mcptools/demo')\n",
    )
    assert not planted.is_error, text_of(planted)
    registered = await client.call_tool("register_mcp_server", {"server_name": "demo", "server_params": demo})
    assert not registered.is_error, text_of(registered)
    called = await run(
        client, "from mcptools.demo import echo\nprint(echo.run(echo.Params(text='regenerated')))"
    )
    assert text_of(called) == "regenerated", text_of(called)


@pytest.mark.parametrize(
    "path",
    [
        ".mcp.json",
        ".claude/settings.json",
        "sandbox-config.json",
        ".env",
        "sub/.ENV",
        ".git/config",
        ".vscode/tasks.json",
    ],
)
async def test_files_that_configure_trusted_programs_cannot_be_uploaded(
    client: Client, root: Path, path: str
) -> None:
    before = (root / "workspace" / ".env").read_text()
    content = _b64(b'{"network": {"allowedDomains": ["*"]}}')
    refused = await client.call_tool("upload_file", {"path": path, "content_base64": content})
    assert refused.is_error and "cannot be transferred" in text_of(refused), text_of(refused)
    assert (root / "workspace" / ".env").read_text() == before
    # srt may leave empty placeholders for protected names while the sandbox runs.
    target = root / "workspace" / path
    assert not target.is_file() or b"allowedDomains" not in target.read_bytes()


async def test_secrets_cannot_be_downloaded_by_name_link_or_hard_link(client: Client, root: Path) -> None:
    workspace = root / "workspace"
    denied = await run(client, "open('.env').read()")
    assert denied.is_error, "the sandbox let the kernel read .env"
    planted = await run(
        client, "import os\nos.symlink('.env', 'env-link')\nos.symlink('../outside/secret.txt', 'out-link')"
    )
    assert not planted.is_error, text_of(planted)
    # A hard link to .env, as a kernel able to make one would leave (the test makes it: srt's
    # mount over .env may keep the kernel itself from linking it).
    os.link(workspace / ".env", workspace / "env-hard")
    os.link(root / "outside" / "secret.txt", workspace / "out-hard")
    for path, reason in [
        (".env", "cannot be transferred"),
        ("./.Env", "cannot be transferred"),
        ("env-link", "symbolic link"),
        ("out-link", "symbolic link"),
        ("env-hard", "hard links"),
        ("out-hard", "hard links"),
    ]:
        down = await client.call_tool("download_file", {"path": path})
        assert down.is_error and reason in text_of(down), (path, text_of(down))
        assert "hidden" not in text_of(down) and "outside secret" not in text_of(down)
    # Uploading over a hard link replaces the name: the linked file outside is never written.
    replaced = await client.call_tool("upload_file", {"path": "out-hard", "content_base64": _b64(b"new")})
    assert not replaced.is_error, text_of(replaced)
    assert (root / "outside" / "secret.txt").read_text() == "outside secret"
    assert (workspace / "out-hard").read_bytes() == b"new"


async def test_folders_and_missing_files_get_clear_errors(client: Client, root: Path) -> None:
    workspace = root / "workspace"
    (workspace / "folder").mkdir()
    folder = await client.call_tool("download_file", {"path": "folder"})
    assert folder.is_error and "is a folder" in text_of(folder), text_of(folder)
    missing = await client.call_tool("download_file", {"path": "nothing-here.txt"})
    assert missing.is_error and "There is no file 'nothing-here.txt'" in text_of(missing), text_of(missing)
    slash = await client.call_tool("upload_file", {"path": "newdir/", "content_base64": _b64(b"x")})
    assert slash.is_error and "ends in '/'" in text_of(slash), text_of(slash)
    assert not (workspace / "newdir").exists()
    onto = await client.call_tool("upload_file", {"path": "folder", "content_base64": _b64(b"x")})
    assert onto.is_error and "is a folder" in text_of(onto), text_of(onto)
    assert (workspace / "folder").is_dir()
    long = await client.call_tool("upload_file", {"path": "x" * 300, "content_base64": _b64(b"x")})
    assert long.is_error and "Could not write" in text_of(long) and "too long" in text_of(long), text_of(long)


async def test_images_are_never_written_through_a_link_in_place_of_the_images_folder(
    client: Client, root: Path, outside: Path
) -> None:
    from tests.servers.demo_server import png_bytes

    show = f"from IPython.display import Image, display\ndisplay(Image(data={png_bytes()!r}))\n"
    planted = await run(
        client,
        f"import os, shutil\nshutil.rmtree('images', ignore_errors=True)\nos.symlink({str(outside)!r}, 'images')",
    )
    assert not planted.is_error, text_of(planted)
    shown = await run(client, show)
    assert "The image was not saved" in text_of(shown) and "symbolic link" in text_of(shown), text_of(shown)
    assert not [c for c in shown.content if isinstance(c, types.ImageContent)]
    await run(client, "os.unlink('images')")
    shown = await run(client, show)
    assert [c for c in shown.content if isinstance(c, types.ImageContent)], text_of(shown)
    assert len(os.listdir(root / "workspace" / "images")) == 1


@pytest.mark.timeout(180)
async def test_the_file_tools_refuse_what_a_custom_sandbox_config_denies_the_kernel(root: Path) -> None:
    workspace = root / "custom-workspace"
    (workspace / "secrets").mkdir(parents=True)
    (workspace / "secrets" / "key.txt").write_text("api-key")
    (workspace / "locked").mkdir()
    config = root / "custom-sandbox.json"
    config.write_text(
        json.dumps(
            {
                "network": {"allowedDomains": [], "deniedDomains": []},
                "filesystem": {
                    "denyRead": ["secrets", "*.pem"],
                    "allowWrite": ["."],
                    "denyWrite": ["locked"],
                },
            }
        )
    )
    (workspace / "cert.pem").write_text("private")
    env = server_env(IPYBOX_STATE_DIR=str(root / "custom-state"))
    async with connected(stdio_params(workspace, "--sandbox-config", str(config), env=env)) as client:
        denied = await run(client, "open('secrets/key.txt').read()")
        assert denied.is_error, "the sandbox let the kernel read a denied file"
        for path in ["secrets/key.txt", "./secrets//key.txt", "cert.pem"]:
            down = await client.call_tool("download_file", {"path": path})
            assert down.is_error and "sandbox's settings" in text_of(down), text_of(down)
            assert "api-key" not in text_of(down) and "private" not in text_of(down)
        up = await client.call_tool("upload_file", {"path": "locked/run.sh", "content_base64": _b64(b"x")})
        assert up.is_error and "sandbox's settings" in text_of(up), text_of(up)
        assert os.listdir(workspace / "locked") == []
        allowed = await client.call_tool(
            "upload_file", {"path": "free/ok.txt", "content_base64": _b64(b"ok")}
        )
        assert not allowed.is_error, text_of(allowed)


async def test_an_image_swapped_for_a_link_after_it_was_saved_is_not_read_back(
    client: Client, root: Path, outside: Path
) -> None:
    from tests.servers.demo_server import png_bytes

    private = png_bytes(7, 7)
    (outside / "private.png").write_bytes(private)
    try:
        # The cell shows a plot, waits until the client has saved it, then puts a link to a
        # file outside in its place before the server reads it back.
        code = (
            "import os, time\n"
            "from IPython.display import Image, display\n"
            "os.makedirs('images', exist_ok=True)\n"
            "before = set(os.listdir('images'))\n"
            f"display(Image(data={png_bytes()!r}))\n"
            "deadline = time.monotonic() + 60\n"
            "while not (new := set(os.listdir('images')) - before) and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "name = new.pop()\n"
            "os.unlink(os.path.join('images', name))\n"
            f"os.symlink({str(outside / 'private.png')!r}, os.path.join('images', name))\n"
            "print('swapped')\n"
        )
        shown = await run(client, code)
        assert "swapped" in text_of(shown), text_of(shown)
        images = [base64.b64decode(c.data) for c in shown.content if isinstance(c, types.ImageContent)]
        assert private not in images
        assert "was not read back" in text_of(shown) and "symbolic link" in text_of(shown), text_of(shown)
    finally:
        (outside / "private.png").unlink()


async def test_an_image_corrupted_after_it_was_saved_is_reported_not_a_server_error(client: Client) -> None:
    from tests.servers.demo_server import png_bytes

    code = (
        "import os, time\n"
        "from IPython.display import Image, display\n"
        "os.makedirs('images', exist_ok=True)\n"
        "before = set(os.listdir('images'))\n"
        f"display(Image(data={png_bytes()!r}))\n"
        "deadline = time.monotonic() + 60\n"
        "while not (new := set(os.listdir('images')) - before) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "open(os.path.join('images', new.pop()), 'wb').write(b'not a png')\n"
        "print('corrupted')\n"
    )
    shown = await run(client, code)
    assert "corrupted" in text_of(shown) and "is not shown: it could not be decoded" in text_of(shown), (
        text_of(shown)
    )
    assert not [c for c in shown.content if isinstance(c, types.ImageContent)]
