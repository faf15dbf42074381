"""Sphinx settings for the API reference; ``bash scripts/docs.sh`` builds it.

The build is strict (``-W --keep-going``, ``nitpicky``) and offline (no intersphinx), and it
fails when:

- a cross-reference to an ipybox name does not resolve (a docstring's ``:class:`...```, a
  type in a signature, a ``Raises:`` entry);
- a documented public name, or a public member of it, has no docstring;
- a name a public module exports (its ``__all__``) is missing from the reference.

Names of other packages and the standard library (``pathlib.Path``), private ipybox names (a
``_`` module or name: a private base class, a parameter's type) and type variables are shown
unlinked instead (``_leave_unlinked``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any, ParamSpec, TypeVar

from sphinx.application import Sphinx
from sphinx.util import logging

project = "ipybox"
copyright = "ipybox maintainers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "ipybox API reference"
# Single backticks in docstrings mean code, as in Markdown.
default_role = "code"

nitpicky = True

autodoc_default_options = {"members": True, "undoc-members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
python_maximum_signature_line_length = 90
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# The public modules; a module without ``__all__`` lists its public names here.
PUBLIC_MODULES: dict[str, list[str] | None] = {
    "ipybox": None,
    "ipybox.errors": None,
    "ipybox.kernel_mgr.server": ["KernelGateway"],
    "ipybox.kernel_mgr.client": None,
    "ipybox.policy": None,
    "ipybox.tool_exec.server": None,
    "ipybox.tool_exec.client": None,
    "ipybox.tool_exec.content": None,
    "ipybox.tool_exec.search": None,
    "ipybox.tool_exec.approval.server": None,
    "ipybox.tool_exec.approval.client": None,
    "ipybox.mcp_apigen": None,
    "ipybox.mcp_server": None,
    "ipybox.utils": ["arun"],
    "ipybox.integrations": None,
    "ipybox.integrations.pydantic_ai": ["IpyboxToolset"],
    "ipybox.integrations.smolagents": ["IpyboxExecutor"],
}

logger = logging.getLogger(__name__)


def _warn_on_missing_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    if what != "module" and not any(line.strip() for line in lines):
        logger.warning("%s has no docstring (every public name needs one)", name, type="ipybox")


def _skip_plain_attributes(
    app: Sphinx, what: str, name: str, obj: Any, skip: bool, options: Any
) -> bool | None:
    # Dataclass fields and other plain values are described in their class's ``Attributes:``.
    if not skip and what in ("class", "exception") and not callable(obj) and not isinstance(obj, property):
        return True
    return None


def _leave_unlinked(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    target: str = node.get("reftarget", "")
    if node.get("refdomain") != "py" or "." not in target:
        return None
    root = target.split(".")[0]
    if root != "ipybox":
        return contnode if importlib.util.find_spec(root) is not None else None
    if any(part.startswith("_") for part in target.split(".")):
        return contnode
    try:
        value = _resolve(target)
    except (LookupError, AttributeError):
        return None
    return contnode if isinstance(value, TypeVar | ParamSpec) else None


def _resolve(fullname: str) -> Any:
    parts = fullname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            value = getattr(value, attr)
        return value
    raise LookupError(fullname)


def _check_every_public_name_is_documented(app: Sphinx, env: Any) -> None:
    documented: set[int] = set()
    for fullname in env.get_domain("py").objects:
        value = _resolve(fullname)
        if inspect.isclass(value) or inspect.isroutine(value):
            documented.add(id(value))
    for module_name, names in PUBLIC_MODULES.items():
        module = importlib.import_module(module_name)
        for name in names if names is not None else module.__all__:
            value = getattr(module, name)
            found = f"{module_name}.{name}" in env.get_domain("py").objects or id(value) in documented
            if not found:
                logger.warning(
                    "%s.%s is public but not in the API reference (add it to docs/reference.rst)",
                    module_name,
                    name,
                    type="ipybox",
                )


def setup(app: Sphinx) -> None:
    app.connect("autodoc-process-docstring", _warn_on_missing_docstring)
    app.connect("autodoc-skip-member", _skip_plain_attributes)
    app.connect("missing-reference", _leave_unlinked)
    app.connect("env-check-consistency", _check_every_public_name_is_documented)
