"""MCP server parameters: validated, ``${VAR}`` placeholders resolved, frozen (application side only).

A stdio server becomes :class:`StdioParams`, an HTTP server :class:`HttpParams`; the tool
server and the code generator hand either to :class:`ipybox.app.mcp_client._session.MCPSession`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx2

from ipybox.app.mcp_client._oauth_settings import OAuthSettings, parse_oauth
from ipybox.errors import ServerParamsError

__all__ = ["HttpParams", "StdioParams", "confine", "resolve_params"]

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_STDIO_KEYS = frozenset({"command", "args", "env", "cwd", "type"})
_HTTP_KEYS = frozenset({"url", "headers", "type", "oauth"})
_HTTP_TYPES: dict[str, Literal["streamable_http", "sse"]] = {
    "streamable_http": "streamable_http",
    "streamable-http": "streamable_http",
    "http": "streamable_http",
    "sse": "sse",
}


@dataclass(frozen=True)
class StdioParams:
    """Resolved parameters of an MCP server started as a subprocess (stdio transport).

    Attributes:
        command: The executable.
        args: Its command-line arguments.
        env: Extra environment variables for the server process, or ``None``.
        cwd: The working directory of the server process, or ``None`` for the current one.
        secrets: The values ``${VAR}`` placeholders were replaced with, kept out of messages.
    """

    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    secrets: tuple[str, ...] = field(default=(), repr=False, compare=False)


@dataclass(frozen=True)
class HttpParams:
    """Resolved parameters of an MCP server reached over HTTP.

    Attributes:
        url: The server's endpoint URL.
        headers: HTTP headers sent with every request (e.g. ``Authorization``).
        transport: ``"streamable_http"`` or ``"sse"``.
        secrets: The values ``${VAR}`` placeholders were replaced with, kept out of messages.
        oauth: The server's OAuth settings when it asks for an OAuth login (``"oauth"``), else
            ``None`` (see :mod:`ipybox.app.mcp_client._oauth`).
    """

    url: str
    headers: dict[str, str]
    transport: Literal["streamable_http", "sse"]
    secrets: tuple[str, ...] = field(default=(), repr=False, compare=False)
    oauth: OAuthSettings | None = None


def resolve_params(server_params: Mapping[str, Any]) -> StdioParams | HttpParams:
    """Validate MCP server parameters and replace their ``${VAR}`` placeholders.

    A stdio server is given as ``{"command", "args", "env", "cwd"}``, an HTTP server as
    ``{"url", "headers", "type", "oauth"}`` where ``type`` is ``"streamable_http"`` or ``"sse"``;
    without ``type`` the transport follows the URL path (``.../sse`` is SSE, anything else
    streamable HTTP). ``"oauth": true`` (or a mapping of settings, see
    :func:`ipybox.app.mcp_client._oauth.parse_oauth`) makes the server's login an OAuth one. ``${VAR}`` in any string is replaced from this process's environment, or else from
    the ``.env`` file of the current working directory.

    Args:
        server_params: The parameters as the application wrote them.

    Returns:
        The resolved, validated parameters.

    Raises:
        ServerParamsError: The parameters have the wrong shape, or a placeholder names a variable
            that is set neither in the environment nor in ``.env``.
    """
    if not isinstance(server_params, Mapping):
        raise ServerParamsError(
            f"MCP server parameters must be a mapping such as {{'command': ..., 'args': [...]}} or "
            f"{{'url': ...}}, not {type(server_params).__name__}."
        )
    environment = _Environment()
    params = _substitute(dict(server_params), environment)
    has_command, has_url = "command" in params, "url" in params
    if has_command == has_url:
        raise ServerParamsError(
            "MCP server parameters need exactly one of 'command' (a server started as a subprocess, with "
            f"optional 'args', 'env', 'cwd') or 'url' (an HTTP server, with optional 'headers', 'type'); got keys "
            f"{sorted(params)}."
        )
    resolved = _stdio_params(params) if has_command else _http_params(params)
    return dataclasses.replace(resolved, secrets=tuple(sorted(environment.used, key=len, reverse=True)))


def _pinned_command(params: StdioParams, env_path: str) -> str:
    """The server's command as `confine` checks it: looked up on `env_path`, else as given."""
    command = params.command
    if os.sep in command:
        # A relative command is found from the working directory, the private one included.
        return os.path.join(params.cwd, command) if params.cwd else command
    return shutil.which(command, path=env_path) or command


