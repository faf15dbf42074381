"""Tests of ipybox.mcp_apigen: typed Python modules from MCP tool schemas.

Schema-to-code behaviour is tested on ``mcp.types.Tool`` values (what the MCP SDK lists) and
by importing the generated modules; ``generate_mcp_sources`` itself is tested against real MCP
servers started as subprocesses (tests/app/apigen/tools_server.py serves any tool list).
"""

from __future__ import annotations

# private-ok: schema-to-code cases go through the renderer and the name rules (ipybox.app.apigen._generate,
# _codegen) on `Tool` values; the public generate_mcp_sources is tested against real servers.
import inspect
import json
import logging
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ipybox.app.apigen._codegen import module_name, module_names
from ipybox.app.apigen._generate import render_sources
from ipybox.errors import MCPServerError, ServerParamsError
from ipybox.mcp_apigen import generate_mcp_sources
from ipybox.tool_exec.server import ServerRegistry
from tests.app.apigen.apigen_support import (
    TOOLS_SERVER,
    check_source,
    import_module,
    importable,
    tool,
    unique_package,
    write_sources,
)


@pytest.fixture
def import_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "pkgs"
    root.mkdir()
    with importable(root):
        yield root


def generate(root: Path, tools: list[Any]) -> tuple[str, dict[str, str]]:
    package = unique_package()
    sources = render_sources(package, tools)
    for code in sources.values():
        check_source(code)
    write_sources(root, package, sources)
    return package, sources


