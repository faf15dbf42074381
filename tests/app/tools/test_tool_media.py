"""Media results end to end: tools of a real MCP server return images, audio and resources to
kernel code through `CodeExecutor`, byte for byte; size limits fail one call, not the executor."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
import pytest_asyncio

from ipybox import CodeExecutionError, CodeExecutor, generate_mcp_sources
from ipybox.tool_exec.client import ToolRunner, ToolRunnerError
from ipybox.tool_exec.content import Image
from ipybox.tool_exec.server import ToolServer
from tests.conftest import DEMO_SERVER
from tests.servers.demo_server import BLOB, png_bytes, wav_bytes

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    return workdir / "state"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["http", "stdin"])
async def executor(
    workdir: Path, streamable_http_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[CodeExecutor]:
    """Each test runs with tool calls over HTTP and over the kernel's stdin channel."""
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    await generate_mcp_sources("demo_http", {"url": streamable_http_url}, workdir / "mcptools")
    async with CodeExecutor(images_dir=workdir / "images", tool_channel=request.param) as ex:
        yield ex


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_every_kind_of_content_reaches_kernel_code_typed_and_byte_for_byte(
    executor: CodeExecutor,
) -> None:
    code = """
import base64, json
from mcptools.demo import audio, chart, embedded_blob, embedded_text, image, link, text_and_image
from ipybox.tool_exec.content import Audio, BlobResource, Image, ResourceLink, Text, TextResource

def b64(data):
    return base64.b64encode(data).decode()

out = {}
[part] = image.run_content(image.Params()).parts
assert isinstance(part, Image)
out["image"] = [part.mime_type, b64(part.data)]
[part] = audio.run_content(audio.Params()).parts
assert isinstance(part, Audio)
out["audio"] = [part.mime_type, b64(part.data)]
[part] = link.run_content(link.Params()).parts
assert isinstance(part, ResourceLink)
out["link"] = [part.uri, part.name, part.mime_type, part.description, part.size]
[part] = embedded_text.run_content(embedded_text.Params()).parts
assert isinstance(part, TextResource)
out["embedded_text"] = [part.uri, part.text, part.mime_type]
[part] = embedded_blob.run_content(embedded_blob.Params()).parts
assert isinstance(part, BlobResource)
out["embedded_blob"] = [part.uri, b64(part.data), part.mime_type]
mixed = text_and_image.run_content(text_and_image.Params(caption="a caption"))
out["mixed"] = [type(p).__name__ for p in mixed.parts] + [mixed.text, b64(mixed.images[0].data)]
charted = chart.run_content(chart.Params(points=5))
out["chart"] = [charted.structured, b64(charted.images[0].data)]
print(json.dumps(out))
"""
    result = await executor.execute(code)
    assert result.text is not None
    out = json.loads(result.text)
    assert out["image"] == ["image/png", b64(png_bytes())]
    assert out["audio"] == ["audio/wav", b64(wav_bytes())]
    assert out["link"] == ["file:///data/report.csv", "report.csv", "text/csv", "The quarterly report", 1234]
    assert out["embedded_text"] == ["memo://notes/1", "line one\nline two ✓", "text/markdown"]
    assert out["embedded_blob"] == ["blob://bytes/all", b64(BLOB), "application/octet-stream"]
    assert out["mixed"] == ["Text", "Image", "Text", "a caption\nend", b64(png_bytes(8, 8))]
    assert out["chart"] == [{"points": 5}, b64(png_bytes(5, 2))]


async def test_run_keeps_returning_text_for_tools_that_also_return_media(executor: CodeExecutor) -> None:
    code = """
from mcptools.demo import text_and_image
print(repr(text_and_image.run(text_and_image.Params(caption="only text"))))
"""
    assert (await executor.execute(code)).text == "'only text\\nend'"


