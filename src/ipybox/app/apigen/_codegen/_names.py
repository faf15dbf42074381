"""Names and literals: identifiers, string literals and docstrings built from a server's text."""

from __future__ import annotations

import ast
import keyword
import math
import re
import textwrap
import threading
from collections.abc import Sequence
from typing import Any

AST_LOCK = threading.Lock()
"""Held around every `ast` call of the generator. CPython (3.11 at least) counts the AST
constructor's recursion in state that all threads share; a garbage collection during
``ast.parse`` can run finalizers and switch threads, and another thread's parse then corrupts
the count (``SystemError: AST constructor recursion depth mismatch``). Packages are generated
in worker threads, several at once when sessions register servers together."""


class SchemaError(Exception):
    """A tool's schema cannot be compiled (the message names the place in the schema)."""


# Attributes of pydantic.BaseModel (and its metaclass) as of Pydantic 2.x: a field with such a
# name shadows them (a warning, and for ``model_config`` a broken class). Kept as a literal so
# this module does not import Pydantic just to ask.
_BASEMODEL_NAMES = frozenset(
    {
        "construct",
        "copy",
        "dict",
        "from_orm",
        "json",
        "model_computed_fields",
        "model_config",
        "model_construct",
        "model_copy",
        "model_dump",
        "model_dump_json",
        "model_extra",
        "model_fields",
        "model_fields_set",
        "model_json_schema",
        "model_parametrized_name",
        "model_post_init",
        "model_rebuild",
        "model_validate",
        "model_validate_json",
        "model_validate_strings",
        "parse_file",
        "parse_obj",
        "parse_raw",
        "schema",
        "schema_json",
        "update_forward_refs",
        "validate",
    }
)
_RESERVED_MODULES = frozenset({"__init__", "__main__"})
_MAX_DEPTH = 64
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WRAP = 96
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---------------------------------------------------------------------------------------------
# Names and literals


def module_name(tool_name: str) -> str:
    """The module name of a tool (before collisions are resolved).

    Every character outside ``[a-zA-Z0-9_]`` becomes ``_`` and the result is lower-cased; a
    keyword gets a trailing ``_`` (``class`` -> ``class_``) and a leading digit a leading ``_``
    (``1st`` -> ``_1st``).
    """
    name = re.sub(r"[^a-zA-Z0-9_]", "_", tool_name).lower() or "_"
    if keyword.iskeyword(name):
        name += "_"
    if name[0].isdigit():
        name = "_" + name
    return name


def module_names(tool_names: Sequence[str]) -> list[str]:
    """Distinct module names for tools, deterministic for a given set of tool names.

    Tools whose name already is its module name keep it; the others are served in sorted
    order, and a name that is taken gets the first free suffix ``_2``, ``_3``, ...
    ``__init__`` and ``__main__`` are never handed out.

    Args:
        tool_names: The tools' names, in the server's order (duplicates allowed).

    Returns:
        The module names, in the same order as ``tool_names``.
    """
    bases = [module_name(name) for name in tool_names]
    order = sorted(range(len(tool_names)), key=lambda i: (bases[i] != tool_names[i], tool_names[i], i))
    taken = set(_RESERVED_MODULES)
    names = [""] * len(tool_names)
    for i in order:
        name, suffix = bases[i], 2
        while name in taken:
            name, suffix = f"{bases[i]}_{suffix}", suffix + 1
        taken.add(name)
        names[i] = name
    return names


def str_literal(text: str) -> str:
    """A one-line Python string literal whose value is ``text`` (``repr`` escapes everything)."""
    return repr(text)


def docstring(text: str, indent: str = "") -> str:
    """A triple-quoted string literal for ``text``, indented for use as a docstring.

    Backslashes, runs of double quotes, a closing double quote and every non-printable
    character are escaped, so no text can end the literal early; lone surrogates become
    U+FFFD (Python cannot create a class whose docstring has one). The result is checked to
    read back as the (indented) text; if it ever did not, a plain ``repr`` is used instead.
    """
    lines = []
    for line in _SURROGATE.sub("\ufffd", text).strip().replace("\r\n", "\n").split("\n"):
        if len(line) <= _WRAP:
            lines.append(line)
            continue
        # Long lines are wrapped for reading, each on its own, keeping its indentation.
        lead = line[: len(line) - len(line.lstrip())]
        if line.lstrip().startswith(("- ", "* ")):
            lead += "  "  # a bullet's continuation lines hang under its text
        lines.extend(
            textwrap.wrap(line, _WRAP, subsequent_indent=lead, break_long_words=False, break_on_hyphens=False)
            or [line]
        )
    value = "\n".join(
        [lines[0].rstrip()] + [indent + line.rstrip() if line.strip() else "" for line in lines[1:]]
    )
    parts: list[str] = []
    for char in value:
        if char == "\\":
            parts.append("\\\\")
        elif char in "\n\t" or char.isprintable():
            parts.append(char)
        else:
            parts.append(char.encode("unicode_escape").decode("ascii"))
    body = re.sub(r'"{2,}|"$', lambda match: '\\"' * len(match.group()), "".join(parts))
    if "\n" in value:
        body += "\n" + indent
    literal = f'"""{body}"""'
    try:
        with AST_LOCK:
            parsed = ast.literal_eval(literal)
        if parsed == value + ("\n" + indent if "\n" in value else ""):
            return literal
    except (SyntaxError, ValueError):
        pass
    return repr(value)


def _valid_unicode(text: str) -> bool:
    """Whether ``text`` has no lone surrogates (JSON can carry them; Pydantic's core cannot)."""
    return _SURROGATE.search(text) is None


def _text(value: Any) -> str | None:
    """Documentation text: non-blank strings only, lone surrogates shown as U+FFFD."""
    if not isinstance(value, str) or not value.strip():
        return None
    return _SURROGATE.sub("\ufffd", value)


def _pascal(text: str) -> str:
    words = re.split(r"[^A-Za-z0-9]+", text)
    name = "".join(word[:1].upper() + word[1:] for word in words if word)
    if not name:
        return "Model"
    return "Model" + name if name[0].isdigit() else name


def _field_name(key: str) -> str:
    # Pydantic treats names with a leading underscore as private attributes, not fields.
    name = re.sub(r"[^A-Za-z0-9_]", "_", key).lstrip("_")
    if not name or name[0].isdigit():
        name = "field_" + name if name else "field"
    if keyword.iskeyword(name) or name in _BASEMODEL_NAMES or name.startswith("model_"):
        name += "_"
    return name


def _python_literal(value: Any) -> str | None:
    """Python source for a JSON value, or ``None`` if it has none (``nan``, huge ints, deep nesting)."""
    try:
        if not _is_json_literal(value, 0):
            return None
        text = repr(value)
    except (ValueError, RecursionError):
        return None
    return text


def _is_json_literal(value: Any, depth: int) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, str):
        return _valid_unicode(value)
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_json_literal(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(
            isinstance(k, str) and _valid_unicode(k) and _is_json_literal(v, depth + 1)
            for k, v in value.items()
        )
    return False


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _json_equal(a: Any, b: Any) -> bool:
    kinds = {_json_kind(a), _json_kind(b)}
    return (len(kinds) == 1 or kinds == {"integer", "number"}) and bool(a == b)


def _first_line(text: str, limit: int = 120) -> str:
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


def is_identifier(name: str) -> bool:
    """Whether ``name`` is an ASCII Python identifier that is not a keyword."""
    return bool(_IDENTIFIER.fullmatch(name)) and not keyword.iskeyword(name)
