"""The shell rules' reader is never more permissive than bash and dash: checked against the shells.

Four thousand command lines (hypothesis, derandomized, so every run checks the same ones): token
soup, lines near the grammar (allowed programs with words that are mostly plain), and allowed lines
mutated with shell metacharacters. Each is decided with ``allow`` for a few programs (about one in
eight is allowed); each line decided ``allow`` is then run
by bash and by dash with an empty environment whose ``PATH`` holds only recording stubs (every
program the lines name, allowed or not). The property: only allowed programs ran, each with words
the reader returned, and no file appeared but those the reader's plain redirections name.
Running as root, the shells run as ``nobody``, so a reader mistake cannot write outside.

The deny rules' best-effort reader gets a property of its own: on every line it claims to read,
each program the shells run is one it listed (so `deny rm` sees a disguised rm).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ipybox.app.approval._shellparse import programs as shell_programs  # private: the deny rules' reader
from ipybox.app.approval._shellproof import proven_commands  # private: the reader the property is about
from ipybox.policy import Policy, Rule

# A bounded number of cases, each a few process starts: minutes only on a machine loaded many times over.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ALLOWED = ("ls", "cat", "wc", "grep", "head")
# Stubs that must never run for an allowed line (plus every allowed one).
OTHERS = ("id", "touch", "rm", "sh", "bash", "env", "x", "git", "true", "p", "bin", "xargs", "a", "b")
POLICY = Policy((Rule("allow", program=list(ALLOWED)),), default="ask")
SHELLS = [path for name in ("bash", "dash") if (path := shutil.which(name))]
NOBODY = 65534
SEP = "\x1f"

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
# Pieces that leave (or test the edges of) the grammar: expansions, operators, quotes, escapes.
SPECIAL = [
    " ", " ", " ", "\t", "\n", ";", "|", "||", "&&", "&", ">", ">>", "<", "2>", "2>&1", ">&2", ">&", "&>",
    "<<", "(", ")", "{", "}", "$", "$x", "${x}", "${x:-\\}", "$(id)", "`id`", "#", "\\", "\\\n", "'", '"',
    "*", "?", "[", "]", "~", "=", "+=", "PATH=.", "PATH=bin:", "!", "%", "^", ",", ":", "@", ".", "/", "-",
    "$'\\x69d'", "'a b'", '"a b"', '"$x"', "'$(id)'", "a=b", "10>", "3>", "<&0", ">|", "<>", "\\'", '\\"',
]  # fmt: skip
SEEDS = [
    "ls -l | wc -l > out",
    "cat a 2>&1 | grep x >> out",
    "ls 'a b' \"c d\"; head -n 1 a",
    "ls && cat a || wc",
    "ls\nls -a\n",
    "grep -e x a < a > out",
]
_ODD = "$`\\'\"#{}()*?[]~=!&|;<>\n\t %^,:@./-+"


@pytest.fixture(scope="module")
def sandbox() -> Iterator[tuple[Path, Path, Path]]:
    if not SHELLS:
        pytest.skip("neither bash nor dash is installed")
    # Not under pytest's folder: `nobody` could not reach the stubs through its 0700 parent.
    root = Path(tempfile.mkdtemp(prefix="ipybox-shell-property-"))
    stubs, work, log = root / "stubs", root / "work", root / "log"
    for folder in (stubs, work, log):
        folder.mkdir()
    for name in (*ALLOWED, *OTHERS):
        stub = stubs / name
        # Built-ins of /bin/sh only (PATH holds nothing but the stubs); a file per process, as the
        # commands of a pipeline run at once.
        stub.write_text(f'#!/bin/sh\nprintf \'%s{SEP}\' "${{0##*/}}" "$@" > {log}/$$\n')
        stub.chmod(0o755)
    if os.geteuid() == 0:
        for path in (root, work, log):
            os.chown(path, NOBODY, NOBODY)
        root.chmod(0o755)
    yield stubs, work, log
    shutil.rmtree(root, ignore_errors=True)


def _run(
    shell: str,
    line: str,
    sandbox: tuple[Path, Path, Path],
    files: Collection[str] = (),
) -> tuple[list[tuple[str, ...]], set[str], str | None]:
    """What `line` ran in `shell` and the files then in the folder; its stderr, ``None`` if it failed."""
    stubs, work, log = sandbox
    for entry in [*work.iterdir(), *log.iterdir()]:
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    root = os.geteuid() == 0
    for name in set(files) - {"/dev/null"}:  # so that `< name` opens
        (work / name).touch()
        if root:
            os.chown(work / name, NOBODY, NOBODY)
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
    ran = [tuple(record.read_text().split(SEP)[:-1]) for record in log.iterdir()]
    made = {str(path.relative_to(work)) for path in work.rglob("*")}
    return ran, made, done.stderr.decode(errors="replace") if done.returncode == 0 else None


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
        ran, made, stderr = _run(shell, line, sandbox, files)
        assert {words[0] for words in ran} <= set(ALLOWED), (shell, line, ran)
        assert Counter(ran) <= expected, (shell, line, ran, expected)
        assert made <= files, (shell, line, made, files)
        if stderr == "" and "||" not in line:
            # Nothing failed and nothing was skipped: the shell ran exactly the reader's commands.
            assert Counter(ran) == expected, (shell, line, ran, expected, stderr)


_tokens = st.lists(st.sampled_from(WORDS + SPECIAL), min_size=1, max_size=12)


@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(_tokens.map("".join), _tokens.map(" ".join)))
def test_generated_lines_run_no_more_than_the_reader_allows(
    sandbox: tuple[Path, Path, Path], line: str
) -> None:
    _check(line, sandbox)


_text = st.text(alphabet=st.sampled_from(_ODD + "abx"), max_size=6)
_word = st.lists(
    st.one_of(
        st.sampled_from(WORDS),
        _text.map(lambda t: f"'{t}'"),
        _text.map(lambda t: f'"{t}"'),
        st.sampled_from(_ODD).map(lambda c: "\\" + c),
        st.sampled_from(SPECIAL),
    ),
    min_size=1,
    max_size=3,
).map("".join)
_redirection = st.tuples(st.sampled_from(["", "2", "1", "0"]), st.sampled_from([">", ">>", "<"]), _word).map(
    lambda r: f" {r[0]}{r[1]} {r[2]}"
) | st.sampled_from([" 2>&1", " >&2", " 2>/dev/null"])


@st.composite
def _grammar(draw: st.DrawFn) -> str:
    """Lines near the grammar: allowed programs with words that are mostly, not always, plain."""
    commands = []
    for _ in range(draw(st.integers(1, 3))):
        program = draw(st.sampled_from(ALLOWED) | _word)
        args = draw(st.lists(_word, max_size=3))
        redirections = draw(st.lists(_redirection, max_size=2))
        commands.append(" ".join([program, *args]) + "".join(redirections))
    separators = draw(
        st.lists(st.sampled_from([" | ", "; ", " && ", "\n", "|", ";"]), min_size=len(commands))
    )
    return "".join(c + s for c, s in zip(commands, separators, strict=False)).rstrip("|;& ")


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_grammar())
def test_lines_near_the_grammar_run_no_more_than_the_reader_allows(
    sandbox: tuple[Path, Path, Path], line: str
) -> None:
    _check(line, sandbox)


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    line = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(line)))
        kind = draw(st.sampled_from(["insert", "replace", "delete"]))
        piece = draw(st.sampled_from(SPECIAL + list(_ODD)))
        if kind == "insert":
            line = line[:at] + piece + line[at:]
        elif kind == "replace":
            line = line[:at] + piece + line[at + 1 :]
        else:
            line = line[:at] + line[at + 1 :]
    return line


@settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
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


@settings(max_examples=1200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(_tokens.map("".join), _grammar(), _mutated()))
# Holes found so far: each ran a program the reader did not list.
@example("x>&2'$(id)'")
@example('"r\\\nm" x')
@example("a+=1 rm x")
@example("ls ${x:-\\} #$(touch p; id)}")
def test_a_program_the_deny_reader_does_not_see_never_runs(
    sandbox: tuple[Path, Path, Path], line: str
) -> None:
    # Deny rules read further than allow rules, with the best-effort reader: whatever it claims to
    # read in full must hold every program the shell runs, or `deny rm` would miss a disguised rm.
    # These lines are outside the proven grammar: run only as `nobody`, who can write almost nowhere.
    if os.geteuid() != 0:
        pytest.skip("runs lines outside the proven grammar only as root, dropping to nobody")
    seen = shell_programs(line)
    if seen is None:
        return
    for shell in SHELLS:
        ran, _, _ = _run(shell, line, sandbox)
        assert {words[0] for words in ran} <= set(seen), (shell, line, ran, seen)
