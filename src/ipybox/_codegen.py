"""Compile MCP tool schemas into Python modules with Pydantic v2 models (application side only).

This is a small JSON Schema compiler written for ipybox rather than a call into
``datamodel-code-generator``, for speed: on a 100-tool server with nested input and output
schemas (2 shared cores) datamodel-code-generator 0.89 needs ~1.5 s for one batched run once
warm and ~3 s in a fresh process, over the whole budget of ``generate_mcp_sources``
(~1.5 s, server start included); this compiler needs ~70 ms for the same tools. Figures come
from ``tests/mcp_apigen/measure_generation.py --compare-dcg``.

Why the output is safe (ARCHITECTURE S5): text from a server reaches a module only as

- a string literal made by :func:`str_literal` (``repr``) or :func:`docstring` (escaped, and
  checked to read back as the text it encodes), or
- an identifier made by :func:`module_name`, :func:`_pascal` or :func:`_field_name`, which keep
  only ``[A-Za-z0-9_]``.

No schema key can choose an import, a base class, a decorator or a type by name (keys such as
``customTypePath`` or ``x-python-type`` mean nothing here), and every module is parsed with
:func:`ast.parse` before it is handed back.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote

__all__ = [
    "SchemaError",
    "docstring",
    "is_identifier",
    "module_name",
    "module_names",
    "render_package_init",
    "render_tool_module",
]


class SchemaError(Exception):
    """A tool's schema cannot be compiled (the message names the place in the schema)."""


# Names a generated module defines or uses in annotations and field defaults: a generated
# class or field with one of these names would shadow it (Pydantic evaluates annotations
# with the class body's names in scope).
_MODULE_NAMES = frozenset(
    {
        "Annotated",
        "Any",
        "BaseModel",
        "ConfigDict",
        "False",
        "Field",
        "Literal",
        "None",
        "Params",
        "Result",
        "True",
        "bool",
        "dict",
        "float",
        "int",
        "json",
        "list",
        "run",
        "run_tool",
        "str",
    }
)
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
_SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}
_JSON_TYPES = frozenset({*_SCALARS, "array", "object"})
_COMPOSITES = ("anyOf", "oneOf")
_MAX_DEPTH = 64
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_TOKEN = re.compile(r"\b[A-Z][A-Za-z0-9_]*\b")
_WRAP = 96
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---------------------------------------------------------------------------------------------
# Names and literals