async def test_async_content_calls_return_the_same_bytes_and_save_writes_them(
    executor: CodeExecutor, workdir: Path
) -> None:
    code = """
import asyncio
from mcptools.demo import audio, embedded_blob, image
pic, sound, blob = await asyncio.gather(
    image.arun_content(image.Params()),
    audio.arun_content(audio.Params()),
    embedded_blob.arun_content(embedded_blob.Params()),
)
print(pic.images[0].save("saved/pic.png"))
print(sound.audio[0].save("saved/sound.wav"))
print(blob.resources[0].save("saved/blob.bin"))
"""
    result = await executor.execute(code)
    assert result.text is not None
    paths = [Path(line) for line in result.text.splitlines()]
    assert [path.read_bytes() for path in paths] == [png_bytes(), wav_bytes(), BLOB]
    assert all(path.is_relative_to(workdir) for path in paths)


async def test_an_image_from_a_tool_displayed_in_the_kernel_reaches_the_result_images(
    executor: CodeExecutor,
) -> None:
    code = """
from IPython.display import display
from mcptools.demo import image
display(image.run_content(image.Params()).images[0])
"""
    result = await executor.execute(code)
    assert len(result.images) == 1
    assert result.images[0].read_bytes() == png_bytes()


@pytest.mark.slow
async def test_a_result_over_the_size_limit_fails_that_call_and_the_executor_keeps_working(
    executor: CodeExecutor,
) -> None:
    # 25.5 MB of bytes is 34 MB of base64: over the tool server's 32 MiB, under the HTTP message limit.
    code = "from mcptools.demo_http import blob\nblob.run_content(blob.Params(size=25_500_000))"
    with pytest.raises(CodeExecutionError, match=r"over the tool server's limit of 32\.0 MiB") as info:
        await executor.execute(code)
    assert info.value.ename == "ToolRunnerError"
    # 50 MB is over what one MCP message may carry: the SDK's limit, named in the error.
    code = "from mcptools.demo_http import blob\nblob.run_content(blob.Params(size=50_000_000))"
    with pytest.raises(CodeExecutionError, match=r"too large to receive.*byte limit"):
        await executor.execute(code)
    code = """
from mcptools.demo_http import blob, echo
print(echo.run(echo.Params(text="still here")), len(blob.run_content(blob.Params(size=1_000_000)).parts[0].data))
"""
    assert (await executor.execute(code)).text == "still here 1000000"


async def test_a_tool_servers_own_limit_fails_a_larger_result_over_stdio_and_the_next_call_works() -> None:
    async with (
        ToolServer(port=0, max_result_size=10_000, approval_required=False, trust_all_clients=True) as server,
        ToolRunner("demo", DEMO, port=server.port) as runner,
    ):
        with pytest.raises(
            ToolRunnerError, match=r"result is at least 13336 bytes, over the tool server.s limit of 10000"
        ):
            await runner.run_content("blob", {"size": 10_000})
        content = await runner.run_content("blob", {"size": 5_000})
        assert content.parts == [Image(b"\xab" * 5_000, "application/octet-stream")]
        with pytest.raises(ToolRunnerError, match="over the tool server's limit"):
            await runner.run("echo", {"text": "x" * 20_000})  # run() is bound by the same limit
        assert await runner.run("echo", {"text": "small"}) == "small"


@pytest.mark.slow
@pytest.mark.parametrize("channel", ["http", "stdin"])
async def test_an_executors_own_limit_fails_a_larger_result_and_the_next_call_works(
    workdir: Path, channel: Literal["http", "stdin"]
) -> None:
    await generate_mcp_sources("demo", DEMO, workdir / "mcptools")
    async with CodeExecutor(
        images_dir=workdir / "images", approve_tool_calls=False, max_result_size=10_000, tool_channel=channel
    ) as ex:
        with pytest.raises(CodeExecutionError, match=r"over the tool server.s limit of 10000"):
            await ex.execute("from mcptools.demo import blob\nblob.run_content(blob.Params(size=10_000))")
        code = "from mcptools.demo import blob\nprint(len(blob.run_content(blob.Params(size=5_000)).parts[0].data))"
        assert (await ex.execute(code)).text == "5000"
    with pytest.raises(ValueError, match="max_result_size must be a positive number"):
        CodeExecutor(max_result_size=0)


async def test_a_tool_server_refuses_a_limit_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="max_result_size must be a positive number"):
        ToolServer(max_result_size=0)
