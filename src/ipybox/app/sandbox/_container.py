"""The Docker image's start check: configuration in the workspace must be read-only without ``--sandbox``.

Run by ``docker/entrypoint.sh`` as ``python -I -m ipybox.app.sandbox._container WORKSPACE`` (``-I``:
nothing is imported from the workspace) before the server starts without ``--sandbox``. In the
container the kernel runs as the user who owns the mounted workspace, so it could write the
workspace's ``.git/config`` (``core.fsmonitor``), ``.git/hooks``, editor and agent settings, which
programs on the host later run. Each such name that exists must come in through a read-only mount
(``--mount type=bind,...,readonly``): the check names every one that is writable, with the option
that protects it, and the container does not start. ``IPYBOX_WRITABLE_CONFIG=1`` starts it anyway.

A name that does not exist when the container starts cannot be mounted (Docker would create it in
the workspace): code in the container can create it. Only ``--sandbox`` protects those.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ipybox.app.sandbox._rules import PROTECTED_WORKSPACE_DIRS, PROTECTED_WORKSPACE_FILES

__all__ = ["CONTAINER_WORKSPACE", "writable_protected"]

CONTAINER_WORKSPACE = "/app/workspace"
"""Where the image mounts the workspace."""


def writable_protected(workspace: Path) -> list[str]:
    """The protected names (`PROTECTED_WORKSPACE_DIRS`, `PROTECTED_WORKSPACE_FILES`) that exist at the
    top of `workspace` and do not lie on a read-only mount: a link (which could be pointed
    elsewhere), or anything else its owner could make writable again (``chmod``) or whose contents
    (``.git/hooks``) could be writable, whatever its own mode says."""
    found = []
    for name in (*PROTECTED_WORKSPACE_DIRS, *PROTECTED_WORKSPACE_FILES):
        path = workspace / name
        if path.is_symlink() or (path.exists() and not os.statvfs(path).f_flag & os.ST_RDONLY):
            found.append(name)
    return found


def main(argv: list[str]) -> int:
    """Check the workspace `argv[0]`; 0 when nothing protected is writable, else 1 with the reason."""
    workspace = Path(argv[0] if argv else CONTAINER_WORKSPACE)
    names = writable_protected(workspace)
    if not names or os.environ.get("IPYBOX_WRITABLE_CONFIG") == "1":
        return 0
    mounts = " ".join(
        f"--mount type=bind,src=/path/to/workspace/{name},dst={CONTAINER_WORKSPACE}/{name},readonly"
        for name in names
    )
    print(
        f"ipybox: the workspace's {', '.join(names)} can be changed by code in this container: without "
        "--sandbox the kernel runs as the workspace's owner, and a program on your machine (git, an editor, "
        "an agent) would later run what it wrote there (git hooks, core.fsmonitor, tasks, MCP servers). "
        f"Mount each one read-only (add, before the image name: {mounts}), or run with --sandbox (and "
        "the Docker options it needs), or set -e IPYBOX_WRITABLE_CONFIG=1 to accept the risk.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
