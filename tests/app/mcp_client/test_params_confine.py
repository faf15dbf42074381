"""`confine`: which stdio servers a sandboxed kernel could change."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Private: parameter resolution and confinement are internal; they are tested directly.
from ipybox.app.mcp_client._params import StdioParams, confine, resolve_params
from ipybox.errors import ServerParamsError
from tests.sandbox_support import require_sandbox


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
        StdioParams(command=sys.executable, args=("link.py",), cwd=str(outside)),
        StdioParams(command=sys.executable, args=("-m", "srv"), env={"PYTHONPATH": str(work)}),
        StdioParams(command="python", env={"PATH": f"{work}:/usr/bin:/bin"}),
        StdioParams(command=sys.executable, args=(str(work / "not-yet.py"),)),
    ]
    for params in refused:
        with pytest.raises(ServerParamsError, match="sandboxed kernel can write"):
            confine("s", params, (work,))
    allowed = confine("s", StdioParams(command="python3", args=(str(outside / "server.py"),)), (work,))
    assert Path(allowed.command).is_absolute()
    # What the sandbox keeps read-only inside the working directory (a checkout's .venv) is fine.
    venv = work / ".venv" / "bin"
    venv.mkdir(parents=True)
    confine(
        "s", StdioParams(command="python", env={"PATH": f"{venv}:/usr/bin:/bin"}), (work,), (work / ".venv",)
    )


# The forms an attack review found past the old check, which guessed from argv which argument
# is a program (``ws`` is the kernel's working directory, none of these paths need exist).
BYPASSES = {
    "uv --directory, script relative to it": {
        "command": "uv",
        "args": ["--directory", "{ws}/srv", "run", "demo_server.py"],
    },
    "uvx --from a project folder": {"command": "uvx", "args": ["--from", "{ws}/pkg", "pkg"]},
    "uvx --from=": {"command": "uvx", "args": ["--from={ws}/pkg", "pkg"]},
    "uvx --from file://": {"command": "uvx", "args": ["--from", "file://{ws}/pkg", "pkg"]},
    "uvx --with a wheel yet to be written": {"command": "uvx", "args": ["--with", "{ws}/later.whl", "tool"]},
    "npx file:": {"command": "npx", "args": ["-y", "file:{ws}/pkg"]},
    "npx git+file:": {"command": "npx", "args": ["-y", "git+file:{ws}/repo"]},
    "node --require=": {"command": "node", "args": ["--require={ws}/x.js", "/usr/lib/node/index.js"]},
    "node --import=": {"command": "node", "args": ["--import={ws}/x.mjs", "/usr/lib/node/cli.js"]},
    "python3 FILE without suffix": {"command": "python3", "args": ["{ws}/server"]},
    "python3 a folder (__main__.py written later)": {"command": "python3", "args": ["{ws}"]},
    "a folder given as data": {
        "command": "npx",
        "args": ["-y", "@modelcontextprotocol/server-filesystem", "{ws}"],
    },
    "python3 -c code": {"command": "python3", "args": ["-c", "exec(open('{ws}/s.txt').read())"]},
    "sh -c": {"command": "sh", "args": ["-c", "python3 {ws}/s.py"]},
    "sh -c, relative from a cwd link": {
        "command": "sh",
        "args": ["-c", "python3 in-ws/s.py"],
        "cwd": "{out}",
    },
    "relative, up from the private folder": {"command": "python3", "args": ["../{ws_name}/s.py"]},
    "NODE_OPTIONS": {"command": "npx", "args": ["-y", "x"], "env": {"NODE_OPTIONS": "--require {ws}/x.js"}},
    "LD_PRELOAD": {"command": "python3", "args": ["-m", "x"], "env": {"LD_PRELOAD": "{ws}/evil.so"}},
    "PYTHONHOME": {"command": "python3", "args": ["-m", "x"], "env": {"PYTHONHOME": "{ws}/home"}},
    "PYTHONPATH, second entry": {
        "command": "python3",
        "args": ["-m", "x"],
        "env": {"PYTHONPATH": "/opt:{ws}"},
    },
    "BASH_ENV": {"command": "bash", "args": ["-c", "exec uvx tool"], "env": {"BASH_ENV": "{ws}/x.sh"}},
    "UV_PROJECT": {"command": "uv", "args": ["run", "server"], "env": {"UV_PROJECT": "{ws}/pkg"}},
    "UV_CONFIG_FILE": {"command": "uvx", "args": ["tool"], "env": {"UV_CONFIG_FILE": "{ws}/uv.toml"}},
    "npm_config_userconfig": {
        "command": "npx",
        "args": ["x"],
        "env": {"npm_config_userconfig": "{ws}/npmrc"},
    },
    "srt with its settings in the workspace": {
        "command": "srt",
        "args": ["--settings", "{ws}/s.json", "npx", "x"],
    },
    "srt without --settings": {"command": "srt", "args": ["npx", "x", "{ws}"]},
    "srt with NODE_OPTIONS": {
        "command": "srt",
        "args": ["--settings", "{out}/s.json", "npx", "x"],
        "env": {"NODE_OPTIONS": "--require={ws}/x.js"},
    },
}


@pytest.mark.parametrize("form", BYPASSES)
def test_every_argument_and_env_value_that_names_the_workspace_is_refused(form: str) -> None:
    # The workspace beside the private folder a server starts in: `../ws` reaches it from there.
    with (
        tempfile.TemporaryDirectory(dir=tempfile.gettempdir()) as ws,
        tempfile.TemporaryDirectory() as out,
    ):
        (Path(out) / "in-ws").symlink_to(ws)
        values = {"ws": ws, "out": out, "ws_name": os.path.basename(ws)}
        params = resolve_params(_format(BYPASSES[form], values))
        assert isinstance(params, StdioParams)
        with pytest.raises(ServerParamsError, match="sandboxed kernel can write") as info:
            confine("s", params, (Path(ws),))
        # The message names the folder and the way out.
        assert ws in str(info.value) and re.search(r'"command": "[^"]*srt"', str(info.value))


def test_the_srt_a_refusal_suggests_is_one_that_runs(tmp_path: Path) -> None:
    """Not plain "srt" when setup put it in the clone, off PATH: the path ipybox itself runs."""
    require_sandbox()
    params = resolve_params({"command": sys.executable, "args": [str(tmp_path / "server.py")]})
    assert isinstance(params, StdioParams)
    with pytest.raises(ServerParamsError) as info:
        confine("s", params, (tmp_path,))
    named = re.search(r'"command": "([^"]*)"', str(info.value))
    assert named is not None and shutil.which(named.group(1)) is not None, str(info.value)


def test_a_server_under_srt_with_settings_outside_may_be_given_the_workspace_as_data(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    settings = outside / "fs.json"
    for args in (
        ["--settings", str(settings), "npx", "-y", "@modelcontextprotocol/server-filesystem", str(work)],
        ["-d", f"--settings={settings}", "npx", "-y", "@modelcontextprotocol/server-filesystem", str(work)],
    ):
        confine("s", StdioParams(command="/opt/srt/bin/srt", args=tuple(args)), (work,))
    # Without srt the same server is refused, and so is srt with a settings file in the workspace.
    with pytest.raises(ServerParamsError, match="argument"):
        confine("s", StdioParams(command="/usr/bin/npx", args=("-y", "fs", str(work))), (work,))
    with pytest.raises(ServerParamsError, match="srt settings file"):
        confine(
            "s", StdioParams(command="/opt/srt/bin/srt", args=("-s", str(work / "x.json"), "npx")), (work,)
        )


def test_secrets_stay_out_of_the_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPYBOX_TEST_SECRET", "s3cr3t-value")
    params = resolve_params(
        {"command": "python3", "args": ["-m", "x"], "env": {"X": f"{tmp_path}/${{IPYBOX_TEST_SECRET}}"}}
    )
    assert isinstance(params, StdioParams)
    with pytest.raises(ServerParamsError) as info:
        confine("s", params, (tmp_path,))
    assert "s3cr3t-value" not in str(info.value) and "env variable X" in str(info.value)


def _format(value: Any, values: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**values)
    if isinstance(value, dict):
        return {key: _format(item, values) for key, item in value.items()}
    return [_format(item, values) for item in value]


def test_a_relative_command_is_checked_from_the_working_directory(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (outside / "bin").symlink_to(work)
    with pytest.raises(ServerParamsError, match=re.escape("its command './bin/server'")):
        confine("s", StdioParams(command="./bin/server", cwd=str(outside)), (work,))
    pinned = confine("s", StdioParams(command="./server", cwd=str(outside)), (work,))
    assert Path(pinned.command) == outside / "server"
    # Without a cwd it is left as given: the session's private folder is where it is looked for.
    assert confine("s", StdioParams(command="./server"), (work,)).command == "./server"
