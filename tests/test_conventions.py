"""Conventions the code and the tests keep, checked over their source.

- Tests use the public API. A test that must reach further (a private attribute, a private module
  or name, a private name patched by string) says why in a comment holding ``private:``, which
  covers its own line and those below it up to the next blank line; a module whose subject is
  private (the unit tests of an internal module) says why once, in a ``# private-ok:`` comment at
  column 0.
- Tests wait on events, not on time: a sleep of a fixed time that does not poll a condition under
  a ``while`` carries a comment holding ``sleep:`` saying why the time itself is what the test
  needs; and no test asserts on a duration (speed belongs to ``benchmarks/``).
- No module of the package is over 500 lines: a longer one is split by what it owns (the
  architecture page's "Where things live", docs/architecture.md, says what each file holds). Complexity is ruff's ``C901`` (10).
- In ``src/``, every broad handler (bare ``except:``, ``except Exception``/``BaseException``,
  ``suppress(Exception)``) says in a comment beside it why it must be broad, unless it is clean-up
  that ends in a bare ``raise`` (it swallows nothing); and no handler decides
  on an exception's message text (``"..." in str(exc)``, ``exc.args[0] == ...``): errors carry
  structure (a class, a code, fields) to decide on.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import ipybox

SRC = Path(ipybox.__file__).parent
TESTS = Path(__file__).parent
_MARK = re.compile(r"\bprivate:", re.IGNORECASE)
_SLEEP_MARK = re.compile(r"\bsleep:", re.IGNORECASE)
# Underscore names of the standard library that are public API.
_PUBLIC_UNDERSCORE = frozenset({"_exit", "_replace", "_asdict", "_fields", "_make"})
_CLOCKS = frozenset({"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"})
_BROAD = frozenset({"Exception", "BaseException"})
_LOCATED = (ast.stmt, ast.expr, ast.excepthandler)


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


def _private_reach(node: ast.AST) -> bool:
    """Whether `node` reaches a private name: an attribute, an import, or a name given by string."""
    if isinstance(node, ast.Attribute):
        return _private(node.attr) and not (
            isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        )
    if isinstance(node, ast.ImportFrom):
        return _dotted_private(node.module or "") or any(_private(alias.name) for alias in node.names)
    if isinstance(node, ast.Import):
        return any(_dotted_private(alias.name) for alias in node.names)
    if isinstance(node, ast.Call) and _called(node) in ("setattr", "getattr", "hasattr", "delattr"):
        texts = [
            arg.value for arg in node.args[:2] if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        ]
        return any(_dotted_private(text) for text in texts)
    return False


def _called(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def _findings(source: str) -> tuple[list[int], list[int], list[int]]:
    """The lines of test `source` with private reaches, fixed sleeps and duration asserts."""
    tree = ast.parse(source)
    polling: set[int] = set()  # the ids of the nodes inside a `while <condition>:` loop
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
    private = [node.lineno for node in ast.walk(tree) if isinstance(node, _LOCATED) and _private_reach(node)]
    sleeps = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and _called(node) == "sleep"
        and node.args
        and id(node) not in polling
        and not (isinstance(node.args[0], ast.Constant) and node.args[0].value == 0)
    ]
    timed = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert)
        and any(_is_clock(n) or (isinstance(n, ast.Name) and n.id in durations) for n in ast.walk(node.test))
    ]
    return sorted(private), sorted(sleeps), sorted(timed)


def _unexplained(path: Path, root: Path = TESTS.parent) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    comments = _comments(source)
    private, sleeps, timed = _findings(source)
    module_ok = any(
        text.startswith("# private-ok:") and lines[number - 1].startswith("#")
        for number, text in comments.items()
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
        "from ipybox.app.kernels._gateway import free_port\n"
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


def _broad(node: ast.AST) -> bool:
    if isinstance(node, ast.ExceptHandler):
        if isinstance(node.body[-1], ast.Raise) and node.body[-1].exc is None:
            return False  # clean-up that re-raises: nothing is swallowed, and it must run on cancellation too
        kinds = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
        return any(kind is None or (isinstance(kind, ast.Name) and kind.id in _BROAD) for kind in kinds)
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return name == "suppress" and any(isinstance(arg, ast.Name) and arg.id in _BROAD for arg in node.args)
    return False


def _explained(line: int, lines: list[str], comments: dict[int, str]) -> bool:
    """Whether a comment stands on `line`, or on the comment lines right above or below it."""
    return any(
        number in comments and (number == line or lines[number - 1].lstrip().startswith("#"))
        for number in (line - 1, line, line + 1)
    )


def _text_of(node: ast.AST, names: set[str]) -> bool:
    """Whether `node` is an exception's message text: ``str(exc)``, ``exc.args``, ``f"{exc}"``..."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call) and getattr(inner.func, "id", "") in ("str", "repr", "format"):
            if any(isinstance(arg, ast.Name) and arg.id in names for arg in inner.args):
                return True
        if isinstance(inner, ast.Attribute) and inner.attr in ("args", "message", "msg", "strerror"):
            if isinstance(inner.value, ast.Name) and inner.value.id in names:
                return True
        if (
            isinstance(inner, ast.FormattedValue)
            and isinstance(inner.value, ast.Name)
            and inner.value.id in names
        ):
            return True
    return False