def _refusal(server_name: str, secrets: Sequence[str], what: str, given: str, path: str, root: str) -> str:
    """The message of `confine` for `given` (path `path` in it) inside writable folder `root`."""
    from ipybox.app.sandbox import srt_command

    shown = f"{given!r}" if given == path else f"{given!r} (the path {path})"
    srt = json.dumps(srt_command())
    message = (
        f"MCP server {server_name!r} is refused: its {what} {shown} lies in {root}, which the "
        "sandboxed kernel can write, so code in the kernel could change what this server runs or "
        "reads outside the sandbox. Move it out of the kernel's folders (keep servers, their "
        "files and working directory beside, not inside, the working directory), or, to give a "
        "server the workspace as data, run it sandboxed itself: "
        f'{{"command": {srt}, "args": ["--settings", FILE, ...]}} with FILE outside these folders.'
    )
    for secret in secrets:
        message = message.replace(secret, "***")
    return message


def confine(
    server_name: str, params: StdioParams, writable: Sequence[Path], readonly: Sequence[Path] = ()
) -> StdioParams:
    """Refuse a stdio server that a sandboxed kernel could change, and pin its command.

    A server runs outside the sandbox, so nothing it is given may name a place the kernel can
    write. No guess is made about which argument is a program and which is data: the command
    (looked up on ``PATH`` here and returned as an absolute path), the working directory (a
    private folder in the temporary directory unless ``cwd`` is given), every ``PATH`` entry,
    every argument and every ``env`` value are read as paths, relative ones from the working
    directory. An argument or value also counts by its part after ``=`` (``--from=DIR``), without
    a ``file:`` / ``file://`` / ``git+file:`` scheme, by the words of a shell string
    (``sh -c '...'``), by each ``os.pathsep``-separated part (values) and by any absolute path
    written inside it (``python -c "exec(open('/ws/s.py').read())"``). Links are followed: both
    the given and the real path are checked. Paths the sandbox keeps read-only (``readonly``)
    are fine.

    The one exception: a server run by ``srt --settings FILE ...``, with ``FILE`` outside the
    writable folders, runs in a sandbox of its own, so its arguments may name the workspace (a
    filesystem server's data); its command, working directory, ``PATH``, ``env`` and ``FILE``
    are still checked.

    Args:
        server_name: The server's name, for the message.
        params: The resolved parameters.
        writable: Folders the kernel can write.
        readonly: Paths inside them that the kernel cannot write (the sandbox's ``denyWrite``).

    Returns:
        The parameters with ``command`` made absolute (when it was found).

    Raises:
        ServerParamsError: A path of the server lies in a folder the kernel can write; the message
            names the argument or variable, the folder, and what to do.
    """
    roots, carved = _forms(writable), _forms(readonly)
    env = params.env or {}
    # Where relative paths lead: the given cwd, or else the private folder the session makes.
    base = os.path.abspath(params.cwd or os.path.join(tempfile.gettempdir(), "ipybox-mcp-private"))
    env_path = env.get("PATH", os.environ.get("PATH", os.defpath))
    command = _pinned_command(params, env_path)

    def check(what: str, given: str, paths: Sequence[str]) -> None:
        for path in paths:
            for form in (
                os.path.abspath(os.path.join(base, path)),
                os.path.realpath(os.path.join(base, path)),
            ):
                root = next((r for r in roots if _within(form, r)), None)
                if root is None or any(_within(form, r) for r in carved):
                    continue
                raise ServerParamsError(_refusal(server_name, params.secrets, what, given, path, root))

    # A command that was not found fails to start on its own; only a found one is checked.
    if os.sep in command:
        check("command", params.command, [command])
    check("working directory", params.cwd or base, [base])
    # The server starts programs of its own from PATH (npx starts node, uvx its tools).
    check("PATH", env_path, [entry for entry in env_path.split(os.pathsep) if entry])
    settings = _srt_settings(params.args) if os.path.basename(command) == "srt" else None
    if settings is not None:
        check("srt settings file", settings, [settings])
    else:
        for arg in params.args:
            check("argument", arg, _paths_in(arg))
    for name, value in env.items():
        if name != "PATH":
            check(
                f"env variable {name} =",
                value,
                [p for part in value.split(os.pathsep) for p in _paths_in(part)],
            )
    return replace(params, command=command) if os.path.isabs(command) else params


# What a token may hold a path behind: a URL scheme, an option's ``=``, or any absolute path
# written inside it (code given to ``python -c``, a quoted shell string).
_SCHEMES = ("git+file://", "git+file:", "file://", "file:")
_EMBEDDED_PATH = re.compile(r"(?<![\w.~-])/[^\s'\"`;,:|&<>()\[\]{}=]+")


def _paths_in(token: str, depth: int = 0) -> list[str]:
    """Every path ``token`` could name: itself and its parts (see :func:`confine`)."""
    words = [token]
    if "=" in token:
        words.append(token.split("=", 1)[1])
    for word in list(words):
        for scheme in _SCHEMES:
            if word.startswith(scheme):
                words.append(word[len(scheme) :])
                break
    words += _EMBEDDED_PATH.findall(token)
    if depth < 2 and any(c.isspace() for c in token):
        try:
            parts = shlex.split(token)
        except ValueError:
            parts = []
        for part in parts:
            words += _paths_in(os.path.expanduser(part), depth + 1)
    return [word for word in words if word]