def module_name(tool_name: str) -> str:
    """The module name ARCHITECTURE gives a tool (before collisions are resolved).

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
        if ast.literal_eval(literal) == value + ("\n" + indent if "\n" in value else ""):
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


# ---------------------------------------------------------------------------------------------
# Schema compilation


@dataclass
class _Field:
    key: str
    annotation: str
    required: bool
    default: str | None
    description: str | None


@dataclass
class _Class:
    name: str
    doc: str | None
    extra: Literal["allow", "forbid"]
    fields: list[_Field] = field(default_factory=list)


class _Module:
    """Classes of one generated module, in definition order, with module-wide unique names."""

    def __init__(self) -> None:
        self.classes: list[_Class] = []
        self.names: set[str] = set(_MODULE_NAMES)

    def class_name(self, base: str) -> str:
        name, suffix = base, 2
        while name in self.names:
            name, suffix = f"{base}{suffix}", suffix + 1
        self.names.add(name)
        return name


class _Compiler:
    """Compiles one schema (a tool's input or output side) into classes of a :class:`_Module`."""

    def __init__(
        self, module: _Module, root: Mapping[str, Any], root_name: str, prefix: str, side: str
    ) -> None:
        self.module = module
        self.root = root
        self.prefix = prefix
        self.side = side
        self.input_side = side == "inputSchema"
        self.refs: dict[tuple[str, ...], str] = {(): root_name}
        self.resolving: set[tuple[str, ...]] = set()
        self.depth = 0

    def compile_root(self, root_name: str) -> None:
        self._build_class(self.root, root_name, "")

    # -- types ---------------------------------------------------------------------------------

    def type_of(self, schema: Any, hint: str, where: str) -> str:
        self.depth += 1
        try:
            if self.depth > _MAX_DEPTH:
                raise SchemaError(f"{self.side}{where or '/'} is nested more than {_MAX_DEPTH} levels deep")
            return self._type_of(schema, hint, where)
        finally:
            self.depth -= 1

    def _type_of(self, schema: Any, hint: str, where: str) -> str:
        if isinstance(schema, bool):
            return "Any"
        if not isinstance(schema, Mapping):
            raise SchemaError(f"{self.side}{where or '/'} must be a JSON Schema object or boolean")
        if "$ref" in schema:
            return self._with_nullable(schema, self._ref(schema["$ref"], hint, where))
        if "allOf" in schema:
            return self.type_of(self._merge_all_of(schema, where), hint, where)
        for key in _COMPOSITES:
            if key in schema:
                branches = schema[key]
                if not isinstance(branches, list):
                    raise SchemaError(f"{self.side}{where}/{key} must be a list of schemas")
                if any(_has_type_info(branch) for branch in branches):
                    types = [
                        self.type_of(
                            branch, f"{hint}{i + 1}" if len(branches) > 1 else hint, f"{where}/{key}/{i}"
                        )
                        for i, branch in enumerate(branches)
                    ]
                    return self._with_nullable(schema, _union(types))
        if "const" in schema:
            literal = _literal_type([schema["const"]])
            if literal is not None:
                return literal
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list):
                raise SchemaError(f"{self.side}{where}/enum must be a list")
            literal = _literal_type(values)
            if literal is not None:
                return self._with_nullable(schema, literal)
        return self._with_nullable(
            schema,
            _union([self._json_type(t, schema, hint, where) for t in _types(schema, self.side, where)]),
        )

    def _json_type(self, json_type: str, schema: Mapping[str, Any], hint: str, where: str) -> str:
        if json_type == "object":
            return self._object_type(schema, hint, where)
        if json_type == "array":
            items = schema.get("items", True)
            if "prefixItems" in schema or isinstance(items, list):
                item_type = "Any"
            elif isinstance(items, bool | Mapping):
                item_type = self.type_of(items, hint + "Item", where + "/items")
            else:
                raise SchemaError(f"{self.side}{where}/items must be a schema")
            return _constrained(f"list[{item_type}]", _array_constraints(schema))
        if json_type == "any":
            return "Any"
        base = _SCALARS[json_type]
        if json_type in ("integer", "number"):
            return _constrained(base, _number_constraints(schema, integer=json_type == "integer"))
        if json_type == "string":
            return _constrained(base, _string_constraints(schema))
        return base

    def _object_type(self, schema: Mapping[str, Any], hint: str, where: str) -> str:
        properties = schema.get("properties")
        if properties is not None and not isinstance(properties, Mapping):
            raise SchemaError(f"{self.side}{where}/properties must be an object")
        if properties:
            name = self.module.class_name(self.prefix + _pascal(hint))
            self._build_class(schema, name, where)
            return name
        additional = schema.get("additionalProperties", True)
        if isinstance(additional, Mapping) and additional:
            return f"dict[str, {self.type_of(additional, hint + 'Value', where + '/additionalProperties')}]"
        return "dict[str, Any]"

    def _with_nullable(self, schema: Mapping[str, Any], annotation: str) -> str:
        return _union([annotation, "None"]) if schema.get("nullable") is True else annotation

    # -- classes -------------------------------------------------------------------------------

    def _build_class(self, schema: Any, name: str, where: str) -> None:
        if isinstance(schema, Mapping) and "allOf" in schema:
            schema = self._merge_all_of(schema, where)
        if not isinstance(schema, Mapping):
            schema = {}
        properties = schema.get("properties") or {}
        if not isinstance(properties, Mapping):
            raise SchemaError(f"{self.side}{where}/properties must be an object")
        required = schema.get("required") or []
        if not isinstance(required, list):
            raise SchemaError(f"{self.side}{where}/required must be a list of property names")
        if not properties and where == "":
            # A root made only of alternatives (oneOf: [{...}, {...}]) offers each one's
            # properties, all optional: the server checks which combination is valid.
            properties = self._alternative_properties(schema, where)
        additional = schema.get("additionalProperties")
        # Tool arguments refuse unknown names (a typo fails here, not silently on the server)
        # unless the schema allows more; results keep whatever the server adds.
        extra: Literal["allow", "forbid"] = "allow"
        if self.input_side and (additional is False or (additional is None and properties)):
            extra = "forbid"
        cls = _Class(name, _text(schema.get("description")), extra)
        for key, prop in properties.items():
            key = str(key)
            if prop is False:
                continue
            if not _valid_unicode(key):
                raise SchemaError(f"{self.side}{where}: property name {key!r} is not valid Unicode")
            prop_where = f"{where}/properties/{_escape_pointer(key)}"
            annotation = self.type_of(prop, key, prop_where)
            is_required = key in required
            prop_map: Mapping[str, Any] = prop if isinstance(prop, Mapping) else {}
            description = _text(prop_map.get("description"))
            default = None
            if not is_required:
                annotation = _union([annotation, "None"])
                if "default" in prop_map and self._default_fits(prop_map["default"], prop_map, annotation):
                    default = _python_literal(prop_map["default"])
                if default is None:
                    default = "None"
            cls.fields.append(_Field(key, annotation, is_required, default, description))
        self.module.classes.append(cls)

    def _alternative_properties(self, schema: Mapping[str, Any], where: str) -> dict[str, Any]:
        properties: dict[str, Any] = {}
        for key in _COMPOSITES:
            branches = schema.get(key)
            if not isinstance(branches, list):
                continue
            for branch in branches:
                hops = 0
                while isinstance(branch, Mapping) and "$ref" in branch and hops <= _MAX_DEPTH:
                    branch, hops = self._resolve(branch["$ref"])[1], hops + 1
                if isinstance(branch, Mapping) and "allOf" in branch:
                    branch = self._merge_all_of(branch, where)
                branch_properties = branch.get("properties") if isinstance(branch, Mapping) else None
                if isinstance(branch_properties, Mapping):
                    for name, prop in branch_properties.items():
                        properties.setdefault(str(name), prop)
        return properties

    def _default_fits(self, value: Any, schema: Mapping[str, Any], annotation: str) -> bool:
        # A default Pydantic would serialise with a warning (a dict where a model is expected,
        # a value outside the enum, the wrong JSON type) is left to the server to apply.
        if isinstance(value, dict | list) and any(
            token in self.module.names and token not in _MODULE_NAMES
            for token in _NAME_TOKEN.findall(annotation)
        ):
            return False
        return self._value_fits(value, schema, 0)

    def _value_fits(self, value: Any, schema: Any, depth: int) -> bool:
        if not isinstance(schema, Mapping) or depth > 8:
            return True
        if "$ref" in schema:
            try:
                return self._value_fits(value, self._resolve(schema["$ref"])[1], depth + 1)
            except SchemaError:
                return False
        for key in _COMPOSITES:
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                return any(self._value_fits(value, branch, depth + 1) for branch in branches)
        if "const" in schema and not _json_equal(value, schema["const"]):
            return False
        enum = schema.get("enum")
        if isinstance(enum, list) and not any(_json_equal(value, item) for item in enum):
            return False
        types = schema.get("type")
        if isinstance(types, str):
            types = [types]
        if isinstance(types, list) and types:
            kind = _json_kind(value)
            return (
                kind in types
                or (kind == "integer" and "number" in types)
                or (schema.get("nullable") is True and kind == "null")
            )
        return True

    # -- references ----------------------------------------------------------------------------

    def _resolve(self, ref: Any) -> tuple[tuple[str, ...], Any]:
        if not isinstance(ref, str):
            raise SchemaError(f"{self.side}: $ref must be a string, not {ref!r}")
        if not ref.startswith("#"):
            return (), None
        path = tuple(unquote(part).replace("~1", "/").replace("~0", "~") for part in ref[1:].split("/")[1:])
        target: Any = self.root
        for part in path:
            if isinstance(target, Mapping) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"{self.side}: $ref {ref!r} points to nothing in the schema")
        return path, target

    def _ref(self, ref: Any, hint: str, where: str) -> str:
        if isinstance(ref, str) and not ref.startswith("#"):
            return "Any"  # Remote references are never fetched.
        path, target = self._resolve(ref)
        if path in self.refs:
            return self.refs[path]
        if path in self.resolving:
            return "Any"  # A cycle that passes through no class cannot be typed more closely.
        ref_hint = path[-1] if path else hint
        if _is_class_schema(target):
            name = self.module.class_name(self.prefix + _pascal(ref_hint))
            self.refs[path] = name
            self._build_class(target, name, "#/" + "/".join(_escape_pointer(p) for p in path))
            nullable = isinstance(target, Mapping) and (
                target.get("nullable") is True or target.get("type") == ["object", "null"]
            )
            if nullable:
                self.refs[path] = _union([name, "None"])
            return self.refs[path]
        self.resolving.add(path)
        try:
            annotation = self.type_of(target, ref_hint, "#/" + "/".join(_escape_pointer(p) for p in path))
        finally:
            self.resolving.discard(path)
        self.refs[path] = annotation
        return annotation

    def _merge_all_of(self, schema: Mapping[str, Any], where: str, depth: int = 0) -> dict[str, Any]:
        if depth > _MAX_DEPTH:
            raise SchemaError(f"{self.side}{where}/allOf is nested too deeply")
        parts = schema["allOf"]
        if not isinstance(parts, list):
            raise SchemaError(f"{self.side}{where}/allOf must be a list of schemas")
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        properties = dict(merged.get("properties") or {})
        required = list(merged.get("required") or [])
        for i, part in enumerate(parts):
            if isinstance(part, bool):
                continue
            if not isinstance(part, Mapping):
                raise SchemaError(f"{self.side}{where}/allOf/{i} must be a schema")
            hops = 0
            while "$ref" in part and hops <= _MAX_DEPTH:
                _, target = self._resolve(part["$ref"])
                part, hops = (target if isinstance(target, Mapping) else {}), hops + 1
            if "allOf" in part:
                part = self._merge_all_of(part, f"{where}/allOf/{i}", depth + 1)
            part_properties = part.get("properties")
            if isinstance(part_properties, Mapping):
                properties.update(part_properties)
            part_required = part.get("required")
            if isinstance(part_required, list):
                required.extend(part_required)
            for key, value in part.items():
                if key not in ("properties", "required", "$ref"):
                    merged.setdefault(key, value)
        if properties:
            merged["properties"] = properties
            merged.setdefault("type", "object")
        if required:
            merged["required"] = required
        return merged


