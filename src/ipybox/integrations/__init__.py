"""ipybox in agent frameworks: each integration is an optional extra, imported only by name.

- ``ipybox.integrations.pydantic_ai``: `IpyboxToolset`, a pydantic-ai toolset (``ipybox[pydantic-ai]``).
- ``ipybox.integrations.smolagents``: `IpyboxExecutor`, a smolagents ``PythonExecutor``
  (``ipybox[smolagents]``).

Frameworks that speak MCP (the OpenAI Agents SDK, LangChain's MCP adapters, ...) run the ``ipybox``
MCP server instead: see ``examples/`` and the README's "Framework integrations". Nothing here is
imported by ``import ipybox``; importing a framework's module checks the installed framework's
version first (`FrameworkVersionError` names the supported range).
"""

from __future__ import annotations

from ipybox.integrations._common import Approve, FrameworkVersionError

__all__ = ["Approve", "FrameworkVersionError"]

# Shown under their public path (reprs, tracebacks, docs), as httpx and anyio do.
for _name in __all__:
    globals()[_name].__module__ = __name__
