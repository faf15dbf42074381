"""The package layout: what runs inside the kernel imports only the standard library.

Every fresh kernel imports ``ipybox.kernel`` (through generated tool modules and the kernel
extension), next to the agent's code: a third-party import there would cost every kernel start,
could fail in a kernel whose Python lacks the package, and would widen what hostile code reaches.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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
