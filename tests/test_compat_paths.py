"""The old public import paths still give the objects the code now keeps elsewhere.

``ipybox.code_exec``, ``ipybox.kernel_mgr.*``, ``ipybox.tool_exec.*``, ``ipybox.mcp_apigen``,
``ipybox.policy`` and ``ipybox.oauth`` are thin re-exports: each name they list is the very object
of the subsystem that owns it (an application-side face, the error tree, or the kernel side), never
a copy, so that ``isinstance`` checks and ``except`` clauses written against either path agree.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import pytest

import ipybox
import ipybox.errors

APP_FACES = [
    f"ipybox.app.{name}"
    for name in ("executor", "pool", "kernels", "tools", "approval", "mcp_client", "apigen", "sandbox")
]

# The old paths and the names ARCHITECTURE.md promises on each.
OLD_PATHS = {
    "ipybox.code_exec": ["CodeExecutor", "CodeExecutionResult", "CodeExecutionChunk", "CodeExecutionError"],
    "ipybox.kernel_mgr.server": ["KernelGateway"],
    "ipybox.kernel_mgr.client": ["KernelClient", "ExecutionResult", "ExecutionError"],
    "ipybox.tool_exec.server": ["ToolServer"],
    "ipybox.tool_exec.client": ["ToolRunner", "ToolRunnerError"],
    "ipybox.tool_exec.approval.server": ["ApprovalChannel"],
    "ipybox.tool_exec.approval.client": ["ApprovalClient", "ApprovalRequest"],
    "ipybox.tool_exec.content": [],
    "ipybox.tool_exec.search": [],
    "ipybox.mcp_apigen": ["generate_mcp_sources"],
    "ipybox.policy": [],
    "ipybox.oauth": [],
}

# What the kernel imports: its code has no face of its own (every module of ipybox.kernel is
# private and these paths are its public ones), so its objects are known by where they are defined.
KERNEL_SIDE = {"ipybox.tool_exec.client", "ipybox.tool_exec.content", "ipybox.tool_exec.search"}


def _owners() -> list[ModuleType]:
    return [ipybox, ipybox.errors, *(importlib.import_module(face) for face in APP_FACES)]


def _owner_of(value: object, name: str) -> str | None:
    """The face or public module that holds `value` under `name`, if any."""
    for module in _owners():
        if getattr(module, name, None) is value:
            return module.__name__
    return None


@pytest.mark.parametrize("path", sorted(OLD_PATHS))
def test_an_old_path_lists_what_it_promises_and_each_name_resolves(path: str) -> None:
    module = importlib.import_module(path)
    exported = list(getattr(module, "__all__", []))
    assert exported, f"{path} lists no names in __all__"
    assert set(OLD_PATHS[path]) <= set(exported)
    for name in exported:
        assert hasattr(module, name), f"{path}.__all__ names {name}, which it does not define"


@pytest.mark.parametrize("path", sorted(set(OLD_PATHS) - KERNEL_SIDE))
def test_an_old_application_path_gives_the_objects_of_the_subsystem_that_owns_them(path: str) -> None:
    module = importlib.import_module(path)
    orphans = [name for name in module.__all__ if _owner_of(getattr(module, name), name) is None]
    assert orphans == [], f"{path} gives {orphans}, which no face of ipybox.app (nor ipybox) holds"


@pytest.mark.parametrize("path", sorted(KERNEL_SIDE))
def test_an_old_kernel_side_path_gives_the_kernel_sides_objects(path: str) -> None:
    module = importlib.import_module(path)
    for name in module.__all__:
        value = getattr(module, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue  # an alias (a Union of the content classes): it has no module of its own
        home = inspect.getmodule(value).__name__  # type: ignore[union-attr]  # a class or function has one
        assert home.startswith(("ipybox.kernel.", "ipybox.errors")), f"{path}.{name} comes from {home}"


def test_the_same_name_on_an_old_path_and_on_ipybox_is_the_same_object() -> None:
    import ipybox.code_exec
    import ipybox.kernel_mgr.client
    import ipybox.mcp_apigen
    import ipybox.tool_exec.approval.client
    import ipybox.tool_exec.client

    assert ipybox.code_exec.CodeExecutor is ipybox.CodeExecutor
    assert ipybox.code_exec.CodeExecutionResult is ipybox.CodeExecutionResult
    assert (
        ipybox.code_exec.CodeExecutionError is ipybox.CodeExecutionError is ipybox.errors.CodeExecutionError
    )
    assert ipybox.tool_exec.approval.client.ApprovalRequest is ipybox.ApprovalRequest
    assert ipybox.mcp_apigen.generate_mcp_sources is ipybox.generate_mcp_sources
    assert ipybox.tool_exec.client.ToolRunnerError is ipybox.errors.ToolRunnerError
    assert ipybox.kernel_mgr.client.ExecutionError is ipybox.errors.ExecutionError
