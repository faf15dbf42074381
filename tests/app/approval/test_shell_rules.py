"""Shell rules prove or ask: the positive reader behind ``allow``, and programs that run others.

Each line here got through ``Rule("allow", program=[...])`` before (issue 38): the reader read a
different command than the shell runs. `test_shell_rules_bash.py` (beside this one) checks the reader
against bash and dash themselves; `test_shell_rule_attacks.py` runs the attacks in a sandboxed kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ipybox.app.approval._shellproof import proven_commands  # private: the positive reader on its own
from ipybox.app.sandbox._shell import ShellProgramError, ShellRunner  # private: the runner's program lookup
from ipybox.policy import Policy, Rule, load_policy

LS = Policy((Rule("allow", program=["ls", "echo", "cat", "git", "printf", "find", "env"]),), default="ask")
DENY_RM = Policy((Rule("deny", program="rm"), Rule("allow", program="*")), default="ask")


def decide(policy: Policy, cmd: str) -> str:
    return policy.decide_shell("shell", {"cmd": cmd}).decision


@pytest.mark.parametrize(
    ("command", "words", "files"),
    [
        ("ls -l | wc -l", [("ls", "-l"), ("wc", "-l")], []),
        ("ls 'a b' \"c d\" e\\ f > out.txt", [("ls", "a b", "c d", "e f")], ["out.txt"]),
        (
            "ls 2>/dev/null && cat <in || echo x >>log",
            [("ls",), ("cat",), ("echo", "x")],
            ["/dev/null", "in", "log"],
        ),
        ("ls 2>&1 | wc\n\nls -a\n", [("ls",), ("wc",), ("ls", "-a")], []),
        ("ls --color=never a,b:c@d%e+f", [("ls", "--color=never", "a,b:c@d%e+f")], []),
    ],
)
def test_the_positive_reader_returns_the_words_the_shell_runs(
    command: str, words: list[tuple[str, ...]], files: list[str]
) -> None:
    proven = proven_commands(command)
    assert proven is not None
    assert [c.words for c in proven] == words
    assert [f for c in proven for f in c.files] == files


@pytest.mark.parametrize(
    "command",
    [
        "PATH=./bin:/usr/bin:/bin ls",  # an assignment before the program
        "LD_PRELOAD=./x.so ls",
        "GIT_DIR=x ls",
        "PAGER=id ls",
        "a+=1 ls",
        "ls ${x:-\\} #$(touch p; id)}",  # a "}" the shell does not close on
        "ls $HOME",
        "ls `id`",
        'ls "$(id)"',
        'ls "r\\\nm"',  # backslash-newline inside double quotes
        "ls \\\nx",  # ... and outside
        "ls *",
        "ls {a,b}",
        "ls ~",
        "ls # comment",
        "./ls",
        "/bin/ls",
        "bin/ls",
        "ls & id",
        "ls |& cat",
        "ls &> out",
        "ls >& out",
        "ls 10>out",
        "cat <<EOF\nx\nEOF",
        "(ls)",
        "{ ls; }",
        "if ls; then ls; fi",
        "! ls",
        "ls ;; ls",
        "ls 'unclosed",
        "ls $'\\x41'",
        "ls\x00",
        "ls > /dev/tcp/127.0.0.1/80",  # bash opens a connection, not a file
        "",
    ],
)
def test_anything_outside_the_grammar_is_not_proven_and_so_is_asked_about(command: str) -> None:
    assert proven_commands(command) is None
    assert decide(LS, command) == "ask"


@pytest.mark.parametrize(
    "command",
    [
        "git -c alias.x='!touch p' x",  # the README's old `allow git` example
        "git status",  # a repository's config (core.fsmonitor, hooks) runs programs
        "env id",
        "find . -exec id ;",
        "printf -v 'a[$(id)]' x",  # a builtin that evaluates an array subscript
        "read 'a[$(id)]'",
        "declare 'a[$(id)]=1'",
        "let 'a[$(id)]'",
        "test -v 'a[$(id)]'",
    ],
)
def test_a_program_that_runs_others_allowed_by_name_alone_is_asked_about(command: str) -> None:
    policy = Policy(
        (Rule("allow", program=["git", "env", "find", "printf", "read", "declare", "let", "test"]),),
        default="ask",
    )
    assert decide(policy, command) == "ask"


def test_a_rule_that_names_the_arguments_allows_exactly_those() -> None:
    policy = Policy((Rule("allow", program=["git status", "git log *", "find . -name *"]),), default="ask")
    assert decide(policy, "git status") == "allow"
    assert decide(policy, "git log") == "allow"
    assert decide(policy, "git log --oneline -n 3") == "allow"
    assert decide(policy, "find . -name x.py") == "allow"
    assert decide(policy, "git status -c x") == "ask"
    assert decide(policy, "git -c alias.x='!id' x") == "ask"
    # A word holding a space could pose as two words: it matches no pattern with arguments.
    assert decide(policy, "git 'status'") == "allow"
    assert decide(policy, "git 'log --output=x'") == "ask"
    # find without -exec and the like is a plain program.
    assert decide(LS, "find . -name x") == "allow"
    assert decide(LS, "find . -delete") == "ask"


def test_deny_rules_still_deny_what_the_best_effort_reader_sees() -> None:
    assert decide(DENY_RM, "ls; rm -rf x") == "deny"
    assert decide(DENY_RM, 'X=1 "r\\\nm" -rf x') == "deny"  # "r\<newline>m" is rm
    assert decide(DENY_RM, "a+=1 rm x") == "deny"
    assert decide(DENY_RM, "echo $(rm x)") == "deny"
    # bash runs the substitution in `>&2'$(rm x)'`: the best-effort reader does not claim to read it.
    assert decide(DENY_RM, "x>&2'$(rm x)'") == "ask"
    # What even the best-effort reader cannot read is asked about, never allowed.
    assert decide(DENY_RM, "ls ${x:-\\} #$(rm p; id)}") == "ask"


def test_a_plain_allowed_line_is_still_allowed() -> None:
    assert decide(LS, "ls -la /tmp | cat > listing.txt") == "allow"
    assert decide(LS, "echo hi 2>&1 && ls") == "allow"
    assert decide(LS, "ls && id") == "ask"


def test_a_session_allowance_covers_only_proven_lines_and_never_a_program_that_runs_others() -> None:
    policy = Policy(default="ask")
    assert policy.decide_shell("shell", {"cmd": "ls -l"}, {"ls"}).decision == "allow"
    assert policy.decide_shell("shell", {"cmd": "PATH=. ls"}, {"ls"}).decision == "ask"
    assert policy.decide_shell("shell", {"cmd": "git -c a=b x"}, {"git"}).decision == "ask"


def test_a_policy_file_takes_argument_globs(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[[rule]]\ndecision = "allow"\nprogram = ["git status", "git log *"]\n')
    policy = load_policy(path)
    assert decide(policy, "git log -n 1") == "allow"
    assert decide(policy, "git -c core.pager=id log") == "ask"


def _runner(tmp_path: Path) -> ShellRunner:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "ls"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    return ShellRunner(
        srt="srt",
        settings_file=tmp_path / "s.json",
        tmp_dir=tmp_path / "tmp",
        start_dir=tmp_path,
        env={},
        path=str(bin_dir),
    )


def test_the_runner_starts_programs_by_absolute_path_from_its_own_path_only(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    bin_dir = tmp_path / "bin"
    assert runner.resolve(["ls", "-l"], None) == ([str(bin_dir / "ls"), "-l"], None)
    assert runner.resolve([str(bin_dir / "ls")], None)[0] == [str(bin_dir / "ls")]
    for planted in ("./bash", "bin/bash", "/tmp/bash", f"{bin_dir}/../bin2/bash"):
        with pytest.raises(ShellProgramError, match="given by a path"):
            runner.resolve([planted], b"ls\n")
    with pytest.raises(ShellProgramError, match="not in any of"):
        runner.resolve(["nonexistent-program"], None)


def test_a_shell_reads_its_cell_whole_before_running_it(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    bash = str(tmp_path / "bin" / "bash")
    assert runner.resolve(["bash"], b"head -c 4\nls\n") == ([bash, "-c", 'eval "$(cat)"'], b"head -c 4\nls\n")
    # With arguments the shell is a program like any other (and the rules ask about it).
    assert runner.resolve(["bash", "-x"], b"ls\n") == ([bash, "-x"], b"ls\n")
