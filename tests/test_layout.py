"""The package layout: what runs inside the kernel imports only the standard library.

Every fresh kernel imports ``ipybox.kernel`` (through generated tool modules and the kernel
extension), next to the agent's code: a third-party import there would cost every kernel start,
could fail in a kernel whose Python lacks the package, and would widen what hostile code reaches.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ipybox

SRC = Path(ipybox.__file__).parent

# What the kernel imports of ipybox: the kernel package, the public paths generated code uses,
# and the three modules they need (the package root is lazy; the errors module and the wire
# contract, ``_wire``, are stdlib only).
KERNEL_SIDE = [
    *sorted((SRC / "kernel").glob("*.py")),
    SRC / "__init__.py",
    SRC / "errors.py",
    SRC / "_wire.py",
    SRC / "tool_exec" / "__init__.py",
    SRC / "tool_exec" / "client" / "__init__.py",
    SRC / "tool_exec" / "content" / "__init__.py",
    SRC / "tool_exec" / "search" / "__init__.py",
]
# The IPython extension (and its shell half) runs in the kernel's own IPython, which every kernel has.
ALLOWED_EXTRA = {SRC / "kernel" / name: frozenset({"IPython"}) for name in ("_ext.py", "_ext_shell.py")}
# The kernel class is imported only by the kernel process as it starts, from its own ipykernel.
ALLOWED_EXTRA[SRC / "kernel" / "_kernel.py"] = frozenset({"ipykernel"})
ALLOWED_IPYBOX = ("ipybox.kernel", "ipybox.errors", "ipybox._wire", "ipybox.tool_exec")


def foreign_imports(source: str, extra: frozenset[str] = frozenset()) -> list[str]:
    """The imports in `source` (at any depth, outside ``if TYPE_CHECKING:``) that leave the stdlib."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.orelse:
                visit(statement)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or top in extra:
                continue
            if name == "ipybox" or name.startswith(tuple(f"{prefix}." for prefix in ALLOWED_IPYBOX)):
                continue
            if name in ALLOWED_IPYBOX:
                continue
            found.append(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_the_checker_finds_a_third_party_import_at_any_depth() -> None:
    source = "import os\ndef f():\n    import httpx\n    from pydantic import BaseModel\n    from ipybox.app import _gateway\n"
    assert foreign_imports(source) == ["httpx", "pydantic", "ipybox.app"]


def test_the_kernel_side_imports_only_the_standard_library() -> None:
    assert (SRC / "kernel" / "_tool_client.py") in KERNEL_SIDE
    for path in KERNEL_SIDE:
        foreign = foreign_imports(path.read_text(), ALLOWED_EXTRA.get(path, frozenset()))
        assert foreign == [], (
            f"{path.relative_to(SRC)} imports {foreign}: the kernel side is standard library only"
        )


def test_the_kernel_side_imports_in_an_interpreter_that_refuses_every_third_party_package() -> None:
    code = f"""
import json, sys
sys.path.insert(0, {str(SRC.parent)!r})

class Refuse:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top != "ipybox":
            raise ImportError(f"third-party import {{name!r}} on the kernel side")
        return None

sys.meta_path.insert(0, Refuse())
try:
    import httpx
except ImportError:
    pass
else:
    raise SystemExit("the hook let a third-party package through")
import ipybox.kernel, ipybox.kernel._tool_client, ipybox.kernel._content, ipybox.kernel._ext
import ipybox.kernel._exec_wall, ipybox.tool_exec.client, ipybox.tool_exec.content, ipybox.tool_exec.search
print(json.dumps(sorted(m for m in sys.modules if m.startswith("ipybox"))))
"""
    child = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    loaded = json.loads(child.stdout)
    assert "ipybox.kernel._tool_client" in loaded
    assert "ipybox.kernel._search" in loaded
    assert "ipybox._wire" in loaded
    assert [name for name in loaded if not name.startswith(ALLOWED_IPYBOX) and name != "ipybox"] == []


# --- The application side's subsystems (issue 33): faces, order, no cycles.
#
# The graph is read from the source's own imports (ast), at any depth and inside
# ``if TYPE_CHECKING:`` too: a type-only import still ties two modules together for a reader, and
# keeping those acyclic costs nothing. ``from X import Y`` is an arrow to the module ``X.Y`` when
# there is one, else to ``X``.

APP = SRC / "app"
SUBSYSTEMS = sorted(path.parent.name for path in APP.glob("*/__init__.py"))
# Shared leaves of the application side: one-module subsystems any part may import by path
# (``_tracing`` must stay unimported while tracing is off, so no face may import it eagerly).
SHARED_LEAVES = ("_settings", "_state", "_tracing")
# The subsystems from the lowest to the highest: an import only ever points to an earlier entry.
ORDER = (
    "_state",
    "_tracing",
    "_settings",
    "sandbox",
    "mcp_client",
    "approval",
    "apigen",
    "kernels",
    "tools",
    "pool",
    "executor",
)
_MAY_IMPORT = re.compile(r"May import \(within ``ipybox\.app``\):(.*?)(?:\n\n|\Z)", re.DOTALL)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of ipybox
    name: str | None  # the name taken from `target`, when it is not a module itself
    line: int


def _imports(module: str) -> list[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[tuple[str, str | None]]
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "ipybox"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "ipybox":
                continue
            targets = [
                (f"{base}.{alias.name}", None) if f"{base}.{alias.name}" in MODULES else (base, alias.name)
                for alias in node.names
            ]
        else:
            continue
        for target, name in targets:
            while target not in MODULES:
                target = target.rpartition(".")[0]
            found.append(Import(module, target, name, node.lineno))
    return found


IMPORTS = [found for module in MODULES for found in _imports(module)]


def _subsystem(module: str) -> str | None:
    """The subsystem of ``ipybox.app`` that `module` belongs to (a leaf is its own), else None."""
    parts = module.split(".")
    if parts[:2] != ["ipybox", "app"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in SUBSYSTEMS or parts[2] in SHARED_LEAVES else None


def _graph(key: Callable[[str], str | None]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for found in IMPORTS:
        source, target = key(found.importer), key(found.target)
        if source is not None and target is not None and source != target:
            graph.setdefault(source, set()).add(target)
            graph.setdefault(target, set())
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _depth(graph: dict[str, set[str]]) -> int:
    """The number of nodes on the longest path of an acyclic graph."""
    depths: dict[str, int] = {}

    def depth(node: str) -> int:
        if node not in depths:
            depths[node] = 1 + max((depth(child) for child in graph[node]), default=0)
        return depths[node]

    return max((depth(node) for node in graph), default=0)


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def test_the_graph_reader_sees_relative_type_only_and_function_level_imports() -> None:
    found = {(i.target, i.name) for i in _imports("ipybox.app.mcp_client._oauth")}
    assert ("ipybox.app.mcp_client._session", "MCPSession") in found
    assert ("ipybox.app._state", "oauth_dir") in found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _depth({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == 3


def test_app_keeps_at_most_ten_modules_outside_its_subsystems() -> None:
    loose = sorted(path.name for path in APP.glob("*.py") if path.name != "__init__.py")
    assert len(loose) <= 10, loose
    assert {name.removesuffix(".py") for name in loose} <= set(SHARED_LEAVES)
    assert set(ORDER) == set(SUBSYSTEMS) | set(SHARED_LEAVES)


def test_no_module_of_the_package_is_in_an_import_cycle() -> None:
    assert _cycles(_graph(lambda module: module)) == []


def test_the_subsystems_form_no_cycle_and_every_arrow_points_down() -> None:
    graph = _graph(_subsystem)
    assert _cycles(graph) == []
    upward = [(a, b) for a in graph for b in graph[a] if ORDER.index(b) > ORDER.index(a)]
    assert upward == [], f"arrows up the order {ORDER}: {upward}"
    assert _depth(graph) <= 8


def test_no_private_module_or_underscore_name_of_a_subsystem_is_imported_from_outside_it() -> None:
    crossings = []
    for found in IMPORTS:
        owner = _subsystem(found.target)
        if owner is None or owner in SHARED_LEAVES or _subsystem(found.importer) == owner:
            continue
        inner = found.target.split(".")[3:]
        if any(_private(part) for part in inner) or (found.name is not None and _private(found.name)):
            crossings.append(f"{found.importer}:{found.line} imports {found.target} {found.name or ''}")
    assert crossings == []


def test_the_mcp_server_and_the_integrations_reach_the_application_side_through_faces_only() -> None:
    faces = {f"ipybox.app.{name}" for name in SUBSYSTEMS} | {f"ipybox.app.{name}" for name in SHARED_LEAVES}
    reaching = [
        f"{found.importer}:{found.line} imports {found.target}"
        for found in IMPORTS
        if found.importer.startswith(("ipybox.mcp_server", "ipybox.integrations"))
        and found.target.startswith("ipybox.app")
        and found.target not in faces
    ]
    assert reaching == []


def test_each_face_says_what_it_owns_and_may_import_and_exports_what_others_use() -> None:
    for name in SUBSYSTEMS:
        face = f"ipybox.app.{name}"
        tree = ast.parse(MODULES[face].read_text())
        docstring = ast.get_docstring(tree) or ""
        declared = _MAY_IMPORT.search(docstring)
        assert declared is not None, (
            f"{face}'s docstring needs a 'May import (within ``ipybox.app``): ...' line"
        )
        allowed = set(re.findall(r"``([\w.]+)``", declared.group(1)))
        actual = _graph(_subsystem).get(name, set())
        assert actual == allowed, (
            f"{face} imports {sorted(actual)} but its docstring allows {sorted(allowed)}"
        )
        exported = set(importlib.import_module(face).__all__)
        used = {i.name for i in IMPORTS if i.target == face and i.name and _subsystem(i.importer) != name}
        assert used <= exported, f"{face} is used for {sorted(used - exported)}, missing from its __all__"


def test_the_contributors_page_draws_the_subsystems_as_the_faces_declare_them() -> None:
    page = (SRC.parents[1] / "docs" / "architecture-subsystems.md").read_text()
    rows = [
        (name, may_import)
        for name, may_import in re.findall(r"^\| `(\w+)/?` \| [^|]+ \| ([^|]+) \|$", page, re.MULTILINE)
        if name in ORDER
    ]
    assert [name for name, _ in rows] == list(reversed(ORDER)), (
        "the page lists the subsystems from the highest"
    )
    graph = _graph(_subsystem)
    for name, may_import in rows:
        drawn = set(re.findall(r"`(\w+)`", may_import))
        assert drawn == graph.get(name, set()), f"the page's row of {name} says it may import {sorted(drawn)}"


def _unit(module: str) -> str:
    """What owns `module`: its subsystem of ``ipybox.app``, else its top-level part of ipybox."""
    parts = module.split(".")
    return _subsystem(module) or (parts[1] if len(parts) > 1 else parts[0])


def _private_members(tree: ast.AST) -> set[str]:
    """The private methods and attributes that the classes of `tree` define."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {name for name in names if _private(name)}


def test_no_private_member_of_another_subsystems_objects_is_reached_but_the_known_ones() -> None:
    """A heuristic (no types): ``x._name`` where no class of the module's own subsystem defines
    ``_name`` and one of another subsystem does."""
    trees = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
    defined: dict[str, set[str]] = {}
    for module, tree in trees.items():
        defined.setdefault(_unit(module), set()).update(_private_members(tree))
    elsewhere = {name for names in defined.values() for name in names}
    reaches = set()
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr) or node.attr not in elsewhere:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super":
                continue
            if node.attr not in defined[_unit(module)]:
                reaches.add((module, ast.unparse(node)))
    assert sorted(reaches) == []