def _srt_settings(args: Sequence[str]) -> str | None:
    """The ``--settings`` file among srt's own options (before the command it runs), if any."""
    index = 0
    while index < len(args) and args[index].startswith("-"):
        arg = args[index]
        if arg in ("-s", "--settings") and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith("--settings="):
            return arg.split("=", 1)[1]
        # srt's options that take a value; its others (-d, --debug) do not.
        index += 2 if arg in ("-c", "--control-fd") else 1
    return None


def _forms(paths: Sequence[Path]) -> set[str]:
    return {os.path.abspath(form) for path in paths for form in (path, os.path.realpath(path))}


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _stdio_params(params: dict[str, Any]) -> StdioParams:
    _check_keys(params, _STDIO_KEYS, "a stdio server ('command')")
    command, args, env, cwd = params["command"], params.get("args", []), params.get("env"), params.get("cwd")
    if params.get("type", "stdio") != "stdio":
        raise ServerParamsError(
            f"'type' must be 'stdio' (or absent) for a server with a 'command', not {params['type']!r}."
        )
    if not isinstance(command, str) or not command:
        raise ServerParamsError(f"'command' must be a non-empty string, not {command!r}.")
    if not isinstance(args, list | tuple) or not all(isinstance(arg, str) for arg in args):
        raise ServerParamsError(f"'args' must be a list of strings, not {args!r}.")
    if env is not None and not _is_str_dict(env):
        raise ServerParamsError("'env' must be a mapping of strings to strings.")
    if cwd is not None and not isinstance(cwd, str | os.PathLike):
        raise ServerParamsError(f"'cwd' must be a path string, not {cwd!r}.")
    return StdioParams(
        command=command,
        args=tuple(args),
        env=dict(env) if env is not None else None,
        cwd=os.fspath(cwd) if cwd is not None else None,
    )


def _http_params(params: dict[str, Any]) -> HttpParams:
    _check_keys(params, _HTTP_KEYS, "an HTTP server ('url')")
    url, headers, kind = params["url"], params.get("headers") or {}, params.get("type")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ServerParamsError(f"'url' must be an http:// or https:// URL, not {url!r}.")
    if not _is_str_dict(headers):
        raise ServerParamsError("'headers' must be a mapping of strings to strings.")
    if kind is None:
        path = httpx2.URL(url).path.rstrip("/")
        transport: Literal["streamable_http", "sse"] = "sse" if path.endswith("/sse") else "streamable_http"
    elif kind in _HTTP_TYPES:
        transport = _HTTP_TYPES[kind]
    else:
        raise ServerParamsError(f"'type' must be 'streamable_http' or 'sse', not {kind!r}.")
    oauth = parse_oauth(params.get("oauth"))
    if oauth is not None and any(name.lower() == "authorization" for name in headers):
        raise ServerParamsError(
            "An HTTP server with 'oauth' gets its Authorization header from the OAuth login: remove "
            "'Authorization' from 'headers', or drop 'oauth' to send a fixed token."
        )
    return HttpParams(url=url, headers=dict(headers), transport=transport, oauth=oauth)


def _check_keys(params: dict[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ServerParamsError(
            f"Unexpected MCP server parameter(s) {unknown} for {what}; allowed are {sorted(allowed)}."
        )


def _is_str_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


class _Environment:
    """Looks variables up in ``os.environ``, then in ``./.env`` (read once, only when needed)."""

    def __init__(self) -> None:
        self._dotenv: dict[str, str | None] | None = None
        # Every value looked up: what an error message about the server must not show.
        self.used: set[str] = set()

    def get(self, name: str) -> str | None:
        value = os.environ.get(name)
        if value is None:
            if self._dotenv is None:
                from dotenv import dotenv_values

                path = Path.cwd() / ".env"
                self._dotenv = dict(dotenv_values(path)) if path.is_file() else {}
            value = self._dotenv.get(name)
        if value:
            self.used.add(value)
        return value


def _substitute(value: Any, environment: _Environment) -> Any:
    if isinstance(value, str):
        if "${" not in value:
            return value

        def replace(match: re.Match[str]) -> str:
            name = match.group(1)
            resolved = environment.get(name)
            if resolved is None:
                raise ServerParamsError(
                    f"MCP server parameters refer to ${{{name}}}, but the environment variable {name} is not set: "
                    f"set it, or add it to the .env file in {Path.cwd()}."
                )
            return resolved

        return _PLACEHOLDER.sub(replace, value)
    if isinstance(value, Mapping):
        return {key: _substitute(item, environment) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_substitute(item, environment) for item in value]
    return value
