"""The package layout: what runs inside the kernel imports only the standard library.

Every fresh kernel imports ``ipybox.kernel`` (through generated tool modules and the kernel
extension), next to the agent's code: a third-party import there would cost every kernel start,
could fail in a kernel whose Python lacks the package, and would widen what hostile code reaches.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
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


# Tests use the public API. A test that must reach further (a private attribute, a private module
# or name, a private name patched by string) says why in a comment holding `private:`, which covers
# its own line and those below it up to the next blank line; a module whose subject is private
# (the unit tests of an internal module) says why once, in a `# private-ok:` comment at column 0.
# Likewise a sleep of a fixed time that does not poll a condition under a `while` carries a comment
# holding `sleep:` that says why the time itself is what the test needs; and no test asserts on
# durations (speed belongs to benchmarks/).
TESTS = Path(__file__).parent
_MARK = re.compile(r"\bprivate:", re.IGNORECASE)
_SLEEP_MARK = re.compile(r"\bsleep:", re.IGNORECASE)
# Underscore names of the standard library that are public API.
_PUBLIC_UNDERSCORE = frozenset({"_exit", "_replace", "_asdict", "_fields", "_make"})
_CLOCKS = frozenset({"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in _PUBLIC_UNDERSCORE


def _dotted_private(name: str) -> bool:
    return any(_private(part) for part in name.split("."))


def _comments(source: str) -> dict[int, str]:
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    return comments


def _covered(line: int, lines: list[str], comments: dict[int, str], mark: re.Pattern[str]) -> bool:
    """Whether a comment matching `mark` stands on `line` or above it with no blank line between."""
    for number in range(line, 0, -1):
        if mark.search(comments.get(number, "")):
            return True
        if not lines[number - 1].strip():
            return False
    return False


def _is_clock(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _CLOCKS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in ("time", "loop")
    )


def _findings(source: str) -> tuple[list[int], list[int], list[int]]:
    """The lines of `source` with private reaches, fixed sleeps and duration asserts."""
    tree = ast.parse(source)
    private: list[int] = []
    sleeps: list[int] = []
    timed: list[int] = []
    polling: set[int] = set()  # the ids of sleep calls inside a `while <condition>:` loop
    durations: set[str] = set()  # names bound to a difference of clock readings
    for node in ast.walk(tree):
        if isinstance(node, ast.While) and not (isinstance(node.test, ast.Constant) and node.test.value):
            polling.update(id(inner) for inner in ast.walk(node))
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.BinOp)
            and isinstance(node.value.op, ast.Sub)
        ):
            if any(_is_clock(inner) for inner in ast.walk(node.value)):
                durations.update(target.id for target in node.targets if isinstance(target, ast.Name))
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                private.append(line)
        elif isinstance(node, ast.ImportFrom):
            if _dotted_private(node.module or "") or any(_private(alias.name) for alias in node.names):
                private.append(line)
        elif isinstance(node, ast.Import):
            if any(_dotted_private(alias.name) for alias in node.names):
                private.append(line)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            strings = [
                arg.value
                for arg in node.args[:2]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            ]
            if name in ("setattr", "getattr", "hasattr", "delattr") and any(
                _dotted_private(s) for s in strings
            ):
                private.append(line)
            if name == "sleep" and node.args and id(node) not in polling:
                if not (isinstance(node.args[0], ast.Constant) and node.args[0].value == 0):
                    sleeps.append(line)
        elif isinstance(node, ast.Assert):
            inner = list(ast.walk(node.test))
            if any(_is_clock(n) for n in inner) or any(
                isinstance(n, ast.Name) and n.id in durations for n in inner
            ):
                timed.append(line)
    return sorted(private), sorted(sleeps), sorted(timed)


def _unexplained(path: Path, root: Path = TESTS.parent) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    comments = _comments(source)
    private, sleeps, timed = _findings(source)
    module_ok = any(
        text.startswith("# private-ok:")
        for number, text in comments.items()
        if lines[number - 1].startswith("#")
    )
    where = path.relative_to(root)
    found = []
    if not module_ok:
        found += [
            f"{where}:{line}: private reach" for line in private if not _covered(line, lines, comments, _MARK)
        ]
    found += [
        f"{where}:{line}: fixed sleep" for line in sleeps if not _covered(line, lines, comments, _SLEEP_MARK)
    ]
    found += [f"{where}:{line}: assert on a duration" for line in timed]
    return sorted(set(found))


def test_the_checker_finds_private_reaches_fixed_sleeps_and_duration_asserts(tmp_path: Path) -> None:
    source = (
        "import time\n"
        "from ipybox.app._gateway import free_port\n"
        "from ipybox.kernel import _tool_client\n"
        "def test(executor, monkeypatch):\n"
        "    start = time.monotonic()\n"
        "    executor._lock.locked()\n"
        "    monkeypatch.setattr(executor, '_lock', None)\n"
        "    time.sleep(0.5)\n"
        "    elapsed = time.monotonic() - start\n"
        "    assert elapsed < 1\n"
        "    self._own = 1\n"
        "    while not executor.done:\n"
        "        time.sleep(0.01)\n"
        "\n"
        "    # private: the lock is the only sign the execution began\n"
        "    executor._lock.locked()\n"
        "    time.sleep(5)  # sleep: the tool under test takes time\n"
    )
    assert _findings(source) == ([2, 3, 6, 7, 16], [8, 17], [10])
    path = tmp_path / "t.py"
    path.write_text(source)
    assert set(_unexplained(path, tmp_path)) == {
        "t.py:2: private reach",
        "t.py:3: private reach",
        "t.py:6: private reach",
        "t.py:7: private reach",
        "t.py:8: fixed sleep",
        "t.py:10: assert on a duration",
    }
    path.write_text("# private-ok: the unit tests of an internal module\n" + source)
    assert set(_unexplained(path, tmp_path)) == {"t.py:9: fixed sleep", "t.py:11: assert on a duration"}


def test_every_reach_past_the_public_api_and_every_fixed_sleep_in_the_tests_says_why() -> None:
    found = [entry for path in sorted(TESTS.rglob("*.py")) for entry in _unexplained(path)]
    assert found == [], "\n".join(
        ["Explain each in a `# private:` / `# sleep:` comment, or use the public API instead:", *found]
    )