def listing(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def tools_server_params(tmp_path: Path, tools: list[dict[str, Any]]) -> dict[str, Any]:
    path = tmp_path / f"tools_{len(list(tmp_path.glob('tools_*.json')))}.json"
    path.write_text(json.dumps(tools), encoding="utf-8")
    return {"command": sys.executable, "args": [str(TOOLS_SERVER), "--tools", str(path)]}


# --- module names --------------------------------------------------------------------------------


def test_module_names_follow_the_architecture_rules() -> None:
    assert module_name("tool-1") == "tool_1"
    assert module_name("Get Weather") == "get_weather"
    assert module_name("class") == "class_"
    assert module_name("1st") == "_1st"
    assert module_name("näme.v2") == "n_me_v2"
    assert module_name("") == "_"


def test_colliding_tool_names_get_distinct_names_independent_of_server_order() -> None:
    names = ["a-b", "a_b", "A-B", "__init__"]
    assigned = dict(zip(names, module_names(names), strict=True))
    assert assigned["a_b"] == "a_b"  # a tool whose name already is an identifier keeps it
    assert len(set(assigned.values())) == len(names)
    assert "__init__" not in assigned.values()
    reordered = list(reversed(names))
    assert dict(zip(reordered, module_names(reordered), strict=True)) == assigned


async def test_a_server_name_that_is_not_a_package_name_is_rejected(tmp_path: Path) -> None:
    for name in ["my-server", "1st", "class", "", "sérveur", "a b"]:
        with pytest.raises(ServerParamsError, match="cannot name a Python package"):
            await generate_mcp_sources(name, {"command": "never-started"}, tmp_path)
    assert [name for name in listing(tmp_path) if name != "state"] == []


# --- Params and Result ---------------------------------------------------------------------------

RICH_INPUT = {
    "type": "object",
    "description": "Search the catalogue.",
    "$defs": {
        "Address": {
            "type": "object",
            "description": "Where to ship.",
            "properties": {"street": {"type": "string"}, "city": {"type": "string", "minLength": 1}},
            "required": ["street", "city"],
        },
        "Mode": {"type": "string", "enum": ["fast", "exact", "fuzzy match"]},
    },
    "properties": {
        "query": {"type": "string", "description": "What to look for."},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
        "mode": {"$ref": "#/$defs/Mode", "default": "fast"},
        "ship_to": {"$ref": "#/$defs/Address"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "filters": {
            "type": "object",
            "properties": {
                "price": {
                    "type": "object",
                    "properties": {"max": {"type": "number"}, "min": {"type": "number"}},
                }
            },
        },
        "id": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]+$"}]},
        "note": {"type": ["string", "null"]},
        "legacy": {"type": "string", "nullable": True},
        "1st-choice": {"type": "boolean", "description": "Not an identifier."},
        "class": {"type": "string"},
        "model_config": {"type": "string"},
        "json": {"type": "integer"},
        "str": {"type": "string", "default": "x"},
        "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["query", "ship_to"],
    "additionalProperties": False,
}


def test_params_cover_nested_objects_arrays_enums_refs_unions_and_defaults(import_root: Path) -> None:
    package, _ = generate(import_root, [tool("search", RICH_INPUT, description="Search things.")])
    search = import_module(package, "search")
    Params = search.Params

    params = Params(query="q", ship_to={"street": "Main St", "city": "Bonn"})
    assert params.limit == 10 and params.mode == "fast" and params.str_ == "x"
    assert isinstance(params.ship_to, search.Address)
    assert search.Address.__doc__ == "Where to ship."
    assert Params.model_fields["query"].description == "What to look for."
    assert Params.model_fields["field_1st_choice"].description == "Not an identifier."

    full = Params.model_validate(
        {
            "query": "q",
            "ship_to": {"street": "s", "city": "c"},
            "mode": "fuzzy match",
            "tags": ["a", "b"],
            "filters": {"price": {"max": 9.5}},
            "id": "abc",
            "note": None,
            "legacy": None,
            "1st-choice": True,
            "class": "k",
            "model_config": "m",
            "json": 3,
            "meta": {"a": 1},
        }
    )
    assert full.model_dump(mode="json", by_alias=True, exclude_none=True) == {
        "query": "q",
        "limit": 10,
        "mode": "fuzzy match",
        "ship_to": {"street": "s", "city": "c"},
        "tags": ["a", "b"],
        "filters": {"price": {"max": 9.5}},
        "id": "abc",
        "1st-choice": True,
        "class": "k",
        "model_config": "m",
        "json": 3,
        "str": "x",
        "meta": {"a": 1},
    }
    # Python names work as well as the schema's names.
    assert Params(query="q", ship_to=params.ship_to, field_1st_choice=False, class_="k").class_ == "k"
    assert Params(query="q", ship_to=params.ship_to, id=7).id == 7

    for bad in [
        {"ship_to": {"street": "s", "city": "c"}},  # required field missing
        {"query": "q", "ship_to": {"street": "s", "city": ""}},  # minLength
        {"query": "q", "ship_to": {"street": "s", "city": "c"}, "mode": "slow"},  # enum
        {"query": "q", "ship_to": {"street": "s", "city": "c"}, "limit": 0},  # minimum
        {"query": "q", "ship_to": {"street": "s", "city": "c"}, "tags": ["1", "2", "3", "4"]},  # maxItems
        {"query": "q", "ship_to": {"street": "s", "city": "c"}, "id": "ABC"},  # pattern
        {"query": "q", "ship_to": {"street": "s", "city": "c"}, "qeury": "typo"},  # additionalProperties
    ]:
        with pytest.raises(ValidationError):
            Params.model_validate(bad)

    run = search.run
    assert inspect.getdoc(run) == "Search things."
    assert inspect.signature(run).return_annotation == "str"
    assert "Params" in inspect.signature(run).parameters["params"].annotation


def test_output_schema_gives_a_result_model_whose_classes_do_not_collide_with_the_input_side(
    import_root: Path,
) -> None:
    input_schema = {
        "type": "object",
        "$defs": {
            "Address": {
                "type": "object",
                "properties": {"street": {"type": "string"}},
                "required": ["street"],
            }
        },
        "properties": {"address": {"$ref": "#/$defs/Address"}},
        "required": ["address"],
    }
    output_schema = {
        "type": "object",
        "$defs": {
            "Address": {"type": "object", "properties": {"line": {"type": "integer"}}, "required": ["line"]}
        },
        "properties": {
            "address": {"$ref": "#/$defs/Address"},
            "items": {"type": "array", "items": {"$ref": "#/$defs/Address"}},
        },
        "required": ["address"],
    }
    package, _ = generate(import_root, [tool("lookup", input_schema, output_schema, description="Look up.")])
    lookup = import_module(package, "lookup")

    assert lookup.Params(address={"street": "s"}).address.street == "s"
    result = lookup.Result.model_validate({"address": {"line": 3}, "items": [{"line": 4}], "extra": "kept"})
    assert result.address.line == 3 and result.items[0].line == 4
    assert type(result.address) is not lookup.Address
    assert result.model_extra == {"extra": "kept"}
    assert inspect.signature(lookup.run).return_annotation == "Result"


def test_recursive_and_combined_schemas_generate_complete_models(import_root: Path) -> None:
    tree = {
        "type": "object",
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                },
            },
            "Ping": {"type": "object", "properties": {"pong": {"$ref": "#/$defs/Pong"}}},
            "Pong": {"type": "object", "properties": {"ping": {"$ref": "#/$defs/Ping"}}},
            "Loop": {"anyOf": [{"$ref": "#/$defs/Loop"}, {"type": "string"}]},
        },
        "properties": {
            "root": {"$ref": "#/$defs/Node"},
            "ping": {"$ref": "#/$defs/Ping"},
            "loop": {"$ref": "#/$defs/Loop"},
            "again": {"$ref": "#"},
            "both": {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "string"}}},
                ]
            },
            "choice": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                        "required": ["kind"],
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                        "required": ["kind"],
                    },
                ]
            },
        },
    }
    alternatives = {
        "type": "object",
        "oneOf": [
            {"properties": {"path": {"type": "string"}}, "required": ["path"]},
            {"properties": {"url": {"type": "string"}}, "required": ["url"]},
        ],
    }
    package, _ = generate(import_root, [tool("tree", tree), tool("fetch", alternatives)])
    mod = import_module(package, "tree")

    params = mod.Params.model_validate(
        {
            "root": {"value": 1, "children": [{"value": 2, "children": []}]},
            "ping": {"pong": {"ping": {}}},
            "loop": "x",
            "again": {"root": {"value": 3}},
            "both": {"a": 1, "b": "two"},
            "choice": {"kind": "square", "side": 2},
        }
    )
    assert params.root.children[0].value == 2
    assert params.again.root.value == 3
    assert params.both.a == 1 and params.both.b == "two"
    assert params.choice.kind == "square"
    with pytest.raises(ValidationError):
        mod.Params.model_validate({"both": {"b": "no a"}})

    fetch = import_module(package, "fetch")
    assert fetch.Params(url="u").model_dump(exclude_none=True) == {"url": "u"}


