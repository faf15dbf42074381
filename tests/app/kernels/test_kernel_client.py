import asyncio
import os
from pathlib import Path

import pytest

from ipybox.errors import KernelConnectionError, KernelDiedError
from ipybox.kernel_mgr.client import ExecutionError, ExecutionResult, KernelClient
from ipybox.kernel_mgr.server import KernelGateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_state_persists_between_executions(client: KernelClient) -> None:
    await client.execute("state_value = 21")
    result = await client.execute("print(state_value * 2)")
    assert result == ExecutionResult(text="42", images=[])


async def test_stdout_stderr_and_expression_values_are_returned_as_text(client: KernelClient) -> None:
    result = await client.execute("import sys\nprint('out')\nprint('err', file=sys.stderr)\n40 + 2")
    assert result.text == "out\nerr\n42"


async def test_code_without_output_gives_none(client: KernelClient) -> None:
    result = await client.execute("silent = 1")
    assert result.text is None
    assert result.images == []


async def test_errors_carry_name_value_and_plain_traceback(client: KernelClient) -> None:
    with pytest.raises(ExecutionError) as info:
        await client.execute("def f():\n    return 1 / 0\nf()")
    error = info.value
    assert error.ename == "ZeroDivisionError"
    assert error.evalue == "division by zero"
    assert "\x1b[" not in error.traceback
    assert "return 1 / 0" in error.traceback
    assert "ZeroDivisionError" in str(error)


async def test_output_printed_before_an_error_does_not_hide_the_error(client: KernelClient) -> None:
    with pytest.raises(ExecutionError, match="boom"):
        await client.execute("print('partial')\nraise RuntimeError('boom')")


async def test_top_level_await_works(client: KernelClient) -> None:
    result = await client.execute("import asyncio\nawait asyncio.sleep(0.01)\nprint('awaited')")
    assert result.text == "awaited"


async def test_stream_yields_output_while_the_code_still_runs(client: KernelClient, tmp_path: Path) -> None:
    go = tmp_path / "go"
    code = f"""
import os, time
print("waiting", flush=True)
deadline = time.monotonic() + 30
while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
    time.sleep(0.01)
print("released" if os.path.exists({str(go)!r}) else "never released")
"""
    items: list[str | ExecutionResult] = []
    seen = ""
    async for item in client.stream(code):
        items.append(item)
        if isinstance(item, str):
            # The kernel may send "waiting" and its newline as two chunks.
            seen += item
            if seen == "waiting\n":
                go.touch()  # only possible because the output arrived before the code ended
    assert items[-1] == ExecutionResult(text="waiting\nreleased", images=[])


async def test_every_line_of_output_arrives_before_the_result(client: KernelClient) -> None:
    result = await client.execute("for i in range(2000):\n    print(i)")
    assert result.text is not None
    assert result.text.splitlines() == [str(i) for i in range(2000)]


async def test_plots_are_saved_as_png_files(client: KernelClient) -> None:
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    result = await client.execute(code)
    assert len(result.images) == 1
    image = result.images[0]
    assert image.suffix == ".png"
    assert image.read_bytes().startswith(b"\x89PNG")
    assert image.parent == client.images_dir.absolute()


async def test_timeout_interrupts_and_keeps_the_kernel_state(client: KernelClient) -> None:
    await client.execute("kept = 'still here'")
    with pytest.raises(TimeoutError, match="interrupted"):
        await client.execute("import time\ntime.sleep(30)", timeout=1)
    result = await client.execute("print(kept)")
    assert result.text == "still here"


async def test_kernel_runs_in_the_application_working_directory(client: KernelClient) -> None:
    result = await client.execute("import os\nprint(os.getcwd())")
    assert result.text == os.getcwd()


async def test_ten_megabytes_of_output_arrive_complete(client: KernelClient) -> None:
    result = await client.execute("print('x' * 10_000_000)", timeout=60)
    assert result.text == "x" * 10_000_000


async def test_one_megabyte_of_code_runs(client: KernelClient) -> None:
    code = "big = '" + "a" * 1_000_000 + "'\nprint(len(big))"
    result = await client.execute(code, timeout=60)
    assert result.text == "1000000"


async def test_kernel_sees_only_path_and_the_gateway_env(client: KernelClient) -> None:
    result = await client.execute(
        "import os\nprint(os.environ.get('IPYBOX_TEST_VAR'), 'PATH' in os.environ, 'HOME' in os.environ)"
    )
    assert result.text == "test-value True False"


@pytest.mark.slow
async def test_reset_gives_a_fresh_kernel(gateway: KernelGateway) -> None:
    async with KernelClient(port=gateway.port) as client:
        await client.execute("before_reset = 1")
        old_id = client.kernel_id
        await client.reset()
        assert client.kernel_id != old_id
        result = await client.execute("print('before_reset' in dir())")
        assert result.text == "False"
        await client.reset()
        assert (await client.execute("print('second reset')")).text == "second reset"


@pytest.mark.slow
async def test_a_dead_kernel_is_reported_and_reset_recovers(gateway: KernelGateway) -> None:
    async with KernelClient(port=gateway.port) as client:
        with pytest.raises(KernelDiedError, match="reset"):
            await client.execute("import os\nos._exit(1)")
        with pytest.raises(KernelDiedError):
            await client.execute("print('still dead')")
        await client.reset()
        assert (await client.execute("print('alive')")).text == "alive"


async def test_concurrent_executions_on_one_client_run_in_turn(client: KernelClient) -> None:
    results = await asyncio.gather(*(client.execute(f"print({i})") for i in range(5)))
    assert [r.text for r in results] == [str(i) for i in range(5)]


async def test_connecting_to_a_missing_gateway_fails_clearly() -> None:
    # private: a port that nobody listens on, the gateway's way
    from ipybox.app.kernels._gateway import free_port

    client = KernelClient(port=free_port())
    with pytest.raises(KernelConnectionError, match="Is the gateway running"):
        await client.connect(retries=2, retry_interval=0.01)
    with pytest.raises(KernelConnectionError, match="connect"):
        _ = client.kernel_id


async def test_an_abandoned_stream_does_not_hold_up_the_next_execution(client: KernelClient) -> None:
    abandoned = client.stream("print('started', flush=True)\nimport time\ntime.sleep(0.5)")
    # The kernel may send the line and its newline as two chunks (under load): read up to the newline.
    seen = ""
    while not seen.endswith("\n"):
        chunk = await anext(abandoned)
        assert isinstance(chunk, str)
        seen += chunk
    assert seen == "started\n"
    # The caller stops reading but keeps the generator alive; the next execution still runs.
    result = await asyncio.wait_for(client.execute("print('next')"), timeout=60)
    assert result.text == "next"
    await abandoned.aclose()


@pytest.mark.slow
async def test_a_gateway_that_is_gone_is_a_kernel_connection_error_not_an_http_error() -> None:
    async with KernelGateway(port=None) as gateway:
        kernel = KernelClient(port=gateway.port)
        await kernel.connect()
    try:
        with pytest.raises(KernelConnectionError, match="did not answer"):
            await kernel.interrupt()
        with pytest.raises(KernelConnectionError):
            await kernel.reset()
    finally:
        await kernel.disconnect()
