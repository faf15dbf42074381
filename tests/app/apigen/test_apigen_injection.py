"""Property-based tests: hostile tool names, descriptions and schemas never break or inject code.

Every text an MCP server controls (tool names, titles, descriptions, property names, ``$defs``
names, enum values, defaults, patterns, formats, ``customTypePath``-style keys) is drawn from
fragments that end string literals, comments and lines (quotes, triple quotes, backslashes,
newlines, ``#``, NUL, lone surrogates, keywords, leading digits) mixed with a payload that
creates a canary file when executed. Every generated file must parse, import only what
generated code may import, import cleanly, carry the texts unchanged, and leave no canary.
"""

from __future__ import annotations

# private-ok: the code generator's renderer (ipybox.app.apigen._generate, _codegen) gets hostile schemas
# directly, thousands per run; generate_mcp_sources runs it against real MCP servers elsewhere.
import ast
import inspect
import itertools
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp.types import Tool

from ipybox.app.apigen._codegen import docstring
from ipybox.app.apigen._generate import render_sources
from tests.app.apigen.apigen_support import check_source, import_module, importable, write_sources

CANARY = Path(tempfile.mkdtemp(prefix="ipybox-canary-")) / "CANARY"
PAYLOAD = f"__import__('pathlib').Path({str(CANARY)!r}).touch()"
PAYLOADS = [
    f'"""\n{PAYLOAD}\n"""',
    f"'''\n{PAYLOAD}\n'''",
    f"'\n{PAYLOAD}\n'",
    f'"); {PAYLOAD}; ("',
    f"\\\n{PAYLOAD}",
    f"]\n{PAYLOAD}\n#",
    f"\n{PAYLOAD}  # ",
    f"{{{PAYLOAD}}}",
]
FRAGMENTS = [
    '"',
    "'",
    '"""',
    "'''",
    '""""',
    "\\",
    "\\n",
    "\n",
    "\r",
    "\r\n",
    "\t",
    "#",
    "\x00",
    "\x0c",
    "\u2028",
    "\ud800",
    "\u00e9",
    "\u65e5\u672c",
    "class",
    "None",
    "1st",
    "_",
    "__init__",
    "model_config",
    "Params",
    "Result",
    "str",
    "Field",
    "-",
    " ",
    "|",
    "[",
    "]",
    "%",
    "~",
    "/",
    "${SECRET}",
]
SURROGATE = re.compile("[\ud800-\udfff]")
_packages = itertools.count()

hostile_text = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS + PAYLOADS), st.text(max_size=3)), max_size=5
).map("".join)
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    hostile_text,
)
json_value = st.recursive(
    scalar,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(hostile_text, children, max_size=3)
    ),
    max_leaves=6,
)
annotations_keys = st.fixed_dictionaries(
    {},
    optional={
        "description": hostile_text,
        "title": hostile_text,
        "default": json_value,
        "format": hostile_text,
        "pattern": hostile_text,
        "customTypePath": st.sampled_from(["os.system", PAYLOAD, "builtins.exec"]),
        "customBasePath": st.sampled_from(["subprocess.Popen", PAYLOAD]),
        "x-python-type": hostile_text,
        "x-python-import": st.just({"import": "os", "from": "os"}),
        "nullable": st.booleans(),
        "minimum": scalar,
        "maximum": scalar,
        "exclusiveMinimum": scalar,
        "exclusiveMaximum": scalar,
        "multipleOf": scalar,
        "minLength": scalar,
        "maxLength": st.integers(min_value=-1, max_value=2**70),
        "minItems": st.integers(min_value=-1, max_value=2**70),
        "maxItems": scalar,
        "uniqueItems": st.booleans(),
        "additionalProperties": st.booleans(),
        "required": st.lists(hostile_text, max_size=2),
    },
)


def _pointer(name: str) -> str:
    return "#/$defs/" + name.replace("~", "~0").replace("/", "~1").replace("%", "%25")


def _with(extra: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    return {**extra, **schema}


class _Ref:
    """A ``$ref`` leaf, resolved once the definitions are drawn to the pointer of one of them."""

    def __init__(self, index: int) -> None:
        self.index = index


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    properties = st.dictionaries(hostile_text, children, max_size=4)
    return st.one_of(
        st.builds(
            _with,
            annotations_keys,
            st.fixed_dictionaries({"type": st.just("object"), "properties": properties}),
        ),
        st.builds(
            _with, annotations_keys, st.fixed_dictionaries({"type": st.just("array"), "items": children})
        ),
        st.builds(
            _with,
            annotations_keys,
            st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=3)}),
        ),
        st.builds(
            _with,
            annotations_keys,
            st.fixed_dictionaries({"oneOf": st.lists(children, min_size=1, max_size=3)}),
        ),
        st.builds(
            _with,
            annotations_keys,
            st.fixed_dictionaries({"allOf": st.lists(children, min_size=1, max_size=2)}),
        ),
        st.builds(_with, annotations_keys, st.fixed_dictionaries({"additionalProperties": children})),
    )


