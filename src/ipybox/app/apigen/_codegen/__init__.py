"""Compile MCP tool schemas into Python modules with Pydantic v2 models (application side only).

This is a small JSON Schema compiler written for ipybox rather than a call into
``datamodel-code-generator``, for speed: on a 100-tool server with nested input and output
schemas (2 shared cores) datamodel-code-generator 0.89 needs ~1.5 s for one batched run once
warm and ~3 s in a fresh process, over the whole budget of ``generate_mcp_sources``
(~1.5 s, server start included); this compiler needs ~70 ms for the same tools. Figures come
from ``benchmarks/measure_generation.py --compare-dcg``.

Why the output is safe (a server's schemas must never choose the code that runs in the
kernel): text from a server reaches a module only as

- a string literal made by :func:`str_literal` (``repr``) or :func:`docstring` (escaped, and
  checked to read back as the text it encodes), or
- an identifier made by :func:`module_name`, :func:`_pascal` or :func:`_field_name`, which keep
  only ``[A-Za-z0-9_]``.

No schema key can choose an import, a base class, a decorator or a type by name (keys such as
``customTypePath`` or ``x-python-type`` mean nothing here), and every module is parsed with
:func:`ast.parse` before it is handed back.

The package has three parts, in the order the data flows: ``_names`` (identifiers, string
literals, docstrings), ``_schema`` (a tool's JSON Schemas to classes) and ``_render`` (classes
to module source).
"""

from ipybox.app.apigen._codegen._names import (
    SchemaError,
    docstring,
    is_identifier,
    module_name,
    module_names,
    str_literal,
)
from ipybox.app.apigen._codegen._render import render_package_init, render_tool_module

__all__ = [
    "SchemaError",
    "docstring",
    "is_identifier",
    "module_name",
    "module_names",
    "render_package_init",
    "render_tool_module",
    "str_literal",
]
