"""Policy rules: which tool calls and shell commands run unasked, which ask, which are refused.

A `Policy` is an ordered list of `Rule` objects and a default. The tool server evaluates it
for every call before anything reaches the application's approval: the first rule that matches
decides (``allow``: run unasked; ``ask``: the application decides, as without a policy;
``deny``: refused), else the default. It lives in the application process only, where code in
the kernel cannot reach it.

A rule matches a call by the MCP server's name and the tool's name (``fnmatch`` globs), by the
tool's MCP annotations (``readOnlyHint``, ``destructiveHint``, ``idempotentHint``,
``openWorldHint``) and, for shell commands (server ``ipybox``, tools ``shell`` and
``shell_magic``), by program. Annotations are hints the server gives about its own tools: they
are read only for the servers the policy names in ``trusted_servers``; for any other server a
rule sees the MCP defaults of a tool that says nothing (not read-only, destructive, not
idempotent, open world), so an untrusted server cannot talk its way into an ``allow``. A shell
command is split into its commands and each is decided on its own; the strictest decision wins.
``allow`` holds only for what the positive reader proves (`ipybox.app.approval._shellproof`: plain words,
no expansion, assignment or path) and, for a program that runs others, only when the rule names
its arguments; anything else is asked about at least. ``deny`` rules also see what the best-effort
reader finds (`ipybox.app.approval._shellparse`: pipelines, subshells, ``$(...)``).

Policies also come as a TOML file (`load_policy`), checked against a strict schema: an unknown
key, decision or annotation, or a bad glob, is an error that names the line.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from mcp.types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError

from ipybox.app.approval._shellparse import programs as shell_programs
from ipybox.app.approval._shellproof import ProvenCommand, proven_commands, runs_others
from ipybox.errors import PolicyError

__all__ = ["ANNOTATIONS", "SHELL_SERVER", "Decision", "Policy", "Rule", "Verdict", "load_policy"]

Decision = Literal["allow", "ask", "deny"]
_DECISIONS: tuple[str, ...] = get_args(Decision)
_STRICTNESS = {"allow": 0, "ask": 1, "deny": 2}
# The server name of shell commands in approval requests, and its tools.
SHELL_SERVER = "ipybox"
_SHELL_TOOLS = frozenset({"shell", "shell_magic"})
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
# The MCP annotation hints a rule may test, with the value the MCP spec gives one left unset.
ANNOTATIONS: dict[str, bool] = {
    "readOnlyHint": False,
    "destructiveHint": True,
    "idempotentHint": False,
    "openWorldHint": True,
}


def _check_glob(what: str, pattern: object) -> str:
    if not isinstance(pattern, str) or not pattern or pattern != pattern.strip():
        raise PolicyError(f"{what} must be a non-empty glob without surrounding spaces, not {pattern!r}.")
    # fnmatch reads an unclosed "[" as itself: almost surely a typo, which must not match by accident.
    depth = 0
    for char in pattern:
        if char == "[":
            depth += 1
        elif char == "]" and depth:
            depth -= 1
    if depth:
        raise PolicyError(
            f"{what} {pattern!r} has an unclosed '['; close it, or write '[[]' for a literal '['."
        )
    return pattern


@dataclass(frozen=True)
class Rule:
    """One policy rule: a decision for the calls it matches.

    Example:
        ```python
        Rule("allow", server="github", tool="get_*")
        Rule("deny", annotations={"destructiveHint": True})
        Rule("allow", program=["ls", "cat", "git status"])  # shell commands
        ```

    Args:
        decision: ``"allow"``, ``"ask"`` or ``"deny"``.
        server: Glob of MCP server names (shell commands have the server ``"ipybox"``).
        tool: Glob of tool names.
        annotations: MCP annotation hints the tool must have (``{"readOnlyHint": True}``), read
            only for servers in the policy's ``trusted_servers``.
        program: Globs of programs (shell commands only); a rule with programs matches only
            shell commands. A glob with a space matches the program and its arguments
            (``"git status"``, ``"git log *"``; a final ``" *"`` also matches none): only such a
            glob allows a program that runs others (`ipybox.app.approval._shellproof.runs_others`). A glob with ``/`` matches the program as written; one without matches
            a program written without a folder, and for ``ask`` and ``deny`` also one written with
            a folder (``deny rm`` stops ``/bin/rm``; ``allow ls`` does not let ``./ls`` through).
        origin: Where the rule was written (``policy.toml:12``), shown when it refuses a call;
            `load_policy` sets it.

    Raises:
        PolicyError: An unknown decision or annotation, a bad glob, or programs on a rule that
            cannot match a shell command.
    """

    decision: Decision
    server: str = "*"
    tool: str = "*"
    annotations: Mapping[str, bool] = field(default_factory=dict)
    program: str | Sequence[str] | None = None
    origin: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.decision not in _DECISIONS:
            raise PolicyError(f"A rule's decision is one of {', '.join(_DECISIONS)}, not {self.decision!r}.")
        _check_glob("server", self.server)
        _check_glob("tool", self.tool)
        for name, value in dict(self.annotations).items():
            if name not in ANNOTATIONS:
                raise PolicyError(
                    f"Unknown annotation {name!r}; the MCP annotations are {', '.join(ANNOTATIONS)}."
                )
            if not isinstance(value, bool):
                raise PolicyError(f"Annotation {name!r} must be true or false, not {value!r}.")
        object.__setattr__(self, "annotations", dict(self.annotations))
        if self.program is not None:
            program = (self.program,) if isinstance(self.program, str) else tuple(self.program)
            if not program:
                raise PolicyError("program must name at least one program glob; leave it out to match any.")
            for pattern in program:
                _check_glob("program", pattern)
            if not fnmatch.fnmatchcase(SHELL_SERVER, self.server) or not any(
                fnmatch.fnmatchcase(tool, self.tool) for tool in _SHELL_TOOLS
            ):
                raise PolicyError(
                    f"A rule with program {list(program)} matches only shell commands (server {SHELL_SERVER!r}, "
                    f"tools 'shell' and 'shell_magic'), but its server {self.server!r} and tool {self.tool!r} "
                    "exclude them."
                )
            if self.annotations:
                raise PolicyError("A shell command has no annotations: a rule takes program or annotations.")
            object.__setattr__(self, "program", program)

    def _matches(self, server: str, tool: str, hints: Mapping[str, bool] | None) -> bool:
        if not (fnmatch.fnmatchcase(server, self.server) and fnmatch.fnmatchcase(tool, self.tool)):
            return False
        if self.annotations:
            if hints is None:
                return False
            return all(hints[name] == value for name, value in self.annotations.items())
        return True

    def _matches_program(self, program: str, words: tuple[str, ...] | None) -> bool | None:
        """Whether this rule matches `program` (``None``: no); ``True`` when a pattern with
        arguments (``"git status"``) matched `words`, the command's words."""
        if self.program is None:
            return False
        base = program.rsplit("/", 1)[-1]
        for pattern in (self.program,) if isinstance(self.program, str) else self.program:
            if " " in pattern:
                # Program and arguments, matched against the words joined by single spaces; a
                # word holding white space could pose as two, so it matches no such pattern.
                # A pattern ending in " *" also matches the command without arguments.
                if words is not None and not any(c.isspace() for w in words for c in w):
                    joined = " ".join(words)
                    if fnmatch.fnmatchcase(joined, pattern) or (
                        pattern.endswith(" *") and joined == pattern[:-2]
                    ):
                        return True
            elif "/" in pattern or "/" not in program:
                if fnmatch.fnmatchcase(program, pattern):
                    return False
            elif self.decision != "allow" and fnmatch.fnmatchcase(base, pattern):
                return False
        return None