# Built once: a recursive strategy built inside each draw is validated again each time, which cost
# most of this module's minutes.
schemas = st.recursive(
    st.one_of(
        st.builds(
            _with,
            annotations_keys,
            st.fixed_dictionaries(
                {"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}
            ),
        ),
        st.builds(
            _with, annotations_keys, st.fixed_dictionaries({"enum": st.lists(scalar, min_size=1, max_size=4)})
        ),
        st.builds(_with, annotations_keys, st.fixed_dictionaries({"const": scalar})),
        st.builds(
            _with,
            annotations_keys,
            st.fixed_dictionaries(
                {
                    "type": st.lists(
                        st.sampled_from(["string", "integer", "null", "array"]),
                        min_size=1,
                        max_size=3,
                        unique=True,
                    )
                }
            ),
        ),
        st.builds(_Ref, st.integers(min_value=0, max_value=2)),
    ),
    _extend,
    max_leaves=8,
)


def _resolve(value: Any, def_names: list[str]) -> Any:
    """`value` with each `_Ref` made a ``$ref`` to one of `def_names` (a plain type when there are none)."""
    if isinstance(value, _Ref):
        if not def_names:
            return {"type": "string"}
        return {"$ref": _pointer(def_names[value.index % len(def_names)])}
    if isinstance(value, dict):
        return {key: _resolve(item, def_names) for key, item in value.items()}
    if isinstance(value, list):
        return [_resolve(item, def_names) for item in value]
    return value


@st.composite
def tool_lists(draw: st.DrawFn) -> list[Tool]:
    def_names = draw(st.lists(hostile_text, max_size=3, unique=True))
    schema = schemas.map(lambda value: _resolve(value, def_names))
    defs = {name: draw(schema) for name in def_names}
    tools = []
    for name in draw(st.lists(hostile_text, min_size=1, max_size=3, unique=True)):
        properties = draw(st.dictionaries(hostile_text, schema, max_size=5))
        input_schema: dict[str, Any] = {"type": "object", "properties": properties, "$defs": defs}
        if properties:
            input_schema["required"] = draw(
                st.lists(st.sampled_from(sorted(properties)), max_size=3, unique=True)
            )
        input_schema.update(draw(annotations_keys))
        output_schema = draw(
            st.none()
            | st.builds(
                lambda p: {"type": "object", "properties": p, "$defs": defs},
                st.dictionaries(hostile_text, schema, max_size=3),
            )
        )
        tools.append(
            Tool(
                name=name,
                title=draw(st.none() | hostile_text),
                description=draw(st.none() | hostile_text),
                input_schema=input_schema,
                output_schema=output_schema,
            )
        )
    return tools


@pytest.fixture(autouse=True, scope="module")
def _remove_the_canary_folder() -> Iterator[None]:
    yield
    shutil.rmtree(CANARY.parent, ignore_errors=True)


def test_the_canary_payload_really_creates_the_canary_when_executed() -> None:
    exec(compile(PAYLOAD, "<payload>", "exec"))
    assert CANARY.exists()
    CANARY.unlink()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(tools=tool_lists())
@pytest.mark.slow
# 80 examples of generating and importing modules: on a loaded 2-core machine they ran past the
# default 120 s (the examples themselves have no deadline).
@pytest.mark.timeout(600)
def test_hostile_tools_generate_modules_that_parse_import_and_never_run_injected_text(
    tools: list[Tool],
) -> None:
    package = f"hostile_{next(_packages)}"
    sources = render_sources(package, tools)
    root = Path(tempfile.mkdtemp(prefix="ipybox-hostile-"))
    try:
        for code in sources.values():
            check_source(code)
        write_sources(root, package, sources)
        with importable(root):
            import_module(package, "__init__")
            for module_name, tool in _modules_by_tool(sources, tools).items():
                module = import_module(package, module_name)
                _check_module(module, sources[module_name], package, tool)
        assert not CANARY.exists(), "text from a tool schema was executed"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _modules_by_tool(sources: dict[str, str], tools: list[Tool]) -> dict[str, Tool]:
    """Pair each generated module with its tool, through the tool name passed to ``run_tool``."""
    by_name = {tool.name: tool for tool in tools}
    pairs = {}
    for module_name, code in sources.items():
        if module_name == "__init__":
            continue
        call = next(
            node
            for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "run_tool"
        )
        pairs[module_name] = by_name[ast.literal_eval(call.args[1])]
    return pairs


def _key(name: str, info: Any) -> str:
    return info.alias if info.alias is not None else name


def _check_module(module: Any, code: str, package: str, tool: Tool) -> None:
    params = module.Params
    params.model_rebuild(force=True)
    keys = {key for key, prop in (tool.input_schema.get("properties") or {}).items() if prop is not False}
    if keys:
        assert {_key(name, info) for name, info in params.model_fields.items()} == keys
    for name, info in params.model_fields.items():
        prop = tool.input_schema["properties"][_key(name, info)]
        description = prop.get("description") if isinstance(prop, dict) else None
        if isinstance(description, str) and description.strip():
            assert info.description == SURROGATE.sub("\ufffd", description)
    if tool.output_schema is not None:
        module.Result.model_rebuild(force=True)
        assert inspect.signature(module.run).return_annotation == "Result"
    else:
        assert inspect.signature(module.run).return_annotation == "str"
    description = tool.description or ""
    doc = module.run.__doc__ or ""
    if description.strip():
        assert "".join(doc.split()) == "".join(SURROGATE.sub("\ufffd", description).split())
    call = next(
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "run_tool"
    )
    assert ast.literal_eval(call.args[0]) == package
    assert ast.literal_eval(call.args[1]) == tool.name


@pytest.mark.parametrize(
    "text", ['"""', 'ends with a quote"', "a\\b", 'x""""y', "nul\x00and\x1bescape", "tab\there"]
)
def test_the_docstring_escaper_itself_gives_a_triple_quoted_literal_that_reads_back(text: str) -> None:
    literal = docstring(text)
    assert literal.startswith('"""') and literal.endswith('"""'), literal  # not the repr fallback
    assert ast.literal_eval(literal) == text.strip()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=80))
def test_the_docstring_escaper_reads_back_any_single_line(text: str) -> None:
    literal = docstring(text)
    assert literal.startswith('"""'), literal
    assert ast.literal_eval(literal) == text.strip()
