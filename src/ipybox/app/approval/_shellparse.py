"""The programs a shell command line runs, as far as can be seen, for deny rules (application side only).

This reader proves nothing: it finds programs for ``deny`` and ``ask`` rules, and a rule's
``allow`` holds only for lines the positive reader in `ipybox.app.approval._shellproof` accepts.

`programs` splits a command line the way a POSIX shell would at its control operators
(``|``, ``||``, ``&&``, ``;``, ``&``, newlines, ``(`` ``)`` subshells, ``{`` ``}`` groups) and
collects the programs of command substitutions (``$(...)``, ``<(...)``, ``>(...)``) as commands of
their own. It does not try to be a shell: whatever it cannot read with certainty (backquotes,
here-documents, arithmetic, control keywords such as ``if`` or ``for``, a program named by a
variable or a substitution, ``eval`` or ``source``, an unclosed quote) makes it answer ``None``,
and the policy then asks rather than allows.
"""

from __future__ import annotations

import re

__all__ = ["programs"]

_DUPLICATE = re.compile(r"(\d+|-)(?=[\s;&|()<>]|$)")

_SEPARATORS = frozenset(";&|\n()")
_KEYWORDS = frozenset(
    {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac",
     "function", "select", "coproc", "[[", "]]", "eval", "source", ".", "alias"}
)  # fmt: skip
# Prefixes that run the program after them (their options are not read: any option makes it unknown).
_PREFIXES = frozenset({"!", "exec", "command", "builtin", "time", "{", "}"})


class _Unsure(Exception):
    """The command line holds something this reader does not read with certainty."""


class _Word:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.started = False
        # Holds an unquoted glob or brace character: the shell may turn it into other words.
        self.pattern = False
        # Where the first variable or substitution starts in the text, if the word holds one.
        self.dynamic_at: int | None = None

    @property
    def dynamic(self) -> bool:
        return self.dynamic_at is not None

    def mark_dynamic(self) -> None:
        self.started = True
        if self.dynamic_at is None:
            self.dynamic_at = len(self.text)

    def add(self, char: str) -> None:
        self.text.append(char)
        self.started = True


def programs(command: str) -> list[str] | None:
    """The programs `command` runs, each as written, in order; ``None`` if it cannot be read safely.

    Examples: ``ls -l | wc`` gives ``["ls", "wc"]``; ``ls && rm -rf x`` gives ``["ls", "rm"]``;
    ``echo $(whoami)`` gives ``["echo", "whoami"]``; ``$PROG x`` and ``echo `id``` give ``None``.
    """
    found: list[str] = []
    try:
        end = _parse(command, 0, found, nested=False)
    except (_Unsure, IndexError, ValueError):
        return None
    if end != len(command):
        return None
    return found


def _parse(text: str, pos: int, found: list[str], *, nested: bool) -> int:  # noqa: C901
    """Read commands from `pos` to the end, or to the ``)`` closing a substitution (`nested`)."""
    words: list[_Word] = []
    word = _Word()
    redirect = False  # the next word is a redirection's target, not part of the command
    depth = 0  # open subshell parentheses inside this level

    def finish_word() -> None:
        nonlocal word, redirect
        if word.started:
            if redirect:
                redirect = False
            else:
                words.append(word)
        word = _Word()

    def finish_command() -> None:
        finish_word()
        if redirect:
            raise _Unsure("a redirection without its target")
        _command(words, found)
        words.clear()

    while pos < len(text):
        char = text[pos]
        if char == "\\":
            if pos + 1 < len(text) and text[pos + 1] == "\n":
                pos += 2
                continue
            word.add(text[pos + 1])
            pos += 2
        elif char == "'":
            close = text.index("'", pos + 1)
            word.text.extend(text[pos + 1 : close])
            word.started = True
            pos = close + 1
        elif char == '"':
            pos = _double_quoted(text, pos + 1, word, found)
        elif char == "`":
            raise _Unsure("backquotes")
        elif char == "$":
            pos = _dollar(text, pos, word, found)
        elif char == "#" and not word.started:
            while pos < len(text) and text[pos] != "\n":
                pos += 1
        elif char in " \t":
            finish_word()
            pos += 1
        elif char in "<>":
            if word.started and "".join(word.text).isdigit() and not word.dynamic:
                word = _Word()  # a file descriptor number: 2>file
            else:
                finish_word()
            if text.startswith("<<", pos):
                raise _Unsure("a here-document")
            if text.startswith("(", pos + 1):
                # Process substitution <(...) / >(...): its commands run too.
                pos = _parse(text, pos + 2, found, nested=True) + 1
                word.mark_dynamic()
                continue
            start = pos
            pos += 1
            while pos < len(text) and text[pos] in "<>&|":
                pos += 1
            if "&" in text[start:pos] and not _DUPLICATE.match(text, pos):
                # bash reads the word after >& in ways of its own (>&2'$(id)' runs id).
                raise _Unsure("a redirection with & to anything but a descriptor number")
            redirect = True
        elif char == ")":
            if depth == 0:
                if not nested:
                    raise _Unsure("an unmatched parenthesis")
                finish_command()
                return pos
            depth -= 1
            finish_command()
            pos += 1
        elif char in _SEPARATORS:
            if char == "(":
                if words or word.started or text.startswith("((", pos):
                    raise _Unsure("a parenthesis inside a command")
                depth += 1
            finish_command()
            pos += 1
        else:
            if char in "*?[{}~":
                word.pattern = True
            word.add(char)
            pos += 1
    if nested or depth:
        raise _Unsure("an unclosed parenthesis")
    finish_command()
    return pos