def _escape_pointer(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _has_type_info(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return isinstance(schema, bool)
    keys = (
        "type",
        "properties",
        "items",
        "enum",
        "const",
        "$ref",
        "anyOf",
        "oneOf",
        "allOf",
        "additionalProperties",
    )
    return any(key in schema for key in keys)


def _is_class_schema(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    if any(key in schema for key in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")):
        return False
    types = schema.get("type", "object")
    types = [types] if isinstance(types, str) else types
    properties = schema.get("properties")
    return (
        isinstance(types, list)
        and "object" in types
        and set(types) <= {"object", "null"}
        and isinstance(properties, Mapping)
        and bool(properties)
    )


def _types(schema: Mapping[str, Any], side: str, where: str) -> list[str]:
    declared = schema.get("type")
    if declared is None:
        if "properties" in schema or "additionalProperties" in schema:
            return ["object"]
        if "items" in schema or "prefixItems" in schema:
            return ["array"]
        return ["any"]
    types = [declared] if isinstance(declared, str) else declared
    if (
        not isinstance(types, list)
        or not all(isinstance(t, str) and t in _JSON_TYPES for t in types)
        or not types
    ):
        raise SchemaError(
            f"{side}{where}/type must be one of {sorted(_JSON_TYPES)} or a list of them, not {declared!r}"
        )
    return list(dict.fromkeys(types))


def _union(types: Sequence[str]) -> str:
    members: list[str] = []
    for annotation in types:
        for member in _split_union(annotation):
            if member not in members:
                members.append(member)
    if "Any" in members:
        return "Any"
    if "None" in members:
        members.remove("None")
        members.append("None")
    return " | ".join(members)


def _split_union(annotation: str) -> list[str]:
    """The top-level members of a ``A | B`` annotation (``|`` inside brackets or quotes is not one)."""
    if "|" not in annotation:
        return [annotation]
    members, depth, start, quote, i = [], 0, 0, "", 0
    while i < len(annotation):
        char = annotation[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "|" and depth == 0:
            members.append(annotation[start:i].strip())
            start = i + 1
        i += 1
    members.append(annotation[start:].strip())
    return members


def _literal_type(values: list[Any]) -> str | None:
    # Literal only for values Pydantic compares exactly; others fall back to the JSON type.
    if not values or not all(
        value is None
        or isinstance(value, bool)
        or (isinstance(value, str) and _valid_unicode(value))
        or (isinstance(value, int) and abs(value) < 2**63)
        for value in values
    ):
        return None
    unique: list[Any] = []
    for value in values:
        if not any(_json_equal(value, seen) for seen in unique):
            unique.append(value)
    members = [repr(value) for value in unique if value is not None]
    if not members:
        return "None"
    literal = f"Literal[{', '.join(members)}]"
    return literal + " | None" if None in unique else literal


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _number_constraints(schema: Mapping[str, Any], integer: bool) -> dict[str, str]:
    bounds: dict[str, int | float] = {}
    for key, name in (
        ("minimum", "ge"),
        ("maximum", "le"),
        ("exclusiveMinimum", "gt"),
        ("exclusiveMaximum", "lt"),
    ):
        value = _number(schema.get(key))
        if value is not None:
            bounds[name] = value
    # Draft 4 spells exclusive bounds as booleans beside minimum / maximum.
    for key, inclusive, exclusive in (("exclusiveMinimum", "ge", "gt"), ("exclusiveMaximum", "le", "lt")):
        if schema.get(key) is True and inclusive in bounds:
            bounds[exclusive] = bounds.pop(inclusive)
    multiple = _number(schema.get("multipleOf"))
    if multiple is not None and multiple > 0:
        bounds["multiple_of"] = multiple
    if integer:
        bounds = _integer_bounds(bounds)
    constraints: dict[str, str] = {}
    for name, value in bounds.items():
        try:
            constraints[name] = repr(value)
        except ValueError:  # an int with more digits than Python will print
            pass
    return constraints


def _integer_bounds(bounds: dict[str, int | float]) -> dict[str, int | float]:
    """Bounds Pydantic accepts on an ``int``: integers only (a fractional bound is rounded inwards)."""
    result: dict[str, int | float] = {}
    for name, value in bounds.items():
        if isinstance(value, int) or value.is_integer():
            result[name] = int(value)
        elif name in ("ge", "gt"):
            result.setdefault("ge", math.ceil(value))
        elif name in ("le", "lt"):
            result.setdefault("le", math.floor(value))
        # A fractional multipleOf cannot be checked on an int here; the server checks it.
    return result


def _string_constraints(schema: Mapping[str, Any]) -> dict[str, str]:
    constraints = _length_constraints(schema, "minLength", "maxLength")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _valid_unicode(pattern):
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError):
            pass  # Not a Python regex: the server still validates it.
        else:
            constraints["pattern"] = repr(pattern)
    return constraints


def _array_constraints(schema: Mapping[str, Any]) -> dict[str, str]:
    return _length_constraints(schema, "minItems", "maxItems")


def _length_constraints(schema: Mapping[str, Any], low: str, high: str) -> dict[str, str]:
    constraints: dict[str, str] = {}
    for key, name in ((low, "min_length"), (high, "max_length")):
        value = schema.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            constraints[name] = repr(value)
    return constraints


def _constrained(base: str, constraints: Mapping[str, str]) -> str:
    if not constraints:
        return base
    arguments = ", ".join(f"{name}={value}" for name, value in constraints.items())
    return f"Annotated[{base}, Field({arguments})]"


# ---------------------------------------------------------------------------------------------
# Rendering


def _render_class(cls: _Class, reserved: set[str]) -> str:
    lines = [f"class {cls.name}(_Model):"]
    if cls.doc:
        lines.append(f"    {docstring(cls.doc, '    ')}")
    if cls.extra == "forbid":
        lines.append("    model_config = ConfigDict(extra='forbid')")
    used: set[str] = set()
    for item in cls.fields:
        base = _field_name(item.key)
        if base in reserved:
            base += "_"
        name, suffix = base, 2
        while name in used or name in reserved:
            name, suffix = f"{base}_{suffix}", suffix + 1
        used.add(name)
        arguments: list[str] = []
        if not item.required:
            arguments.append(item.default or "None")
        if name != item.key:
            arguments.append(f"alias={str_literal(item.key)}")
        if item.description is not None:
            arguments.append(f"description={str_literal(item.description)}")
        if item.required and not arguments:
            lines.append(f"    {name}: {item.annotation}")
        elif not item.required and len(arguments) == 1:
            lines.append(f"    {name}: {item.annotation} = {arguments[0]}")
        else:
            lines.append(f"    {name}: {item.annotation} = Field({', '.join(arguments)})")
    if len(lines) == 1:
        lines.append("    pass")
    return "\n".join(lines)


_HEADER = """from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ipybox.tool_exec.client import run_tool


class _Model(BaseModel):
    # defer_build: a model is compiled when first used, so importing a module costs little
    # and forward references (recursive schemas) resolve without model_rebuild().
    model_config = ConfigDict(
        defer_build=True,
        extra='allow',
        validate_by_name=True,
        validate_by_alias=True,
        protected_namespaces=(),
        regex_engine='python-re',
    )
"""


def render_tool_module(
    server_name: str,
    tool_name: str,
    description: str | None,
    input_schema: Any,
    output_schema: Any,
    title: str | None = None,
) -> str:
    """Python source of the module for one tool.

    Args:
        server_name: The package name (a valid identifier), passed to ``run_tool``.
        tool_name: The tool's name on the MCP server.
        description: The tool's description (``run``'s docstring).
        input_schema: The tool's input schema (``Params``).
        output_schema: The tool's output schema (``Result``), or ``None`` when ``run`` returns ``str``.
        title: The tool's human-readable title, if any.

    Returns:
        The module's source code (checked with ``ast.parse``).

    Raises:
        SchemaError: A schema cannot be compiled.
    """
    if not isinstance(input_schema, Mapping):
        raise SchemaError("inputSchema must be a JSON Schema object")
    if output_schema is not None and not isinstance(output_schema, Mapping):
        raise SchemaError("outputSchema must be a JSON Schema object")
    module = _Module()
    try:
        _Compiler(module, input_schema, "Params", "", "inputSchema").compile_root("Params")
        if output_schema is not None:
            _Compiler(module, output_schema, "Result", "Result", "outputSchema").compile_root("Result")
    except RecursionError as exc:
        raise SchemaError("a schema is nested too deeply") from exc

    heading = f"Tool {tool_name!r} of the MCP server {server_name!r}"
    if title and title.strip() and title.strip() != tool_name:
        heading += f": {title.strip()}"
    module_doc = (
        f"{heading}.\n\nGenerated by ipybox from the server's tool schema; regenerate rather than edit.\n"
        "Call it with `run(Params(...))`."
    )
    reserved = set(module.names)
    parts = [docstring(module_doc), "", _HEADER]
    for cls in module.classes:
        parts.append("")
        parts.append(_render_class(cls, reserved))
        parts.append("")

    returns = "Result" if output_schema is not None else "str"
    doc = (
        description.strip()
        if isinstance(description, str) and description.strip()
        else f"Call the tool {tool_name!r}."
    )
    call = (
        f"run_tool({str_literal(server_name)}, {str_literal(tool_name)}, "
        "params.model_dump(mode='json', by_alias=True, exclude_none=True))"
    )
    parts.append("")
    parts.append(f"def run(params: Params) -> {returns}:")
    parts.append(f"    {docstring(doc, '    ')}")
    parts.append(f"    result = {call}")
    if output_schema is not None:
        parts.append("    return Result.model_validate(result)")
    else:
        parts.append("    return result if isinstance(result, str) else json.dumps(result)")
    code = "\n".join(parts) + "\n"
    _check_parses(code, tool_name)
    return code


def render_package_init(server_name: str, tools: Sequence[tuple[str, str, str | None]]) -> str:
    """Python source of the package's ``__init__.py``: a docstring listing the tool modules.

    Args:
        server_name: The package name.
        tools: ``(module name, tool name, description)`` of each generated module.

    Returns:
        The source code (checked with ``ast.parse``).
    """
    lines = [
        f"Python API of the MCP server {server_name!r}, generated by ipybox (regenerate rather than edit).",
        "",
        "Each module wraps one tool: build its `Params`, call `run(params)`. Modules:",
        "",
    ]
    for module, tool_name, description in sorted(tools):
        entry = f"- {module}"
        if tool_name != module:
            entry += f" (tool {tool_name!r})"
        summary = _first_line(description) if isinstance(description, str) else ""
        lines.append(f"{entry}: {summary}" if summary else entry)
    if not tools:
        lines.append("(the server offers no tools)")
    code = docstring("\n".join(lines)) + "\n"
    _check_parses(code, "__init__")
    return code


def _check_parses(code: str, what: str) -> None:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError) as exc:  # pragma: no cover - a bug in this module
        raise SchemaError(f"generated code for {what!r} does not parse ({exc}); please report this") from exc


def is_identifier(name: str) -> bool:
    """Whether ``name`` is an ASCII Python identifier that is not a keyword."""
    return bool(_IDENTIFIER.fullmatch(name)) and not keyword.iskeyword(name)
