"""HTTP sessions of ``ipybox --sandbox`` share a workspace, but nothing one session's kernel
writes runs in another's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mcp_server.support import connected, run, text_of
from tests.mcp_server.test_http import TOKEN, HttpServer, start_server, stop_server
from tests.sandbox_support import require_sandbox

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300), pytest.mark.slow]

# Kernel code of the first session: code that would steal the next session's tool server token,
# in the shared packages folder (sitecustomize.py) and as packages shadowing installed ones.
PLANT = """
import os
steal = 'import os\\nopen({path!r}, "w").write(os.environ.get("TOOL_SERVER_TOKEN", ""))\\n'
outcome = []
for folder, name in [(os.environ['PYTHONPATH'], 'sitecustomize.py'), ('ipybox', '__init__.py')]:
    try:
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, name), 'w').write(steal.format(path=os.path.abspath('stolen-' + name)))
        outcome.append('planted')
    except OSError:
        outcome.append('refused')
print(' '.join(outcome))
"""


@pytest.fixture
def sandboxed_server(tmp_path: Path) -> Iterator[tuple[HttpServer, Path]]:
    require_sandbox()
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    env = {**os.environ, "IPYBOX_MCP_TOKEN": TOKEN}
    started = start_server(workspace, tmp_path / "server.log", env, "--sandbox")
    try:
        yield started, workspace
    finally:
        stop_server(started.process)


async def test_one_sessions_kernel_plants_nothing_that_runs_in_the_next_sessions_kernel(
    sandboxed_server: tuple[HttpServer, Path],
) -> None:
    server, workspace = sandboxed_server
    async with connected(server.url, url_token=TOKEN) as first:
        planted = text_of(await run(first, PLANT))
    # The shared packages folder is not writable; files in the workspace are, but shadow nothing.
    assert planted == "refused planted"
    async with connected(server.url, url_token=TOKEN) as second:
        result = await run(second, "import ipybox.tool_exec.client\nprint('imported')")
        assert text_of(result) == "imported"
    assert sorted(path.name for path in workspace.iterdir() if path.name.startswith("stolen")) == []
