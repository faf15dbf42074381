"""Generate APIs from real MCP servers, import every module and call every tool through a tool server.

Servers: the SDK demo server (tests/servers/demo_server.py) over stdio, streamable HTTP and
SSE, ``mcp-server-time`` (PyPI) and ``@modelcontextprotocol/server-filesystem`` (npm, via
``npx``). Calls go the way agent code makes them: generated ``run()`` -> ``run_tool`` -> the
secured ``ToolServer`` (which finds the server in the registry ``generate_mcp_sources`` wrote).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from ipybox.errors import ToolRunnerError
from ipybox.mcp_apigen import generate_mcp_sources
from ipybox.tool_exec.server import ToolServer
from tests.app.apigen.apigen_support import check_source, importable, unique_package
from tests.conftest import DEMO_SERVER

pytestmark = pytest.mark.slow


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "mcptools"
    path.mkdir()
    with importable(path):
        yield path


async def generate_and_import(root: Path, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Generate a package for the server, check every file, import every module."""
    package = unique_package("srv")
    modules = await generate_mcp_sources(package, params, root)
    for path in (root / package).glob("*.py"):
        check_source(path.read_text("utf-8"))
    imported = {name: __import__(f"{package}.{name}", fromlist=["run"]) for name in modules}
    return package, imported


async def call(module: Any, **arguments: Any) -> Any:
    """Call a generated tool the way kernel code does (``run`` blocks, so not on the event loop)."""
    params = module.Params(**arguments)
    return await anyio.to_thread.run_sync(module.run, params)


def value(result: Any) -> Any:
    """A tool's result: the wrapped value of a primitive-returning tool, else the result itself."""
    return result.result if hasattr(result, "result") and type(result).__name__ == "Result" else result


DemoCheck = Callable[[Any], object]


def _check_directory(result: Any) -> None:
    assert [person.name for person in result.people] == ["Ann", "Bob"]
    assert result.people[1].addresses[0].city == "Berlin"
    assert result.meta == {"version": 1}


def _check_order(result: Any) -> None:
    assert (result.item, result.color, result.size, result.quantity) == ("tea", "green", 2, 1)
    assert result.dimensions.unit == "cm" and result.dimensions.width == 1.5


DEMO_CALLS: dict[str, tuple[dict[str, Any], DemoCheck]] = {
    "echo": ({"text": "hi \"there\" '''"}, lambda r: value(r) == "hi \"there\" '''" or pytest.fail(repr(r))),
    "greet": ({"name": "Ada"}, lambda r: value(r) == "Hello, Ada!" or pytest.fail(repr(r))),
    "add": ({"a": 2, "b": 3}, lambda r: r.sum == 5 or pytest.fail(repr(r))),
    "directory": ({"names": ["Ann", "Bob"]}, _check_directory),
    "order": ({"item": "tea", "color": "green", "dimensions": {"width": 1.5, "height": 2}}, _check_order),
    "slow": ({"seconds": 0.01}, lambda r: "slept" in str(value(r)) or pytest.fail(repr(r))),
    "getenv": ({"name": "IPYBOX_SURELY_UNSET_VARIABLE"}, lambda r: value(r) == "" or pytest.fail(repr(r))),
    "pid": ({}, lambda r: int(value(r)) > 0 or pytest.fail(repr(r))),
    "rendezvous": ({"key": "alone", "count": 1}, lambda r: value(r) == "1 together" or pytest.fail(repr(r))),
    # Media tools: run() keeps returning the text parts (tests/app/tools/test_tool_media.py checks the media).
    "text_and_image": ({"caption": "c"}, lambda r: value(r) == "c\nend" or pytest.fail(repr(r))),
    "chart": ({"points": 2}, lambda r: value(r) == '{"points": 2}' or pytest.fail(repr(r))),
    "blob": ({"size": 3}, lambda r: value(r) == "null" or pytest.fail(repr(r))),
}


