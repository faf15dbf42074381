"""The ``search_tools`` tool: the tool search over the workspace's ``mcptools/``, read confined.

The index lies where kernel code can write, so it is read as untrusted data: through the
confined file module (no link followed, size capped), parsed as JSON and ranked by the same
stdlib query code as in the kernel, which refuses an index of the wrong shape. What it holds
goes back to the agent only, as the agent's own code could have printed it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ipybox.app.sandbox import Confined, ConfinedPathError, TooLargeError
from ipybox.errors import ToolSearchError
from ipybox.kernel._search import INDEX_FILE, ToolMatch, check_query, rank

# Parsing JSON takes up to ~25 times its size in memory (a list of empty objects): kernel code that
# writes an index must not make this process take more than a few hundred MB. An index of 300 real
# tools takes ~260 KiB, so 16 MiB holds well over 10,000.
_MAX_INDEX_BYTES = 16 * 1024 * 1024
# The last index parsed, with the bytes it was parsed from: reading and comparing them costs about
# a millisecond, parsing and checking the index (2 MiB for 300 tools) tens of milliseconds.
_parsed: list[tuple[bytes, dict[str, Any]]] = []


def search(workspace: Path, root: str, query: str, limit: int) -> list[ToolMatch]:
    """The `limit` best tools in ``workspace/root/`` for `query`.

    Raises:
        ToolSearchError: The query or limit is invalid, or there is no usable index (no server
            was registered yet, or kernel code damaged it).
    """
    query, limit = check_query(query, limit)
    try:
        with Confined(workspace) as folder:
            data = folder.read_bytes(f"{root}/{INDEX_FILE}", _MAX_INDEX_BYTES)
            present = set(folder.listdir(root))
    except TooLargeError:
        raise ToolSearchError(
            f"The tool search index in {root}/ is larger than {_MAX_INDEX_BYTES // (1024 * 1024)} MiB, more than "
            "ipybox writes for any real set of servers, so it is not read: register an MCP server again to "
            "rebuild it."
        ) from None
    except ConfinedPathError as exc:
        if exc.missing:  # no such file or folder: nothing registered yet
            raise ToolSearchError(
                f"No MCP server is registered in this workspace yet ({root}/ has no search index): register "
                "one with register_mcp_server, then search its tools."
            ) from None
        raise ToolSearchError(
            f"The tool search index in {root}/ cannot be read: {exc} Register an MCP server again to rebuild it."
        ) from None
    index = _parsed[0][1] if _parsed and _parsed[0][0] == data else None
    if index is None:
        try:
            index = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
            index = None
        if isinstance(index, dict):
            _parsed[:] = [(data, index)]
    if not isinstance(index, dict):
        raise ToolSearchError(
            f"The tool search index in {root}/ is damaged: register an MCP server again to rebuild it."
        )
    return rank(index, query, limit, present=present)
