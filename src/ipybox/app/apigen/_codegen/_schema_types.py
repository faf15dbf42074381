"""Schema pieces to annotation text: types, unions, literals, ``allOf`` parts and constraints.

Application side only: the helpers :class:`ipybox.app.apigen._codegen._schema._Compiler` builds a
field's annotation with (what a ``type`` list allows, ``X | Y`` unions and ``Literal[...]``,
numeric, string and array bounds as ``Field`` arguments). They hold no state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ipybox.app.apigen._codegen._names import SchemaError, _json_equal, _valid_unicode

_SCALARS = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


_JSON_TYPES = frozenset({*_SCALARS, "array", "object"})


def _merge_part(
    part: Mapping[str, Any], merged: dict[str, Any], properties: dict[str, Any], required: list[Any]
) -> None:
    """Add one ``allOf`` part: its properties and required names, and its other keys not yet set."""
    part_properties = part.get("properties")
    if isinstance(part_properties, Mapping):
        properties.update(part_properties)
    part_required = part.get("required")
    if isinstance(part_required, list):
        required.extend(part_required)
    for key, value in part.items():
        if key not in ("properties", "required", "$ref"):
            merged.setdefault(key, value)


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
