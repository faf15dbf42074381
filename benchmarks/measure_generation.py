"""Measure code generation speed and the import time of a generated module (not a test).

    uv run python benchmarks/measure_generation.py [--runs 5]
    uv run --with datamodel-code-generator python benchmarks/measure_generation.py --compare-dcg

Prints, for the 100-tool server with nested schemas that the `apigen` figure uses
(``servers/many_tools_server.py``):

- ``generate_mcp_sources`` end to end (server start, listing, code, files), median of runs;
- the part of it that is code generation (``render_sources``) on the already-listed tools;
- with ``--compare-dcg``: datamodel-code-generator on the same 100 tools in one batched run,
  in a fresh process (the alternative that was measured and not taken, so no longer a
  dependency: add it for the run as shown above);
- the import of one generated module in a fresh Python process: pydantic, the kernel client
  and a first model (paid once per kernel), then the module, then its first ``Params(...)``.

The project's benchmark (``benchmarks/``) is what compares figures with the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ipybox.app.apigen._generate import render_sources
from ipybox.app.mcp_client._session import list_tools
from ipybox.mcp_apigen import generate_mcp_sources

HERE = Path(__file__).parent
SERVERS = HERE / "servers"
MANY_TOOLS_SERVER = SERVERS / "many_tools_server.py"

_DCG = """
import json, sys, time
t0 = time.perf_counter()
from datamodel_code_generator import DataModelType, InputFileType, generate
from datamodel_code_generator.format import Formatter
sys.path.insert(0, {here!r})
from many_tools_server import TOOLS
tools = [tool.model_dump(mode="json", by_alias=True, exclude_none=True) for tool in TOOLS]
t1 = time.perf_counter()
generate(tools, input_file_type=InputFileType.MCPTools, output_model_type=DataModelType.PydanticV2BaseModel,
         formatters=[Formatter.BUILTIN], disable_timestamp=True)
t2 = time.perf_counter()
generate(tools, input_file_type=InputFileType.MCPTools, output_model_type=DataModelType.PydanticV2BaseModel,
         formatters=[Formatter.BUILTIN], disable_timestamp=True)
print(json.dumps({{"first": t2 - t0, "import": t1 - t0, "warm": time.perf_counter() - t2}}))
"""

_IMPORT = """
import json, sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
from typing import Annotated, Literal
from pydantic import BaseModel, Field
import ipybox.tool_exec.client
class Warm(BaseModel):
    a: Annotated[int, Field(ge=0)] | None = None
    b: Literal["x"] | None = None
Warm(a=1)
t1 = time.perf_counter()
import {module} as tool
t2 = time.perf_counter()
tool.Params(query="q", address={{"street": "s", "city": "c"}})
t3 = time.perf_counter()
print(json.dumps({{"base": t1 - t0, "module": t2 - t1, "params": t3 - t2}}))
"""


def _python(code: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--compare-dcg", action="store_true")
    args = parser.parse_args()
    params = {"command": sys.executable, "args": [str(MANY_TOOLS_SERVER)]}

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["IPYBOX_STATE_DIR"] = str(Path(tmp) / "state")
        root = Path(tmp) / "out"
        totals = []
        for _ in range(args.runs):
            start = time.perf_counter()
            modules = await generate_mcp_sources("many", params, root)
            totals.append(time.perf_counter() - start)
        assert len(modules) == 100
        tools = await list_tools("many", params)
        renders = []
        for _ in range(args.runs):
            start = time.perf_counter()
            render_sources("many", tools)
            renders.append(time.perf_counter() - start)
        print(
            f"generate_mcp_sources, 100 tools, end to end: median {statistics.median(totals):.3f} s {totals}"
        )
        print(
            f"  of which code generation (render_sources):  median {statistics.median(renders) * 1000:.1f} ms"
        )

        env = dict(os.environ)
        for label, extra in [
            ("no bytecode cache (as here: PYTHONDONTWRITEBYTECODE=1)", {}),
            (
                "warm bytecode cache",
                {"PYTHONPYCACHEPREFIX": str(Path(tmp) / "pyc"), "PYTHONDONTWRITEBYTECODE": ""},
            ),
        ]:
            run_env = {**env, **extra}
            if "PYTHONPYCACHEPREFIX" in extra:
                _python(_IMPORT.format(root=str(root), module="many.tool_000"), run_env)  # fills the cache
            figures = [
                _python(_IMPORT.format(root=str(root), module=f"many.tool_{i:03d}"), run_env)
                for i in range(3)
            ]
            base, module, params_ms = (
                statistics.median(f[key] for f in figures) * 1000 for key in ("base", "module", "params")
            )
            print(f"import of one generated module, fresh process, {label}:")
            print(f"  pydantic + ipybox.tool_exec.client + a first model (once per kernel): {base:.0f} ms")
            print(
                f"  the generated module: {module:.1f} ms; its first Params(...) (compiles the models): {params_ms:.1f} ms"
            )

        if args.compare_dcg:
            for label, extra in [
                ("no bytecode cache", {}),
                (
                    "warm bytecode cache",
                    {"PYTHONPYCACHEPREFIX": str(Path(tmp) / "pyc"), "PYTHONDONTWRITEBYTECODE": ""},
                ),
            ]:
                run_env = {**env, **extra}
                if "PYTHONPYCACHEPREFIX" in extra:
                    _python(_DCG.format(here=str(SERVERS)), run_env)
                figure = _python(_DCG.format(here=str(SERVERS)), run_env)
                print(
                    f"datamodel-code-generator 0.89, same 100 tools, one batched run, {label}: "
                    f"fresh process {figure['first']:.2f} s (import {figure['import']:.2f} s), warm {figure['warm']:.2f} s"
                )


if __name__ == "__main__":
    asyncio.run(main())