async def test_demo_server_over_stdio_generates_modules_that_call_every_tool(
    root: Path, tool_server: ToolServer
) -> None:
    _, modules = await generate_and_import(root, {"command": sys.executable, "args": [str(DEMO_SERVER)]})
    assert {"echo", "greet", "add", "directory", "order", "slow", "fail", "crash", "getenv", "pid"} <= set(
        modules
    )

    for name, module in modules.items():
        if name in DEMO_CALLS:
            arguments, check = DEMO_CALLS[name]
            check(await call(module, **arguments))
        elif name not in ("fail", "crash"):
            await call(module)  # a tool added to the demo server later: at least callable without arguments

    with pytest.raises(ToolRunnerError, match="boom") as failed:
        await call(modules["fail"], message="boom")
    assert failed.value.kind == "failed" and failed.value.tool_name == "fail"
    with pytest.raises(ToolRunnerError):
        await call(modules["crash"])
    assert (await call(modules["add"], a=1, b=1)).sum == 2  # the tool server starts the server again


@pytest.mark.parametrize("transport", ["streamable_http", "sse"])
async def test_demo_server_over_http_generates_modules_that_call_tools(
    transport: str, request: pytest.FixtureRequest, root: Path, tool_server: ToolServer
) -> None:
    url = request.getfixturevalue("streamable_http_url" if transport == "streamable_http" else "sse_url")
    _, modules = await generate_and_import(root, {"url": url, "type": transport})
    for name in ("add", "directory", "order", "echo"):
        arguments, check = DEMO_CALLS[name]
        check(await call(modules[name], **arguments))


async def test_mcp_server_time_generates_modules_that_call_every_tool(
    root: Path, tool_server: ToolServer
) -> None:
    params = {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]}
    _, modules = await generate_and_import(root, params)
    assert set(modules) == {"get_current_time", "convert_time"}

    now = await call(modules["get_current_time"], timezone="Europe/Berlin")
    assert now.timezone == "Europe/Berlin" and now.datetime
    converted = await call(
        modules["convert_time"], source_timezone="Europe/Berlin", time="12:00", target_timezone="Asia/Tokyo"
    )
    assert converted.source.timezone == "Europe/Berlin" and converted.target.timezone == "Asia/Tokyo"
    assert converted.target.datetime.endswith("+09:00") or "T" in converted.target.datetime


async def test_filesystem_server_generates_modules_that_call_every_tool(
    root: Path, tmp_path: Path, tool_server: ToolServer
) -> None:
    if shutil.which("npx") is None:
        pytest.skip("npx is not installed")
    files = (tmp_path / "files").resolve()
    files.mkdir()
    params = {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", str(files)]}
    _, fs = await generate_and_import(root, params)

    a, b = str(files / "a.txt"), str(files / "b.txt")
    calls: dict[str, tuple[dict[str, Any], Callable[[str], bool]]] = {
        "list_allowed_directories": ({}, lambda text: str(files) in text),
        "write_file": ({"path": a, "content": "alpha\nbeta\n"}, lambda text: "a.txt" in text),
        "read_text_file": ({"path": a}, lambda text: "alpha" in text),
        "read_file": ({"path": a, "head": 1}, lambda text: "alpha" in text and "beta" not in text),
        "read_multiple_files": ({"paths": [a]}, lambda text: "beta" in text),
        "edit_file": (
            {"path": a, "edits": [{"oldText": "beta", "newText": "gamma"}]},
            lambda text: "gamma" in text,
        ),
        "create_directory": ({"path": str(files / "sub" / "deeper")}, lambda text: "deeper" in text),
        "move_file": ({"source": a, "destination": b}, lambda text: "b.txt" in text),
        "get_file_info": ({"path": b}, lambda text: "size" in text),
        "list_directory": ({"path": str(files)}, lambda text: "b.txt" in text and "sub" in text),
        "list_directory_with_sizes": ({"path": str(files), "sortBy": "size"}, lambda text: "b.txt" in text),
        "directory_tree": ({"path": str(files), "excludePatterns": ["*.tmp"]}, lambda text: "deeper" in text),
        "search_files": ({"path": str(files), "pattern": "**/b.txt"}, lambda text: "b.txt" in text),
        "read_media_file": ({"path": b}, lambda text: bool(text)),
    }
    assert set(fs) == set(calls), "a tool of the filesystem server is not called by this test"
    for name, (arguments, check) in calls.items():
        result = await call(fs[name], **arguments)
        text = result if isinstance(result, str) else str(result.model_dump())
        assert check(text), f"{name}: {text!r}"
    assert (files / "b.txt").read_text() == "alpha\ngamma\n"