def test_schema_keys_that_name_python_code_have_no_effect(import_root: Path, tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    payload = f"__import__('pathlib').Path({str(canary)!r}).touch()"
    schema = {
        "type": "object",
        "customTypePath": "os.system",
        "customBasePath": "subprocess.Popen",
        "x-python-import": {"import": "os", "from": "os"},
        "properties": {
            "a": {
                "type": "string",
                "customTypePath": f"builtins.exec({payload})",
                "x-python-type": "os.PathLike",
            },
            "b": {
                "type": "object",
                "customBasePath": "os.PathLike",
                "properties": {"c": {"type": "integer"}},
            },
            "c": {"type": "string", "format": payload, "title": payload, "examples": [payload]},
        },
    }
    package, sources = generate(import_root, [tool("evil", schema, description=payload)])
    assert "os" not in {
        name for code in sources.values() for name in code.replace(".", " ").split() if name == "os"
    }
    evil = import_module(package, "evil")
    assert evil.Params(a="x").a == "x"
    assert not canary.exists()


def test_an_unrepresentable_default_is_left_to_the_server(import_root: Path) -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "default": "not a number"},
            "e": {"enum": ["a", "b"], "default": "c"},
            "o": {"type": "object", "properties": {"x": {"type": "integer"}}, "default": {"x": 1}},
            "l": {"type": "array", "items": {"type": "integer"}, "default": [1, 2]},
            "f": {"type": "number", "default": 1},
        },
    }
    package, _ = generate(import_root, [tool("defaults", schema)])
    params = import_module(package, "defaults").Params()
    assert params.model_dump(mode="json", exclude_none=True) == {"l": [1, 2], "f": 1}


def test_numeric_bounds_pydantic_cannot_take_on_an_int_are_rounded_or_left_to_the_server(
    import_root: Path,
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0.5, "exclusiveMaximum": 9.5, "multipleOf": 0.5},
            "big": {"type": "integer", "maximum": 10**30, "minimum": -(2**70)},
            "x": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.25},
            "draft4": {"type": "integer", "minimum": 1, "exclusiveMinimum": True},
        },
    }
    package, _ = generate(import_root, [tool("bounds", schema)])
    Params = import_module(package, "bounds").Params
    assert Params(n=1, big=10**29, x=0.75, draft4=2).n == 1
    for bad in [{"n": 0}, {"n": 10}, {"big": 10**31}, {"x": 0}, {"x": 0.3}, {"draft4": 1}]:
        with pytest.raises(ValidationError):
            Params.model_validate(bad)


def test_an_argument_object_that_admits_no_properties_refuses_every_name(import_root: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"options": {"type": "object", "additionalProperties": False}},
        "additionalProperties": False,
    }
    package, _ = generate(import_root, [tool("closed", schema)])
    Params = import_module(package, "closed").Params
    assert Params(options={}).model_dump(mode="json", exclude_none=True) == {"options": {}}
    with pytest.raises(ValidationError, match="extra_forbidden"):
        Params(options={"unknown": 1})


def test_a_tool_with_an_invalid_schema_is_skipped_and_named(
    caplog: pytest.LogCaptureFixture, import_root: Path
) -> None:
    tools = [
        tool("good", {"type": "object", "properties": {"x": {"type": "string"}}}),
        tool("bad-type", {"type": "object", "properties": {"x": {"type": "frobnicate"}}}),
        tool("bad-ref", {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}),
        tool("deep", {"type": "object", "properties": {"x": _nested(200)}}),
    ]
    with caplog.at_level(logging.WARNING, logger="ipybox.mcp_apigen"):
        package, sources = generate(import_root, tools)
    assert set(sources) == {"__init__", "good"}
    messages = "\n".join(record.getMessage() for record in caplog.records)
    for name in ["bad-type", "bad-ref", "deep"]:
        assert repr(name) in messages
    assert "'good'" not in messages
    assert "bad" not in sources["__init__"]
    import_module(package, "good")


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


