"""MkDocs hook (mkdocs.yml `hooks:`): every public name has a docstring and a place in the API reference.

After the pages are read, each name in a public module's `__all__` is looked up with griffe (the
library mkdocstrings reads the docstrings with). A name without a docstring, a public method or
property of a public class without one, or a name no page under `docs/reference/` documents (with
a `::: path` directive, at that path or at another path of the same object, or as the target of a
link) is logged as a warning, which `mkdocs build --strict` turns into a failed build.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import griffe

# The public modules (issue 37's list and the compatibility paths); a module without `__all__`
# lists its public names here.
PUBLIC_MODULES: dict[str, list[str] | None] = {
    "ipybox": None,
    "ipybox.errors": None,
    "ipybox.policy": None,
    "ipybox.oauth": None,
    "ipybox.mcp_server": None,
    "ipybox.integrations": None,
    "ipybox.integrations.pydantic_ai": None,
    "ipybox.integrations.smolagents": None,
    "ipybox.code_exec": None,
    "ipybox.kernel_mgr.server": None,
    "ipybox.kernel_mgr.client": None,
    "ipybox.mcp_apigen": None,
    "ipybox.tool_exec.server": None,
    "ipybox.tool_exec.client": None,
    "ipybox.tool_exec.content": None,
    "ipybox.tool_exec.search": None,
    "ipybox.tool_exec.approval.server": None,
    "ipybox.tool_exec.approval.client": None,
    "ipybox.utils": ["arun"],
}

_DIRECTIVE = re.compile(r"^:::\s+(\S+)", re.MULTILINE)
_LINK_TARGET = re.compile(r"\]\[([A-Za-z_][\w.]*)\]")

log = logging.getLogger("mkdocs.plugins.ipybox")


def _final_path(obj: griffe.Object | griffe.Alias) -> str:
    return obj.final_target.path if isinstance(obj, griffe.Alias) else obj.path


def _lookup(packages: dict[str, griffe.Module], path: str) -> griffe.Object | griffe.Alias | None:
    root, _, rest = path.partition(".")
    if root not in packages:
        try:
            packages[root] = griffe.load(root, resolve_aliases=True, resolve_external=False)  # type: ignore[assignment]
        except ImportError:
            return None
    try:
        return packages[root][rest] if rest else packages[root]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _public_names(module: griffe.Module, names: list[str] | None) -> list[str]:
    if names is not None:
        return names
    exported = module.exports or []
    return [name if isinstance(name, str) else name.name for name in exported]


def _undocumented_members(obj: griffe.Object | griffe.Alias) -> list[str]:
    target = obj.final_target if isinstance(obj, griffe.Alias) else obj
    if not isinstance(target, griffe.Class):
        return []
    missing = []
    for name, member in target.members.items():
        if name.startswith("_") or isinstance(member, griffe.Alias):
            continue
        # Plain attributes (dataclass fields) are described in their class's `Attributes:`.
        if isinstance(member, griffe.Attribute) and "property" not in member.labels:
            continue
        if not member.docstring:
            missing.append(member.path)
    return missing


def _documented(packages: dict[str, griffe.Module], reference_dir: Path) -> tuple[set[str], set[str]]:
    """The paths the reference pages name, and the paths of the objects they document."""
    paths: set[str] = set()
    targets: set[str] = set()
    for page in sorted(reference_dir.glob("**/*.md")):
        text = page.read_text()
        for path in _DIRECTIVE.findall(text):
            obj = _lookup(packages, path)
            if obj is None:
                continue
            paths.add(path)
            targets.add(_final_path(obj))
            if isinstance(obj, griffe.Module):
                members = [f"{path}.{name}" for name in _public_names(obj, None)]
                paths.update(members)
                found = (_lookup(packages, member) for member in members)
                targets.update(_final_path(obj) for obj in found if obj is not None)
        paths.update(_LINK_TARGET.findall(text))
    return paths, targets


def _problems_of(
    packages: dict[str, griffe.Module], path: str, documented: tuple[set[str], set[str]]
) -> list[str]:
    obj = _lookup(packages, path)
    if obj is None:
        return [f"{path} is in __all__ but cannot be found"]
    problems = [f"{member} has no docstring" for member in _undocumented_members(obj)]
    if not obj.docstring:
        problems.append(f"{path} has no docstring (every public name needs one)")
    if path not in documented[0] and _final_path(obj) not in documented[1]:
        problems.append(
            f"{path} is public but not in the API reference (add it to a page under docs/reference/)"
        )
    return problems


def check_reference(reference_dir: Path) -> list[str]:
    """What keeps the API reference from covering the public API, one sentence each."""
    packages: dict[str, griffe.Module] = {}
    documented = _documented(packages, reference_dir)
    problems = []
    for module_path, names in PUBLIC_MODULES.items():
        module = _lookup(packages, module_path)
        if not isinstance(module, griffe.Module):
            problems.append(f"{module_path} is a public module but cannot be loaded")
            continue
        for name in _public_names(module, names):
            problems.extend(_problems_of(packages, f"{module_path}.{name}", documented))
    return sorted(set(problems))


def on_files(files: Any, config: Any) -> Any:
    """Log each gap in the API reference as a warning (a failure under `--strict`)."""
    for problem in check_reference(Path(config["docs_dir"]) / "reference"):
        log.warning(problem)
    return files