def _decisions_on_text(tree: ast.AST) -> list[int]:
    found = []
    for handler in ast.walk(tree):
        if not (isinstance(handler, ast.ExceptHandler) and handler.name):
            continue
        names = {handler.name}
        for node in ast.walk(handler):
            if isinstance(node, ast.Compare) and any(
                _text_of(side, names) for side in [node.left, *node.comparators]
            ):
                found.append(node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                searches = node.func.attr in ("startswith", "endswith", "find", "index", "count")
                if searches and _text_of(node.func.value, names):
                    found.append(node.lineno)
                elif node.func.attr in ("search", "match", "fullmatch") and any(
                    _text_of(a, names) for a in node.args
                ):
                    found.append(node.lineno)
    return found


def _handler_findings(source: str) -> tuple[list[int], list[int]]:
    """The lines of `source` with unexplained broad handlers and with decisions on message text."""
    tree = ast.parse(source)
    lines = source.splitlines()
    comments = _comments(source)
    broad = sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, _LOCATED) and _broad(node) and not _explained(node.lineno, lines, comments)
    )
    return broad, sorted(_decisions_on_text(tree))


def test_the_checker_finds_unexplained_broad_handlers_and_decisions_on_message_text() -> None:
    source = (
        "try:\n"
        "    pass\n"
        "except Exception as exc:\n"
        "    if 'not found' in str(exc):\n"
        "        pass\n"
        "    if exc.args[0] == 2 or f'{exc}'.startswith('x'):\n"
        "        pass\n"
        "    print(f'failed: {exc}')\n"
        "except (OSError, BaseException):  # broad: a process entry point\n"
        "    sys.exit(1)\n"
        "except BaseException:\n"
        "    cleanup()\n"
        "    raise\n"
        "except BaseException as exc:\n"
        "    raise RuntimeError('x') from exc\n"
        "except:\n"
        "    # broad: a process entry point\n"
        "    pass\n"
        "with contextlib.suppress(Exception):\n"
        "    pass\n"
    )
    assert _handler_findings(source) == ([3, 14, 19], [4, 6, 6])


def test_every_broad_handler_says_why_and_none_decides_on_message_text() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        broad, decisions = _handler_findings(path.read_text())
        where = path.relative_to(SRC.parent)
        found += [f"{where}:{line}: broad handler without a comment saying why" for line in broad]
        found += [f"{where}:{line}: a decision on an exception's message text" for line in decisions]
    assert found == [], "\n".join(found)


_MAX_MODULE_LINES = 500


def test_no_module_of_the_package_is_over_500_lines() -> None:
    long = {
        str(path.relative_to(SRC)): lines
        for path in sorted(SRC.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > _MAX_MODULE_LINES
    }
    assert long == {}, (
        "split these by what they own, and give each part a row in docs/architecture.md's table"
    )
