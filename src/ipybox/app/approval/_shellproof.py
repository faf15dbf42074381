"""What a shell command line provably runs, for policy ``allow`` rules (application side only).

`proven_commands` accepts a small positive grammar and nothing else: simple commands made of
plain words, joined by ``|``, ``||``, ``&&``, ``;`` and newlines, each with optional plain-file
redirections. A plain word is a run of letters, digits and ``_-./,:@%+=``, a single-quoted
string, a double-quoted string without ``$``, backquote, backslash or ``!``, or a backslash
followed by one printable character. Every word then means the same text to bash and to dash,
with no expansion, so the words this reader returns are the words the shell runs. Anything
else (a ``$``, a glob, a brace, a comment, an assignment, a subshell, a keyword, a program
given by a path, a redirection to a descriptor by name, ...) makes it answer ``None``: the
policy then asks rather than allows. Deny rules read the line with the best-effort reader in
`ipybox.app.approval._shellparse`, which sees further but proves nothing.

`runs_others` tells the programs (and shell builtins) that may start other programs or evaluate
code from their arguments, their environment or configuration files: every program but a short
list known to run only itself (``ls``, ``cat``, ``grep``, ``find`` without ``-exec``, ...). A rule
that names such a program by name alone cannot promise what it runs, so it asks.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

__all__ = ["ProvenCommand", "proven_commands", "runs_others"]

_PLAIN = frozenset(string.ascii_letters + string.digits + "_-./,:@%+=")
# Printable ASCII a backslash may quote; a backslash-newline (a line continuation) is outside.
_ESCAPABLE = frozenset(string.printable) - frozenset("\n\r\t\x0b\x0c")
_QUOTED_FORBIDDEN = frozenset('$`\\!"')
# Reserved words, and the builtins a rule may name that still run nothing but themselves.
_KEYWORDS = frozenset(
    {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac", "in",
     "function", "select", "coproc", "time", "[[", "]]", "{", "}", "!"}
)  # fmt: skip
_SAFE_BUILTINS = frozenset({"echo", "true", "false", "pwd", "cd", ":"})
# Builtins of bash and dash (their names run the builtin whatever PATH holds). Those not in
# _SAFE_BUILTINS evaluate names, subscripts or code (`printf -v 'a[$(id)]'`, `read`, `declare`,
# `let`, `test -v`, `eval`, `trap`, `enable -f`, `hash -p`, `mapfile -C`, ...).
_BUILTINS = frozenset(
    {"alias", "bg", "bind", "break", "builtin", "caller", "cd", "command", "compgen", "complete",
     "compopt", "continue", "declare", "dirs", "disown", "echo", "enable", "eval", "exec", "exit",
     "export", "false", "fc", "fg", "getopts", "hash", "help", "history", "jobs", "kill", "let",
     "local", "logout", "mapfile", "popd", "printf", "pushd", "pwd", "read", "readarray", "readonly",
     "return", "set", "shift", "shopt", "source", ".", "suspend", "test", "[", "times", "trap", "true",
     "type", "typeset", "ulimit", "umask", "unalias", "unset", "wait", ":", "chdir"}
)  # fmt: skip
# Programs known to start no other program and to evaluate no code from their arguments,
# environment or configuration: the only ones a rule may allow by name alone. A list of programs
# that do run others could never be complete (`setarch`, `split --filter`, `sort
# --compress-program`, `diff3 --diff-program`, `rbash`, ... each got past one), so every program
# not named here counts as one that may, and needs a rule that names its arguments.
_ONLY_THEMSELVES = frozenset(
    {"ls", "cat", "tac", "head", "tail", "wc", "grep", "egrep", "fgrep", "pwd", "date", "cal",
     "mkdir", "rmdir", "rm", "cp", "mv", "touch", "stat", "du", "df", "basename", "dirname",
     "realpath", "readlink", "cut", "tr", "uniq", "tee", "comm", "nl", "od", "md5sum", "sha1sum",
     "sha256sum", "sha512sum", "cksum", "base64", "seq", "sleep", "id", "whoami", "uname", "cmp",
     "diff", "paste", "join", "fold", "fmt", "expand", "unexpand", "rev", "column", "jq", "tree",
     "file", "which", "nproc", "uptime", "chmod", "truncate", "mktemp", "shuf", "numfmt", "gzip",
     "gunzip", "zcat", "bzip2", "xz", "unxz", "echo", "printenv"}
)  # fmt: skip
_FIND_RUNNING = frozenset(
    {"-exec", "-execdir", "-ok", "-okdir", "-fprint", "-fprint0", "-fprintf", "-fls", "-delete"}
)


class _Outside(Exception):
    """The command line leaves the grammar this reader proves."""


@dataclass(frozen=True)
class ProvenCommand:
    """One simple command: its words (program first, exactly as the shell passes them on) and the
    plain files its redirections name."""

    words: tuple[str, ...]
    files: tuple[str, ...] = ()

    @property
    def program(self) -> str:
        return self.words[0]


def proven_commands(command: str) -> list[ProvenCommand] | None:
    """The simple commands `command` runs; ``None`` if it leaves the grammar.

    Examples: ``ls -l | wc -l`` gives the words ``("ls", "-l")`` and ``("wc", "-l")``;
    ``ls 'a b' > out.txt`` gives ``("ls", "a b")`` writing ``out.txt``; ``PATH=. ls``,
    ``ls $HOME``, ``ls *``, ``./ls``, ``ls & id`` and ``ls # x`` give ``None``.
    """
    try:
        return _Reader(command).read()
    except _Outside:
        return None


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.commands: list[ProvenCommand] = []
        self.words: list[str] = []
        self.files: list[str] = []

    def read(self) -> list[ProvenCommand]:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char in " \t":
                self.pos += 1
            elif char == "\n":
                # A newline may end an empty command (blank lines, a line after `|` or `&&`).
                self._end(empty_ok=True)
                self.pos += 1
            elif char == ";" or text.startswith("&&", self.pos) or char == "|":
                self._end(empty_ok=False)
                self.pos += 2 if text.startswith(("&&", "||"), self.pos) else 1
            elif char in "<>":
                self._redirection(fd=None)
            else:
                start = self.pos
                word = self._word()
                if self.pos < len(text) and text[self.pos] in "<>":
                    if len(word) == 1 and word.isdigit() and self.pos == start + 1:
                        self._redirection(fd=word)
                        continue
                    if word.isdigit():  # `10>x`: a descriptor to bash, a word to dash
                        raise _Outside("a number right before a redirection")
                self.words.append(word)
        self._end(empty_ok=True)
        if not self.commands:
            raise _Outside("no command")
        return self.commands

    def _end(self, *, empty_ok: bool) -> None:
        if self.words:
            self.commands.append(_command(self.words, self.files))
        elif self.files or not empty_ok:
            raise _Outside("an empty command")
        self.words, self.files = [], []

    def _redirection(self, fd: str | None) -> None:
        """Read ``<``, ``>`` or ``>>`` and its plain file, or a whole ``N>&M``."""
        text, pos = self.text, self.pos
        if text.startswith((">&", "<&"), pos):
            # Duplicating a descriptor: only a single digit onto a single digit (2>&1).
            digit = text[pos + 2 : pos + 3]
            if not digit.isdigit() or text[pos + 3 : pos + 4] not in ("", " ", "\t", "\n", ";", "|"):
                raise _Outside("a descriptor duplication other than N>&M")
            self.pos = pos + 3
            return
        pos += 2 if text.startswith(">>", pos) else 1
        if text[pos : pos + 1] in ("<", ">", "&", "|", "("):
            raise _Outside("a here-document or an unusual redirection")
        while text[pos : pos + 1] in (" ", "\t"):
            pos += 1
        self.pos = pos
        if pos >= len(text) or text[pos] in "\n;|&<>":
            raise _Outside("a redirection without its file")
        target = self._word()
        if not target:
            raise _Outside("a redirection to an empty name")
        if target.startswith("/dev/") and target != "/dev/null":
            # bash opens /dev/tcp/host/port, /dev/fd/N and the like itself: not a plain file.
            raise _Outside("a redirection to a device bash reads as a connection or descriptor")
        self.files.append(target)

    def _word(self) -> str:
        """Read one plain word; its text."""
        text, pos = self.text, self.pos
        parts: list[str] = []
        while pos < len(text):
            char = text[pos]
            if char in _PLAIN:
                parts.append(char)
                pos += 1
            elif char in "'\"":
                quoted, pos = _quoted(text, pos)
                parts.append(quoted)
            elif char == "\\":
                following = text[pos + 1 : pos + 2]
                if not following or following not in _ESCAPABLE:
                    raise _Outside("a backslash before a line end or a control character")
                parts.append(following)
                pos += 2
            elif char in " \t\n;|<>" or text.startswith("&&", pos):
                break
            else:
                raise _Outside(f"the character {char!r}")
        if pos == self.pos:
            raise _Outside("an empty word")
        self.pos = pos
        word = "".join(parts)
        if "\x00" in word:
            raise _Outside("a NUL character")
        return word


def _quoted(text: str, pos: int) -> tuple[str, int]:
    """Read a single- or double-quoted string at `pos`; its text and the position after it."""
    quote = text[pos]
    close = text.find(quote, pos + 1)
    if close < 0:
        raise _Outside("an unclosed quote")
    inner = text[pos + 1 : close]
    if quote == '"' and any(mark in _QUOTED_FORBIDDEN for mark in inner):
        raise _Outside("a double-quoted string with an expansion or an escape")
    return inner, close + 1


def _command(words: list[str], files: list[str]) -> ProvenCommand:
    program = words[0]
    if "=" in program:
        raise _Outside("an assignment (or a program named with '=')")
    if not program or "/" in program:
        raise _Outside("a program given by a path")
    if program in _KEYWORDS:
        raise _Outside(f"the shell keyword {program!r}")
    return ProvenCommand(tuple(words), tuple(files))


def runs_others(command: tuple[str, ...]) -> bool:
    """Whether `command` (its words, program first) may start other programs or evaluate code it is given."""
    program = command[0]
    if program in _BUILTINS:
        return program not in _SAFE_BUILTINS
    if program == "find":
        return any(word in _FIND_RUNNING for word in command[1:])
    return program not in _ONLY_THEMSELVES