@dataclass(frozen=True)
class Verdict:
    """A policy's decision on one call, and what made it (``"rule 2"``, ``"default"``, ``"session"``)."""

    decision: Decision
    by: str
    origin: str | None = None


@dataclass(frozen=True)
class Policy:
    """Rules evaluated in order for every tool call and shell command; the first match decides.

    Example:
        ```python
        Policy(
            rules=[
                Rule("deny", tool="delete_*"),
                Rule("allow", annotations={"readOnlyHint": True}),
                Rule("allow", program=["ls", "cat", "grep"]),
            ],
            default="ask",
            trusted_servers={"files"},
        )
        ```

    Args:
        rules: The rules, first match wins.
        default: The decision when no rule matches.
        trusted_servers: Servers whose tool annotations rules may read.

    Raises:
        PolicyError: A rule is not a `Rule`, or the default is not a decision.
    """

    rules: Sequence[Rule] = ()
    default: Decision = "ask"
    trusted_servers: Collection[str] = frozenset()

    def __post_init__(self) -> None:
        rules = tuple(self.rules)
        for index, rule in enumerate(rules, 1):
            if not isinstance(rule, Rule):
                raise PolicyError(f"Rule {index} is {rule!r}; give Rule objects (ipybox.policy.Rule).")
        if self.default not in _DECISIONS:
            raise PolicyError(
                f"The default decision is one of {', '.join(_DECISIONS)}, not {self.default!r}."
            )
        if isinstance(self.trusted_servers, str):
            raise PolicyError("trusted_servers is a collection of server names, not one string.")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "trusted_servers", frozenset(self.trusted_servers))

    def decide(self, server: str, tool: str, annotations: ToolAnnotations | None = None) -> Verdict:
        """The decision for a call of `tool` of MCP `server`, whose tool list gave it `annotations`."""
        hints = dict(ANNOTATIONS)
        if server in self.trusted_servers and annotations is not None:
            for name in ANNOTATIONS:
                value = getattr(annotations, _snake(name), None)
                if isinstance(value, bool):
                    hints[name] = value
            if hints["readOnlyHint"]:
                # The spec: destructiveHint means something only for a tool that is not read-only.
                hints["destructiveHint"] = False
        for index, rule in enumerate(self.rules, 1):
            if rule.program is None and rule._matches(server, tool, hints):
                return Verdict(rule.decision, f"rule {index}", rule.origin)
        return Verdict(self.default, "default")

    def decide_shell(
        self, tool: str, tool_args: Mapping[str, Any], session_programs: Iterable[str] = ()
    ) -> Verdict:
        """The decision for a shell command (`tool` ``shell`` or ``shell_magic``, as approval shows it).

        Each command is decided on its own and the strictest decision wins. ``allow`` holds only
        for a line the positive reader proves (`ipybox.app.approval._shellproof`), and for a program that
        runs others only when the rule names its arguments; else it becomes ``ask``. A program the
        application allowed for the session turns its ``ask`` into ``allow`` (proven lines only).
        """
        line = read_shell(tool, tool_args)
        if line.proven is None:
            if line.seen is None:
                # Unreadable: rules without programs still apply, but nothing better than "ask".
                return _at_most_ask(self._first(tool, None, None)[0], "unreadable command")
            return _strictest(
                _at_most_ask(self._first(tool, program, None)[0], "command outside what a rule can prove")
                for program in line.seen
            )
        allowed = set(session_programs)
        verdicts: list[Verdict] = []
        for command in line.proven:
            verdict, named_args = self._first(tool, command.program, command.words)
            if verdict.decision == "allow" and not named_args and runs_others(command.words):
                verdict = Verdict("ask", f"{command.program} runs other programs")
            elif verdict.decision == "ask" and command.program in allowed and not runs_others(command.words):
                verdict = Verdict("allow", "session")
            verdicts.append(verdict)
        # Deny rules also see what the best-effort reader sees.
        verdicts.extend(v for p in line.seen or () if (v := self._first(tool, p, None)[0]).decision == "deny")
        return _strictest(verdicts)

    def _first(self, tool: str, program: str | None, words: tuple[str, ...] | None) -> tuple[Verdict, bool]:
        """The first matching rule's verdict, and whether that rule named the command's arguments."""
        for index, rule in enumerate(self.rules, 1):
            if not rule._matches(SHELL_SERVER, tool, ANNOTATIONS if rule.annotations else None):
                continue
            if rule.program is None:
                return Verdict(rule.decision, f"rule {index}", rule.origin), False
            matched = rule._matches_program(program, words) if program is not None else None
            if matched is not None:
                return Verdict(rule.decision, f"rule {index}", rule.origin), matched
        return Verdict(self.default, "default"), False