# --- generate_mcp_sources against real servers ---------------------------------------------------


@pytest.mark.slow
async def test_generate_writes_a_package_returns_module_names_and_registers_the_server(
    tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPYBOX_TEST_SECRET", "s3cr3t-value")
    tools = [
        {
            "name": "get-weather",
            "description": "Weather now.",
            "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        {
            "name": "class",
            "inputSchema": {"type": "object"},
            "outputSchema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
        },
        {"name": "bad", "inputSchema": {"type": "object", "properties": {"x": {"type": 3}}}},
    ]
    params = tools_server_params(tmp_path, tools)
    params["env"] = {"API_KEY": "${IPYBOX_TEST_SECRET}"}
    root = tmp_path / "mcptools"
    stale = root / "weather" / "stale.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("raise RuntimeError('stale module')\n")

    modules = await generate_mcp_sources("weather", params, root)

    assert modules == ["class_", "get_weather"]
    files = listing(root / "weather")
    assert files == ["__init__.py", "_search.json", "class_.py", "get_weather.py"]
    assert listing(root) == ["_search_index.json", "weather"]  # no staging directory left behind
    text = "\n".join((root / "weather" / name).read_text("utf-8") for name in files)
    text += (root / "_search_index.json").read_text("utf-8")
    for secret in ["s3cr3t-value", "IPYBOX_TEST_SECRET", str(TOOLS_SERVER), "API_KEY"]:
        assert secret not in text
    assert "get_weather (tool 'get-weather'): Weather now." in text
    assert ServerRegistry(state_dir / "servers.json").lookup("weather") == params


@pytest.mark.slow
async def test_a_server_that_names_the_kernels_folder_is_generated_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel importing ``work/mcptools`` works in ``work`` and can write there: a sandboxed
    executor would refuse to start this server, which is said when it is registered."""
    work = tmp_path / "work"
    work.mkdir()
    script = work / "tools_server.py"
    shutil.copy(TOOLS_SERVER, script)
    params = tools_server_params(tmp_path, [])
    params["args"][0] = str(script)
    with caplog.at_level(logging.WARNING, logger="ipybox.mcp_apigen"):
        await generate_mcp_sources("inside", params, work / "mcptools")
    warned = [record.getMessage() for record in caplog.records if record.name == "ipybox.mcp_apigen"]
    assert len(warned) == 1 and "with sandbox=True it is refused at its first call" in warned[0]
    assert repr(str(script)) in warned[0]


@pytest.mark.slow
async def test_a_server_without_tools_gives_an_empty_package(tmp_path: Path) -> None:
    modules = await generate_mcp_sources("empty", tools_server_params(tmp_path, []), tmp_path)
    assert modules == []
    assert listing(tmp_path / "empty") == ["__init__.py", "_search.json"]
    check_source((tmp_path / "empty" / "__init__.py").read_text("utf-8"))


async def test_an_unreachable_server_raises_and_leaves_the_existing_package(tmp_path: Path) -> None:
    existing = tmp_path / "remote" / "keep.py"
    existing.parent.mkdir()
    existing.write_text("")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MCPServerError):
        await generate_mcp_sources(
            "remote", {"url": f"http://127.0.0.1:{port}/mcp"}, tmp_path, connect_timeout=5
        )
    assert existing.exists()


@pytest.mark.slow
async def test_a_server_that_never_answers_times_out(tmp_path: Path) -> None:
    silent = {"command": sys.executable, "args": ["-c", "import time; time.sleep(600)"]}
    with pytest.raises(MCPServerError):
        await generate_mcp_sources("silent", silent, tmp_path, connect_timeout=1)
    assert not (tmp_path / "silent").exists()


async def test_a_server_that_fails_to_start_is_reported_with_its_exit_code_and_stderr(tmp_path: Path) -> None:
    # The README's example run by an interpreter that lacks the `mcp` package (-S: no site-packages).
    without_mcp = {"command": sys.executable, "args": ["-S", str(TOOLS_SERVER)]}
    with pytest.raises(MCPServerError) as info:
        await generate_mcp_sources("nomcp", without_mcp, tmp_path)
    assert "exited with code 1" in str(info.value)
    assert "ModuleNotFoundError: No module named" in str(info.value)


async def test_malformed_server_params_raise_server_params_error(tmp_path: Path) -> None:
    with pytest.raises(ServerParamsError):
        await generate_mcp_sources("x", {"command": 5}, tmp_path)
    with pytest.raises(ServerParamsError):
        await generate_mcp_sources("x", {"command": "${IPYBOX_SURELY_UNSET_VARIABLE}"}, tmp_path)
