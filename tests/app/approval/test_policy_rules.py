"""Policy rules on their own: matching, shell command reading, and the policy file's schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp.types import ToolAnnotations

from ipybox.app.approval._shellparse import programs  # private: the shell reader behind the rules, on its own
from ipybox.errors import PolicyError
from ipybox.policy import Policy, Rule, load_policy

READ_ONLY = ToolAnnotations(read_only_hint=True)
DESTRUCTIVE = ToolAnnotations(destructive_hint=True)
HARMLESS = ToolAnnotations(read_only_hint=False, destructive_hint=False)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("ls -l | wc -l", ["ls", "wc"]),
        ("ls && rm -rf x", ["ls", "rm"]),
        ("ls || rm -rf x", ["ls", "rm"]),
        ("ls; rm x\nrm y &", ["ls", "rm", "rm"]),
        ("(cd a; rm b) || true", ["cd", "rm", "true"]),
        ("{ ls; rm x; }", ["ls", "rm"]),
        ("echo $(rm -rf /)", ["rm", "echo"]),
        ('echo "x $(curl evil) y"', ["curl", "echo"]),
        ("cat <(curl evil)", ["curl", "cat"]),
        ("X=$(id) ls", ["id", "ls"]),
        ("ls 2>/dev/null >out", ["ls"]),
        ("r''m -rf x", ["rm"]),
        ("exec rm x", ["rm"]),
        ("echo 'a; rm b'", ["echo"]),
        ("ls # ; rm x", ["ls"]),
    ],
)
def test_every_command_of_a_line_is_found_pipelines_chains_subshells_and_substitutions(
    command: str, expected: list[str]
) -> None:
    assert programs(command) == expected


@pytest.mark.parametrize(
    "command",
    [
        "echo `rm x`",  # backquotes
        "$PROG x",  # a program named by a variable
        "$(echo rm) x",  # ... or by a substitution
        "/bin/r? x",  # ... or by a pattern
        "{rm,-rf,x}",  # brace expansion
        "$'\\x72m' x",  # ANSI-C quoting
        "cat <<EOF\nx\nEOF",  # here-document
        "if true; then rm x; fi",  # control keywords
        "eval 'rm x'",
        ". ./script",
        "echo ${x:-$(rm y)}",
        "echo 'unclosed",
        "ls)",
        "((x = 1))",
        "command -p rm",
    ],
)
def test_a_line_that_cannot_be_read_safely_gives_no_programs(command: str) -> None:
    assert programs(command) is None


def test_the_first_matching_rule_decides_and_the_default_comes_last() -> None:
    policy = Policy(
        rules=(Rule("deny", tool="delete_*"), Rule("allow", server="files"), Rule("ask", tool="*")),
        default="deny",
    )
    assert policy.decide("files", "delete_all").decision == "deny"
    assert policy.decide("files", "read").decision == "allow"
    assert policy.decide("other", "read").by == "rule 3"
    assert Policy(default="deny").decide("x", "y").by == "default"


def test_annotations_count_only_for_trusted_servers_others_get_the_cautious_defaults() -> None:
    rules = (
        Rule("deny", annotations={"destructiveHint": True}),
        Rule("allow", annotations={"readOnlyHint": True}),
    )
    trusted = Policy(rules, trusted_servers={"files"})
    assert trusted.decide("files", "read", READ_ONLY).decision == "allow"
    assert trusted.decide("files", "rm", DESTRUCTIVE).decision == "deny"
    assert trusted.decide("files", "put", HARMLESS).decision == "ask"
    # An untrusted server claiming read-only is not believed; an untrusted tool counts as destructive.
    assert trusted.decide("web", "read", READ_ONLY).decision == "deny"
    assert Policy(rules[1:]).decide("web", "read", READ_ONLY).decision == "ask"
    # A trusted tool that says nothing is what the MCP spec says it is: destructive.
    assert trusted.decide("files", "x", None).decision == "deny"


def test_a_shell_allow_rule_does_not_let_a_chained_command_through() -> None:
    policy = Policy((Rule("allow", program=["ls", "echo"]),), default="ask")
    assert policy.decide_shell("shell", {"cmd": "ls -l; echo hi"}).decision == "allow"
    assert policy.decide_shell("shell", {"cmd": "ls && rm -rf x"}).decision == "ask"
    assert policy.decide_shell("shell", {"cmd": "ls | sh"}).decision == "ask"
    assert policy.decide_shell("shell", {"cmd": "echo $(rm -rf x)"}).decision == "ask"
    assert policy.decide_shell("shell", {"cmd": "echo `rm -rf x`"}).decision == "ask"
    # A program with a folder is not the allowed one; a denied one is denied wherever it is.
    assert policy.decide_shell("shell", {"cmd": "./ls"}).decision == "ask"
    deny = Policy((Rule("deny", program="rm"), Rule("allow", program="*")), default="ask")
    assert deny.decide_shell("shell", {"cmd": "ls; /bin/rm -rf x"}).decision == "deny"
    assert deny.decide_shell("shell", {"cmd": "echo `x`"}).decision == "ask"


def test_a_shell_cell_is_read_as_a_script_for_shells_and_as_its_program_otherwise() -> None:
    policy = Policy((Rule("allow", program=["ls", "python3"]),))
    assert policy.decide_shell("shell_magic", {"magic": "bash", "cmd": "ls\nls -l\n"}).decision == "allow"
    assert policy.decide_shell("shell_magic", {"magic": "bash", "cmd": "ls\nrm x\n"}).decision == "ask"
    assert (
        policy.decide_shell("shell_magic", {"magic": "bash", "cmd": "ls", "args": ["-c", "rm"]}).decision
        == "ask"
    )
    # python3 runs the cell's code: allowed by name alone, it is still asked about.
    assert policy.decide_shell("shell_magic", {"magic": "python3", "cmd": "import os"}).decision == "ask"
    named = Policy((Rule("allow", program=["python3 *"]),))
    assert named.decide_shell("shell_magic", {"magic": "python3", "cmd": "import os"}).decision == "allow"
    # A script program given by a path is never the allowed one.
    assert named.decide_shell("shell_magic", {"magic": "./python3", "cmd": "import os"}).decision == "ask"
    assert policy.decide_shell("shell_magic", {"magic": "./bash", "cmd": "ls\n"}).decision == "ask"


def test_a_rule_without_programs_still_applies_to_a_line_that_cannot_be_read() -> None:
    policy = Policy((Rule("deny", server="ipybox"),), default="allow")
    assert policy.decide_shell("shell", {"cmd": "echo `id`"}).decision == "deny"
    assert Policy(default="allow").decide_shell("shell", {"cmd": "echo `id`"}).decision == "ask"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Rule("alow"), "not 'alow'"),  # type: ignore[arg-type]
        (lambda: Rule("allow", tool="read_[abc"), "unclosed '['"),
        (lambda: Rule("allow", tool=""), "non-empty glob"),
        (lambda: Rule("allow", annotations={"readonlyHint": True}), "Unknown annotation 'readonlyHint'"),
        (lambda: Rule("allow", annotations={"readOnlyHint": "yes"}), "true or false"),  # type: ignore[dict-item]
        (lambda: Rule("allow", server="github", program="ls"), "matches only shell commands"),
        (lambda: Policy(default="allow all"), "default decision"),  # type: ignore[arg-type]
        (lambda: Policy(("allow",)), "give Rule objects"),  # type: ignore[arg-type]
    ],
)
def test_malformed_rules_are_refused_never_read_as_something_wider(make: object, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("[", r"\[")):
        make()  # type: ignore[operator]


GOOD = """\
default = "ask"
trusted_servers = ["files"]

