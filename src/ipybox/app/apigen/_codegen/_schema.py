"""Schema compilation: a tool's input or output JSON Schema to the classes of one module."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote

from ipybox.app.apigen._codegen._names import (
    _MAX_DEPTH,
    SchemaError,
    _json_equal,
    _json_kind,
    _pascal,
    _python_literal,
    _text,
    _valid_unicode,
)
from ipybox.app.apigen._codegen._schema_types import (
    _SCALARS,
    _array_constraints,
    _constrained,
    _escape_pointer,
    _has_type_info,
    _is_class_schema,
    _literal_type,
    _merge_part,
    _number_constraints,
    _string_constraints,
    _types,
    _union,
)

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
        "ToolContent",
        "True",
        "bool",
        "dict",
        "float",
        "int",
        "json",
        "list",
        "_arguments",
        "arun",
        "arun_content",
        "arun_tool",
        "arun_tool_content",
        "run",
        "run_content",
        "run_tool",
        "run_tool_content",
        "str",
    }
)
_COMPOSITES = ("anyOf", "oneOf")
_NAME_TOKEN = re.compile(r"\b[A-Z][A-Za-z0-9_]*\b")


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
        composite = self._composite_type(schema, hint, where)
        if composite is not None:
            return composite
        literal = self._literal_of(schema, where)
        if literal is not None:
            return literal
        return self._with_nullable(
            schema,
            _union([self._json_type(t, schema, hint, where) for t in _types(schema, self.side, where)]),
        )

    def _composite_type(self, schema: Mapping[str, Any], hint: str, where: str) -> str | None:
        """The union of the first ``anyOf`` / ``oneOf`` with typed branches, else ``None``."""
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
        return None

    def _literal_of(self, schema: Mapping[str, Any], where: str) -> str | None:
        """The ``Literal`` of a ``const`` or ``enum`` schema, else ``None``."""
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
        return None

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
        # An argument object that admits no properties at all is a class with no fields that
        # refuses every name, not an open dict.
        if properties or (self.input_side and schema.get("additionalProperties") is False):
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
            cls.fields.append(self._build_field(key, prop, key in required, where))
        self.module.classes.append(cls)

    def _build_field(self, key: str, prop: Any, is_required: bool, where: str) -> _Field:
        """The field of property `key` (schema `prop`) of the class at `where`."""
        if not _valid_unicode(key):
            raise SchemaError(f"{self.side}{where}: property name {key!r} is not valid Unicode")
        prop_where = f"{where}/properties/{_escape_pointer(key)}"
        annotation = self.type_of(prop, key, prop_where)
        prop_map: Mapping[str, Any] = prop if isinstance(prop, Mapping) else {}
        description = _text(prop_map.get("description"))
        default = None
        if not is_required:
            annotation = _union([annotation, "None"])
            if "default" in prop_map and self._default_fits(prop_map["default"], prop_map, annotation):
                default = _python_literal(prop_map["default"])
            if default is None:
                default = "None"
        return _Field(key, annotation, is_required, default, description)

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
            part = self._all_of_part(part, f"{where}/allOf/{i}", depth)
            _merge_part(part, merged, properties, required)
        if properties:
            merged["properties"] = properties
            merged.setdefault("type", "object")
        if required:
            merged["required"] = required
        return merged

    def _all_of_part(self, part: Any, where: str, depth: int) -> Mapping[str, Any]:
        """Part `part` of an ``allOf`` at `where`, its ``$ref`` followed and its own ``allOf`` merged."""
        if not isinstance(part, Mapping):
            raise SchemaError(f"{self.side}{where} must be a schema")
        resolved: Mapping[str, Any] = part
        hops = 0
        while "$ref" in resolved and hops <= _MAX_DEPTH:
            _, target = self._resolve(resolved["$ref"])
            resolved, hops = (target if isinstance(target, Mapping) else {}), hops + 1
        if "allOf" in resolved:
            resolved = self._merge_all_of(resolved, where, depth + 1)
        return resolved
