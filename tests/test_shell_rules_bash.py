"""The shell rules' reader is never more permissive than bash and dash: checked against the shells.

Thousands of generated and mutated command lines (hypothesis, derandomized, so every run checks the
same ones) are decided with ``allow`` for a few programs; each line decided ``allow`` is then run
by bash and by dash with an empty environment whose ``PATH`` holds only recording stubs (every
program the lines name, allowed or not). The property: only allowed programs ran, each with words
the reader returned, and no file appeared but those the reader's plain redirections name.
Running as root, the shells run as ``nobody``, so a reader mistake cannot write outside.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipybox.app._shellproof import proven_commands  # private: the reader the property is about
from ipybox.policy import Policy, Rule

pytestmark = pytest.mark.slow

ALLOWED = ("ls", "cat", "wc", "grep", "head")
# Stubs that must never run for an allowed line (plus every allowed one).
OTHERS = ("id", "touch", "rm", "sh", "bash", "env", "x", "git", "true", "p", "bin", "xargs", "a", "b")
POLICY = Policy((Rule("allow", program=list(ALLOWED)),), default="ask")
SHELLS = [path for name in ("bash", "dash") if (path := shutil.which(name))]
NOBODY = 65534
SEP, END = "\x1f", "\x1e"

WORDS = [
    "ls",
    "cat",
    "wc",
    "grep",
    "head",
    "id",
    "touch",
    "rm",
    "sh",
    "env",
    "-l",
    "x",
    "a",
    "p",
    "bin",
    "out",
]
SPECIAL = [
    " ",
    " ",
    " ",
    "\t",
    "\n",
    ";",
    "|",
    "||",
    "&&",
    "&",
    ">",
    ">>",
    "<",
    "2>",
    "2>&1",
    ">&2",
    ">&",
    "&>",
    "<<",
    "(",
    ")",
    "{",
    "}",
    "$",
    "$x",
    "${x}",
    "${x:-\\}",
    "$(id)",
    "`id`",
    "#",
    "\\",
    "\\\n",
    "'",
    '"',
    "*",
    "?",
    "[",
    "]",
    "~",
    "=",
    "+=",
    "PATH=.",
    "PATH=bin:",
    "!",
    "%",
    "^",
    ",",
    ":",
    "@",
    ".",
    "/",
    "-",
    "$'\\x69d'",
    "'a b'",
    '"a b"',
    '"$x"',
    "'$(id)'",
    "a=b",
    "10>",
    "3>",
    "<&0",
    ">|",
    "<>",
    "\\'",
    '\\"',
]
SEEDS = [
    "ls -l | wc -l > out",
    "cat a 2>&1 | grep x >> out",
    "ls 'a b' \"c d\"; head -n 1 a",
    "ls && cat a || wc",
    "ls\nls -a\n",
    "grep -e x a < a > out",
]


@pytest.fixture(scope="module")
def sandbox() -> Iterator[tuple[Path, Path, Path]]:
    if not SHELLS:
        pytest.skip("neither bash nor dash is installed")
    # Not under pytest's folder: `nobody` could not reach the stubs through its 0700 parent.
    root = Path(tempfile.mkdtemp(prefix="ipybox-shell-property-"))
    stubs, work, log = root / "stubs", root / "work", root / "log"
    stubs.mkdir()
    work.mkdir()
    log.touch()
    for name in (*ALLOWED, *OTHERS):
        stub = stubs / name
        # Built-ins of /bin/sh only: PATH holds nothing but the stubs.
        stub.write_text(
            f"#!/bin/sh\nprintf '%s{SEP}' \"${{0##*/}}\" \"$@\" >> {log}\nprintf '{END}' >> {log}\n"
        )
        stub.chmod(0o755)
    if os.geteuid() == 0:
        for path in (root, work, log):
            os.chown(path, NOBODY, NOBODY)
        root.chmod(0o755)
    yield stubs, work, log
    shutil.rmtree(root, ignore_errors=True)


def _run(
    shell: str, line: str, sandbox: tuple[Path, Path, Path]
) -> tuple[list[tuple[str, ...]], set[str], str]:
    stubs, work, log = sandbox
    log.write_text("")
    for entry in work.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    root = os.geteuid() == 0
    done = subprocess.run(
        [shell, "-c", line],
        env={"PATH": str(stubs)},
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        check=False,
        user=NOBODY if root else None,
        group=NOBODY if root else None,
        extra_groups=[] if root else None,
    )
    ran = [tuple(record.split(SEP)[:-1]) for record in log.read_text().split(END) if record]
    made = {str(path.relative_to(work)) for path in work.rglob("*")}
    return ran, made, done.stderr.decode(errors="replace")


def _check(line: str, sandbox: tuple[Path, Path, Path]) -> None:
    if POLICY.decide_shell("shell", {"cmd": line}).decision != "allow":
        return
    proven = proven_commands(line)
    assert proven is not None, line
    files = {name for command in proven for name in command.files}
    if any("/" in name or name.startswith(".") for name in files - {"/dev/null"}):
        return  # a plain file elsewhere: not run here (it would be written outside the test's folder)
    expected = Counter(command.words for command in proven)
    for shell in SHELLS:
        ran, made, stderr = _run(shell, line, sandbox)
        assert {words[0] for words in ran} <= set(ALLOWED), (shell, line, ran)
        assert Counter(ran) <= expected, (shell, line, ran, expected)
        assert made <= files, (shell, line, made, files)
        if not stderr and "||" not in line:
            # Nothing failed and nothing was skipped: the shell ran exactly the reader's commands.
            assert Counter(ran) == expected, (shell, line, ran, expected, stderr)


_tokens = st.lists(st.sampled_from(WORDS + SPECIAL), min_size=1, max_size=12)


@settings(max_examples=2500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(_tokens.map("".join), _tokens.map(" ".join)))
def test_generated_lines_run_no_more_than_the_reader_allows(
    sandbox: tuple[Path, Path, Path], line: str
) -> None:
    _check(line, sandbox)


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    line = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(line)))
        kind = draw(st.sampled_from(["insert", "replace", "delete"]))
        piece = draw(st.sampled_from(SPECIAL + list("$`\\'\"#{}()*?[]~=!&|;<>\n ")))
        if kind == "insert":
            line = line[:at] + piece + line[at:]
        elif kind == "replace":
            line = line[:at] + piece + line[at + 1 :]
        else:
            line = line[:at] + line[at + 1 :]
    return line


@settings(max_examples=2500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_mutated())
def test_mutated_allowed_lines_run_no_more_than_the_reader_allows(
    sandbox: tuple[Path, Path, Path], line: str
) -> None:
    _check(line, sandbox)


def test_the_property_runs_allowed_lines_at_all(sandbox: tuple[Path, Path, Path]) -> None:
    # The check is worth something only if allowed lines do run the stubs: a seed line, by hand.
    for shell in SHELLS:
        ran, made, _ = _run(shell, "ls -l | wc -l > out", sandbox)
        assert sorted(ran) == [("ls", "-l"), ("wc", "-l")]
        assert made == {"out"}