def _at_most_ask(verdict: Verdict, why: str) -> Verdict:
    return Verdict("ask", why) if verdict.decision == "allow" else verdict


def _strictest(verdicts: Iterable[Verdict]) -> Verdict:
    worst: Verdict | None = None
    for verdict in verdicts:
        if worst is None or _STRICTNESS[verdict.decision] > _STRICTNESS[worst.decision]:
            worst = verdict
    return worst if worst is not None else Verdict("ask", "no program")


def is_shell(server: str, tool: str) -> bool:
    """Whether an approval request for `server`.`tool` is a shell command."""
    return server == SHELL_SERVER and tool in _SHELL_TOOLS


@dataclass(frozen=True)
class ShellLine:
    """A shell request as the rules read it.

    Attributes:
        proven: Its simple commands, when the positive reader proves them (``None``: it cannot).
        seen: The programs the best-effort reader finds, for ``deny`` and ``ask`` rules
            (``None``: it cannot read them either).
    """

    proven: list[ProvenCommand] | None
    seen: list[str] | None


def read_shell(tool: str, tool_args: Mapping[str, Any]) -> ShellLine:
    """Read a shell request (``{"cmd"}``, or ``{"magic", "cmd", "args"?}``)."""
    cmd = tool_args.get("cmd")
    if not isinstance(cmd, str):
        return ShellLine(None, None)
    if tool == "shell":
        return ShellLine(proven_commands(cmd), shell_programs(cmd))
    magic, args = tool_args.get("magic"), tool_args.get("args") or []
    if not isinstance(magic, str) or not magic or not isinstance(args, list):
        return ShellLine(None, None)
    if magic.rsplit("/", 1)[-1] in _SHELLS:
        # The cell is a script for a shell: its programs are what runs. Options could make it run
        # something else (-c), so a shell with arguments is unreadable.
        if args:
            return ShellLine(None, None)
        return ShellLine(proven_commands(cmd) if "/" not in magic else None, shell_programs(cmd))
    # Another program reads the cell: it is the one command, given by name (never by path).
    words = [magic, *(str(arg) for arg in args)]
    proven = proven_commands(shlex.join(words)) if "/" not in magic else None
    return ShellLine(proven, [magic])


