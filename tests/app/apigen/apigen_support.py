"""Helpers shared by the code generation tests: write generated sources, import them, inspect them."""

from __future__ import annotations

import ast
import importlib
import itertools
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from mcp.types import Tool

TOOLS_SERVER = Path(__file__).with_name("tools_server.py")

# What a generated module may import: json, Pydantic, typing and the kernel-side client, nothing else.
ALLOWED_IMPORTS = {"__future__", "typing", "pydantic", "ipybox.tool_exec.client"}

_counter = itertools.count()


def tool(
    name: str, input_schema: Mapping[str, Any], output_schema: Mapping[str, Any] | None = None, **extra: Any
) -> Tool:
    """An MCP SDK ``Tool`` as a server would list it."""
    return Tool(
        name=name,
        input_schema=dict(input_schema),
        output_schema=dict(output_schema) if output_schema is not None else None,
        **extra,
    )


def unique_package(prefix: str = "gen") -> str:
    """A package name no other test in this process uses (imported modules stay in ``sys.modules``)."""
    return f"{prefix}_{next(_counter)}"


def write_sources(root: Path, package: str, sources: Mapping[str, str]) -> Path:
    directory = root / package
    directory.mkdir(parents=True)
    for module, code in sources.items():
        (directory / f"{module}.py").write_text(code, encoding="utf-8")
    return directory


def check_source(code: str) -> None:
    """Assert that generated code parses and imports only what generated code may import."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert [alias.name for alias in node.names] == ["json"], ast.unparse(node)
        if isinstance(node, ast.ImportFrom):
            assert node.module in ALLOWED_IMPORTS, f"generated code imports from {node.module!r}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"eval", "exec", "open", "__import__", "compile"}, ast.unparse(node)


@contextmanager
def importable(root: Path) -> Iterator[None]:
    """Make packages under ``root`` importable for the duration, and forget them afterwards."""
    sys.path.insert(0, str(root))
    before = set(sys.modules)
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            module = sys.modules.get(name)
            if module is not None and str(getattr(module, "__file__", "") or "").startswith(str(root)):
                del sys.modules[name]
        importlib.invalidate_caches()


def import_module(package: str, module: str) -> ModuleType:
    return importlib.import_module(f"{package}.{module}")
