"""`confine`: which stdio servers a sandboxed kernel could change."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ipybox.errors import ServerParamsError
from ipybox.tool_exec._params import StdioParams, confine


def test_confine_checks_the_real_path_of_every_file_a_server_starts_from(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (work / "server.py").write_text("")
    (outside / "server.py").write_text("")
    (outside / "link.py").symlink_to(work / "server.py")
    refused = [
        StdioParams(command=sys.executable, args=(str(work / "server.py"),)),
        StdioParams(command=sys.executable, args=(str(outside / "link.py"),)),
        StdioParams(command=sys.executable, args=("server.py",), cwd=str(work)),
        StdioParams(command=sys.executable, args=("-m", "srv"), env={"PYTHONPATH": str(work)}),
        StdioParams(command="python", env={"PATH": f"{work}:/usr/bin:/bin"}),
    ]
    for params in refused:
        with pytest.raises(ServerParamsError, match="sandboxed kernel can write"):
            confine("s", params, (work,))
    refused.append(StdioParams(command=sys.executable, args=(str(work / "not-yet.py"),)))
    allowed = confine("s", StdioParams(command="python3", args=(str(outside / "server.py"),)), (work,))
    assert Path(allowed.command).is_absolute()
    # A folder in the workspace is the server's data (a filesystem server's root).
    confine(
        "s",
        StdioParams(command="npx", args=("-y", "@modelcontextprotocol/server-filesystem", str(work))),
        (work,),
    )
    with pytest.raises(ServerParamsError, match="sandboxed kernel can write"):
        confine("s", refused[-1], (work,))
    # What the sandbox keeps read-only inside the working directory (a checkout's .venv) is fine.
    venv = work / ".venv" / "bin"
    venv.mkdir(parents=True)
    confine(
        "s", StdioParams(command="python", env={"PATH": f"{venv}:/usr/bin:/bin"}), (work,), (work / ".venv",)
    )
    # ... unless the folder is a program: `python DIR` runs DIR/__main__.py.
    (work / "__main__.py").write_text("")
    with pytest.raises(ServerParamsError, match="sandboxed kernel can write"):
        confine("s", StdioParams(command=sys.executable, args=(str(work),)), (work,))
