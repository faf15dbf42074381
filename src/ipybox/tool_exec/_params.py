"""MCP server parameters: validated, ``${VAR}`` placeholders resolved, frozen (application side only).

A stdio server becomes :class:`StdioParams`, an HTTP server :class:`HttpParams`; the tool
server and the code generator hand either to :class:`ipybox.tool_exec._mcp.MCPSession`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx2

from ipybox.errors import ServerParamsError

__all__ = ["HttpParams", "StdioParams", "confine", "resolve_params"]

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_STDIO_KEYS = frozenset({"command", "args", "env", "cwd", "type"})
_HTTP_KEYS = frozenset({"url", "headers", "type"})
# What makes a folder a program that Python or Node runs (``python DIR``, ``node DIR``).
_PROGRAM_MARKERS = ("__main__.py", "package.json", "index.js")
_SCRIPT_SUFFIXES = (".py", ".pyz", ".js", ".mjs", ".cjs", ".ts", ".sh", ".jar")
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
    """

    url: str
    headers: dict[str, str]
    transport: Literal["streamable_http", "sse"]
    secrets: tuple[str, ...] = field(default=(), repr=False, compare=False)


def resolve_params(server_params: Mapping[str, Any]) -> StdioParams | HttpParams:
    """Validate MCP server parameters and replace their ``${VAR}`` placeholders.

    A stdio server is given as ``{"command", "args", "env", "cwd"}``, an HTTP server as
    ``{"url", "headers", "type"}`` where ``type`` is ``"streamable_http"`` or ``"sse"``; without
    ``type`` the transport follows the URL path (``.../sse`` is SSE, anything else streamable
    HTTP). ``${VAR}`` in any string is replaced from this process's environment, or else from
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


def confine(
    server_name: str, params: StdioParams, writable: Sequence[Path], readonly: Sequence[Path] = ()
) -> StdioParams:
    """Refuse a stdio server that a sandboxed kernel could change, and pin its command.

    A server runs outside the sandbox, so its program must not come from where the kernel can
    write: its working directory, its command (looked up on ``PATH`` here and returned as an
    absolute path), the ``PATH`` it gets, every argument that names a file (or a script yet to be
    written), with the file's folder, where Python and Node look for modules first, and the
    ``PYTHONPATH`` / ``NODE_PATH`` entries of its ``env``. A folder argument is taken as data
    (the filesystem server's root), unless it holds ``__main__.py``, ``package.json`` or
    ``index.js``. Links are followed: both the given and the real
    path are checked.

    Args:
        server_name: The server's name, for the message.
        params: The resolved parameters.
        writable: Folders the kernel can write.
        readonly: Paths inside them that the kernel cannot write (the sandbox's ``denyWrite``).

    Returns:
        The parameters with ``command`` made absolute (when it was found).

    Raises:
        ServerParamsError: A path of the server lies in a folder the kernel can write.
    """
    roots = _forms(writable)
    carved = _forms(readonly)
    base = params.cwd or None
    env_path = (params.env or {}).get("PATH", os.environ.get("PATH", os.defpath))
    command = params.command
    if os.sep in command:
        command = os.path.join(base, command) if base and not os.path.isabs(command) else command
    else:
        command = shutil.which(command, path=env_path) or command
    # A command that was not found fails to start on its own; only a found one is checked.
    candidates: list[tuple[str, str]] = [("command", command)] if os.sep in command else []
    if params.cwd:
        candidates.append(("working directory", params.cwd))
    # The server starts programs of its own from PATH (npx starts node, uvx its tools).
    candidates += [("PATH entry", folder) for folder in env_path.split(os.pathsep) if os.path.isabs(folder)]
    for arg in params.args:
        path = os.path.join(base, arg) if base and not os.path.isabs(arg) else arg
        if not os.path.isabs(path):
            continue
        if os.path.isdir(path):
            # A folder is data (the filesystem server's root, say), unless it is a program.
            if any(os.path.exists(os.path.join(path, marker)) for marker in _PROGRAM_MARKERS):
                candidates.append(("argument", path))
            continue
        # A file, or a script that does not exist yet (the kernel could create it in time).
        if os.path.exists(path) or path.endswith(_SCRIPT_SUFFIXES):
            candidates += [("argument", path), ("folder of argument", os.path.dirname(path))]
    for name in ("PYTHONPATH", "NODE_PATH"):
        for entry in (params.env or {}).get(name, "").split(os.pathsep):
            if entry:
                candidates.append((name, entry))
    for what, path in candidates:
        for form in (os.path.abspath(path), os.path.realpath(path)):
            root = next((r for r in roots if _within(form, r)), None)
            if root is not None and not any(_within(form, r) for r in carved):
                raise ServerParamsError(
                    f"MCP server {server_name!r} is refused: its {what} {path} lies in {root}, which the "
                    "sandboxed kernel can write, so code in the kernel could change what this server runs "
                    "outside the sandbox. Move the server (and its working directory) out of the kernel's "
                    "working directory, or run the executor with a working_dir that does not contain it."
                )
    return replace(params, command=command) if os.path.isabs(command) else params


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
    return HttpParams(url=url, headers=dict(headers), transport=transport)


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