def _double_quoted(text: str, pos: int, word: _Word, found: list[str]) -> int:
    word.started = True
    while True:
        char = text[pos]
        if char == '"':
            return pos + 1
        if char == "\\" and text[pos + 1] == "\n":
            pos += 2  # a line continuation, inside double quotes too: "r\<newline>m" is rm
        elif char == "\\" and text[pos + 1] in '"\\$`':
            word.text.append(text[pos + 1])
            pos += 2
        elif char == "`":
            raise _Unsure("backquotes")
        elif char == "$":
            pos = _dollar(text, pos, word, found)
        else:
            word.text.append(char)
            pos += 1


def _dollar(text: str, pos: int, word: _Word, found: list[str]) -> int:
    """Read a ``$`` expansion at `pos`; the word becomes dynamic. Returns the position after it."""
    word.mark_dynamic()
    following = text[pos + 1] if pos + 1 < len(text) else ""
    if following == "(":
        if text.startswith("((", pos + 1):
            raise _Unsure("arithmetic expansion")
        return _parse(text, pos + 2, found, nested=True) + 1
    if following in "'\"":
        raise _Unsure("ANSI-C or locale quoting")
    if following == "{":
        close = text.index("}", pos + 2)
        inner = text[pos + 2 : close]
        # A quoted or escaped "}" does not close it: read no further than what is certain.
        if any(mark in inner for mark in "$`(\\'\"{"):
            raise _Unsure("a substitution inside a parameter expansion")
        return close + 1
    if following.isalnum() or following == "_":
        pos += 1
        while pos < len(text) and (text[pos].isalnum() or text[pos] == "_"):
            pos += 1
        return pos
    if following and following in "@*#?$!-":
        return pos + 2
    word.text.append("$")  # a lone $ is literal
    return pos + 1


def _command(words: list[_Word], found: list[str]) -> None:
    """Record the program of one simple command (its words, redirections removed)."""
    index = 0
    while index < len(words):
        word = words[index]
        text = "".join(word.text)
        static = text if word.dynamic_at is None else text[: word.dynamic_at]
        if "=" in static and _is_assignment(static):
            index += 1
            continue
        if word.dynamic:
            raise _Unsure("a program named by a variable or a substitution")
        if text in _KEYWORDS:
            raise _Unsure(f"the shell keyword {text!r}")
        if text in _PREFIXES:
            if text in {"{", "}"}:
                index += 1
                continue
            index += 1
            if text in {"exec", "command", "builtin", "time"} and index < len(words):
                if "".join(words[index].text).startswith("-"):
                    raise _Unsure(f"options of {text!r}")
            continue
        if word.pattern:
            raise _Unsure("a program named by a pattern")
        found.append(text)
        return


def _is_assignment(text: str) -> bool:
    name, equals, _ = text.partition("=")
    name = name.removesuffix("+")  # a+=b appends
    return bool(equals) and name.isidentifier() and name.isascii()