[[rule]]
decision = "deny"
tool = "delete_*"

[[rule]]
decision = "allow"
annotations = { readOnlyHint = true }

[[rule]]
decision = "allow"
program = ["ls", "cat"]
"""


def test_a_policy_file_gives_the_same_policy_as_the_objects(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(GOOD)
    assert load_policy(path) == Policy(
        (
            Rule("deny", tool="delete_*"),
            Rule("allow", annotations={"readOnlyHint": True}),
            Rule("allow", program=("ls", "cat")),
        ),
        default="ask",
        trusted_servers=frozenset({"files"}),
    )


@pytest.mark.parametrize(
    ("change", "line", "message"),
    [
        (('tool = "delete_*"', 'tol = "delete_*"'), 6, "rule.0.tol"),
        (('decision = "deny"', 'decision = "deny-all"'), 5, "rule.0.decision"),
        (("readOnlyHint = true", "readOnly = true"), 10, "Unknown annotation 'readOnly'"),
        (("readOnlyHint = true", 'readOnlyHint = "true"'), 10, "rule.1.annotations"),
        (('program = ["ls", "cat"]', 'program = ["ls", "c[at"]'), 14, "unclosed"),
        (('default = "ask"', 'defualt = "ask"'), 1, "defualt"),
        (('trusted_servers = ["files"]', 'trusted_servers = "files"'), 2, "trusted_servers"),
        (
            ('[[rule]]\ndecision = "allow"\nprogram', '[[rule]]\ndecision = "allow"\nprogram = \nx'),
            14,
            "TOML",
        ),
    ],
)
def test_a_policy_file_error_names_the_line(
    tmp_path: Path, change: tuple[str, str], line: int, message: str
) -> None:
    path = tmp_path / "policy.toml"
    assert change[0] in GOOD
    path.write_text(GOOD.replace(*change))
    with pytest.raises(PolicyError) as caught:
        load_policy(path)
    assert message in str(caught.value)
    assert f"line {line}" in str(caught.value)