def command_programs(tool: str, tool_args: Mapping[str, Any]) -> list[str] | None:
    """The programs that accepting this request for the session may allow later: those of a proven
    line, none of which runs other programs; ``None`` when there are none such."""
    proven = read_shell(tool, tool_args).proven
    if not proven or any(runs_others(command.words) for command in proven):
        return None
    return [command.program for command in proven]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class _RuleModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Decision
    server: StrictStr = "*"
    tool: StrictStr = "*"
    annotations: dict[StrictStr, StrictBool] = {}
    program: StrictStr | list[StrictStr] | None = None


class _PolicyModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    default: Decision = "ask"
    trusted_servers: list[StrictStr] = []
    rule: list[_RuleModel] = []


def load_policy(path: Path | str) -> Policy:
    """Read a policy from a TOML file.

    The file has ``default`` (``"allow"``, ``"ask"`` or ``"deny"``; ``"ask"`` if left out),
    ``trusted_servers`` (a list of names) and one ``[[rule]]`` table per rule with ``decision``
    and optionally ``server``, ``tool``, ``annotations`` (an inline table such as
    ``{ readOnlyHint = true }``) and ``program`` (a glob or a list of globs)::

        default = "ask"
        trusted_servers = ["files"]

        [[rule]]
        decision = "deny"
        tool = "delete_*"

        [[rule]]
        decision = "allow"
        annotations = { readOnlyHint = true }

    Raises:
        PolicyError: The file cannot be read, is not TOML, or breaks the schema; the message
            names the file and the line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"The policy file {path} could not be read: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{path}: not valid TOML: {exc}") from exc
    lines = _Lines(text)
    try:
        model = _PolicyModel.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        location = tuple(error["loc"])
        where = lines.find(location)
        key = ".".join(str(part) for part in location)
        raise PolicyError(
            f"{path}, line {where}: {key}: {error['msg']} (allowed keys: default, trusted_servers, [[rule]] with "
            "decision, server, tool, annotations, program)."
        ) from None
    rules = []
    for index, rule in enumerate(model.rule):
        try:
            rules.append(
                Rule(
                    rule.decision,
                    server=rule.server,
                    tool=rule.tool,
                    annotations=rule.annotations,
                    program=tuple([rule.program] if isinstance(rule.program, str) else rule.program)
                    if rule.program is not None
                    else None,
                    origin=f"{path.name}:{lines.find(('rule', index))}",
                )
            )
        except PolicyError as exc:
            raise PolicyError(
                f"{path}, line {lines.find(('rule', index, _failing_key(rule)))}: {exc}"
            ) from None
    return Policy(tuple(rules), model.default, frozenset(model.trusted_servers))


def _failing_key(rule: _RuleModel) -> str:
    """The key of a rule table whose value `Rule` refuses (for the line an error names)."""
    for key in ("server", "tool", "annotations", "program"):
        try:
            Rule(rule.decision, **{key: getattr(rule, key)})
        except PolicyError:
            return key
    return "program"  # the programs with a server or tool that excludes shell commands


class _Lines:
    """Line numbers of a TOML policy's keys, for messages (tomllib keeps no positions)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        # The line of each [[rule]] header, in order.
        self.headers = [n for n, line in enumerate(self.lines, 1) if re.match(r"\s*\[\[\s*rule\s*\]\]", line)]

    def find(self, location: tuple[Any, ...]) -> int:
        if len(location) >= 2 and location[0] == "rule" and isinstance(location[1], int):
            if location[1] >= len(self.headers):
                return self._key("rule", 1, len(self.lines)) or 1
            start = self.headers[location[1]]
            end = (
                self.headers[location[1] + 1] if location[1] + 1 < len(self.headers) else len(self.lines) + 1
            )
            if len(location) >= 3:
                return self._key(str(location[2]), start + 1, end - 1) or start
            return start
        end = self.headers[0] - 1 if self.headers else len(self.lines)
        return self._key(str(location[0]), 1, end) or 1 if location else 1

    def _key(self, key: str, first: int, last: int) -> int | None:
        pattern = re.compile(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for number in range(first, last + 1):
            if pattern.match(self.lines[number - 1]):
                return number
        return None
