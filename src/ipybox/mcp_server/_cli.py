"""The ``ipybox`` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import stat
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ipybox._wire import UserEnv
from ipybox.app.approval import Policy, load_policy
from ipybox.errors import IpyboxError, PolicyError
from ipybox.mcp_server._server import Settings, SingleSession, build_server
from ipybox.mcp_server._session_limits import DEFAULT_IDLE_TIMEOUT

_DESCRIPTION = """\
Run ipybox as an MCP server. An agent (Claude Code, Claude Desktop, any MCP client) gets
tools to run Python in a stateful IPython kernel, to turn other MCP servers into Python
modules it can call from that code, to install packages, to reset the kernel and to move
files in and out of the workspace.

By default the server talks MCP over stdin/stdout: add it to the agent's MCP configuration
as the command `ipybox --workspace /path/to/project`. With --transport streamable-http it
serves http://HOST:PORT/mcp instead; clients must send `Authorization: Bearer <token>`, the
token being $IPYBOX_MCP_TOKEN or, if unset, one generated and printed at start. Each HTTP
session gets its own kernel and works in a new folder of its own,
WORKSPACE/sessions/<time>-<random> (printed to stderr, kept when the session ends); under
--sandbox no session's kernel can read or write another's folder. --shared-workspace lets all
sessions work in WORKSPACE itself instead.
"""

_EPILOG = """\
environment:
  KERNEL_ENV_NAME=value   reaches the kernel as NAME=value (also read from WORKSPACE/.env);
                          no other variable of the server's environment does, except HOME
                          and PATH (the folder of the kernel's own Python first)
  ${VAR} in server_params of register_mcp_server is filled from the server's environment
                          or WORKSPACE/.env, never shown to the kernel
  IPYBOX_MCP_TOKEN        bearer token for --transport streamable-http

commands:
  ipybox auth {list,login,logout}   OAuth logins of HTTP MCP servers ("oauth": true in server_params);
                                    a server without one fails saying to run `ipybox auth login`
  ipybox audit [--session S] [--server S] [--tool T] [--decision D] [--since WHEN] [--json]
                          show the audit trail of tool calls (ipybox audit --help)

examples:
  ipybox --workspace ~/project
  ipybox --workspace ~/project --policy ~/.config/ipybox/policy.toml
  ipybox --workspace ~/project --transport streamable-http --port 8765
"""


def _version() -> str:
    from importlib.metadata import version

    return version("ipybox")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="ipybox",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ipybox {_version()}")
    parser.add_argument(
        "--workspace",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="folder the kernel works in, generated tool modules going to DIR/mcptools; over HTTP each "
        "session works in a folder of its own in DIR/sessions (default: .)",
    )
    parser.add_argument(
        "--sandbox",
        action="store_true",
        help="run the kernel in Anthropic's sandbox-runtime (no network except MCP tool calls)",
    )
    parser.add_argument(
        "--sandbox-config",
        type=Path,
        metavar="FILE",
        help="sandbox-runtime settings file (implies --sandbox)",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log level of ipybox's parts, written to stderr (default: WARNING)",
    )
    parser.add_argument(
        "--transport",
        choices=["stdio", "streamable-http"],
        default="stdio",
        help="how clients connect (default: stdio)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on with streamable-http (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port to listen on with streamable-http; 0 picks a free one (default: 8000)",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="with streamable-http: another Host name clients may use (e.g. behind a proxy); repeatable",
    )
    parser.add_argument(
        "--session-idle-timeout",
        "--session-timeout",
        dest="session_timeout",
        type=_seconds_or_none,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="with streamable-http: close a session and stop its kernel after this long without requests "
        "or a running cell (a client coming back is told so); 0 or none never does (default: 3600)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        help="with streamable-http: the most sessions open at once; the next client is refused with an "
        "error until one ends (default: as many as the available memory holds, 256 MiB each after a reserve)",
    )
    parser.add_argument(
        "--shared-workspace",
        action="store_true",
        help="with streamable-http: all sessions work in the workspace itself, not each in a folder of "
        "its own; every session's kernel can then change what the others import and read (one trust domain)",
    )
    parser.add_argument(
        "--pool",
        type=int,
        metavar="N",
        help="keep N kernels started ahead in one kernel gateway shared by every session, so that a new "
        "session takes a ready kernel (in a session folder made ahead for it, over streamable-http) "
        "instead of starting one",
    )
    parser.add_argument(
        "--approve-tool-calls",
        action="store_true",
        help="put every MCP tool call and shell command a cell makes to the person at the MCP client "
        "(elicitation: accept or decline) instead of running it unasked; the client must support elicitation",
    )
    parser.add_argument(
        "--approval-timeout",
        type=float,
        default=60,
        metavar="SECONDS",
        help="with --approve-tool-calls: how long each question waits for its answer; an answer that comes "
        "later is refused and the call does not run (default: 60)",
    )
    parser.add_argument(
        "--otel",
        action="store_true",
        help="send OpenTelemetry traces (a span per cell, tool call, approval wait and MCP server start) over "
        "OTLP/HTTP to $OTEL_EXPORTER_OTLP_ENDPOINT (default http://localhost:4318); needs ipybox[otel]",
    )
    parser.add_argument(
        "--policy",
        type=Path,
        metavar="FILE",
        help="policy rules (TOML) for inner tool calls and shell commands: allow, ask or deny by server, tool, "
        "annotations or program; outside the workspace (the kernel can write there)",
    )
    parser.add_argument(
        "--kernel-gateway-url",
        metavar="URL",
        help="run each session's kernel on this existing Jupyter gateway (Kernel Gateway, or Enterprise "
        f"Gateway on a cluster) instead of a local one; its token from ${UserEnv.KERNEL_GATEWAY_TOKEN}",
    )
    parser.add_argument(
        "--kernel-name",
        metavar="NAME",
        help="with --kernel-gateway-url: the gateway's kernel spec to start (default: the gateway's default)",
    )
    parser.add_argument(
        "--no-audit",
        dest="audit",
        action="store_false",
        help="do not record tool calls in the audit trail (shown by `ipybox audit`)",
    )
    args = parser.parse_args(argv)
    if not (args.approval_timeout > 0 and math.isfinite(args.approval_timeout)):
        parser.error(f"--approval-timeout {args.approval_timeout:g}: give a positive number of seconds.")
    args.policy_path = args.policy
    if args.policy is not None:
        args.policy_path = args.policy.expanduser().resolve()
        args.policy = _read_policy(parser, args.policy, args.workspace.expanduser())
    if args.sandbox_config is not None:
        args.sandbox = True
        args.sandbox_config = _sandbox_config(parser, args.sandbox_config, args.workspace.expanduser())
    _check_gateway_args(parser, args)
    workspace: Path = args.workspace.expanduser()
    if workspace.exists() and not workspace.is_dir():
        parser.error(f"--workspace {workspace}: this is a file, not a folder.")
    http_only = (
        args.port != 8000
        or args.host != "127.0.0.1"
        or args.allow_host
        or args.session_timeout != DEFAULT_IDLE_TIMEOUT
        or args.max_sessions is not None
        or args.shared_workspace
    )
    if args.transport == "stdio" and http_only:
        parser.error(
            "--host, --port, --allow-host, --session-idle-timeout, --max-sessions and --shared-workspace apply "
            "only with --transport streamable-http (over stdio the one session works in the workspace itself)."
        )
    _check_pool(parser, args)
    if args.session_timeout is not None and (
        args.session_timeout < 0 or not math.isfinite(args.session_timeout)
    ):
        parser.error(
            f"--session-idle-timeout {args.session_timeout:g}: give a number of seconds, or 0 (or none) for never."
        )
    if args.max_sessions is not None and args.max_sessions < 1:
        parser.error(f"--max-sessions {args.max_sessions}: give a number of sessions, at least 1.")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: give a port between 1 and 65535, or 0 for a free one.")
    return args


def _seconds_or_none(text: str) -> float | None:
    """A number of seconds; ``none`` (or 0, given as such) for never."""
    if text.strip().lower() in ("none", "never", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (or none)") from None


def _check_pool(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.pool is not None and args.pool < 0:
        parser.error(f"--pool {args.pool}: give a number of kernels to keep ready, 0 or more.")


def _check_gateway_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what does not go with ``--kernel-gateway-url`` (or needs it)."""
    if args.kernel_gateway_url is None:
        if args.kernel_name is not None:
            parser.error("--kernel-name applies only with --kernel-gateway-url.")
        return
    if args.sandbox:
        parser.error(
            "--sandbox and --sandbox-config cannot be used with --kernel-gateway-url: the kernel runs on the "
            "gateway's cluster, which isolates it (use its own policies)."
        )
    if args.pool is not None:
        parser.error(
            "--pool cannot be used with --kernel-gateway-url: a pool keeps kernels on a local gateway; "
            "keep kernels warm on the cluster's side instead (see deploy/)."
        )
    from ipybox.app._settings import ExecutorSettings

    try:
        ExecutorSettings(kernel_gateway_url=args.kernel_gateway_url)
    except ValueError as exc:
        parser.error(f"--kernel-gateway-url: {exc}")


def _sandbox_config(parser: argparse.ArgumentParser, path: Path, workspace: Path) -> Path:
    """The file of ``--sandbox-config``; an error for a missing one, or one the kernel could change."""
    if not path.is_file():
        parser.error(f"--sandbox-config {path}: no such file; give the path of a settings file.")
    path = path.resolve()
    if path.is_relative_to(workspace.resolve()):
        parser.error(
            f"--sandbox-config {path}: the file lies in the workspace, which the kernel (or an earlier "
            "unsandboxed run) can write, so it could loosen its own sandbox for the next start; keep it "
            "outside (e.g. ~/.config/ipybox/sandbox-config.json)."
        )
    return path


def _read_policy(parser: argparse.ArgumentParser, path: Path, workspace: Path) -> Policy:
    """The policy of ``--policy``; an error for a file the kernel could change, or a malformed one."""
    path = path.expanduser().resolve()
    if path.is_relative_to(workspace.resolve()):
        parser.error(
            f"--policy {path}: the file lies in the workspace, which the kernel can write, so code in the "
            "kernel could change the rules for the next start; keep it outside (e.g. ~/.config/ipybox/)."
        )
    try:
        return load_policy(path)
    except PolicyError as exc:
        parser.error(f"--policy: {exc}")


def main(argv: list[str] | None = None) -> None:
    """Run the ``ipybox`` command (``ipybox auth ...`` manages OAuth logins, ``ipybox audit ...``
    shows the audit trail)."""
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["auth"]:
        from ipybox.mcp_server._auth_cli import auth_main

        auth_main(arguments[1:])
        return
    if arguments[:1] == ["audit"]:
        from ipybox.mcp_server._audit_cli import main as audit_main

        audit_main(arguments[1:])
        return
    args = parse_args(argv)
    from ipybox.mcp_server._auth_cli import refuse_browser_step

    refuse_browser_step()
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="ipybox %(levelname)s %(name)s: %(message)s"
    )
    workspace: Path = args.workspace.expanduser()
    workspace.mkdir(parents=True, exist_ok=True)
    workspace = workspace.resolve()
    # `${VAR}` substitution reads `.env` from the working directory: the workspace's.
    os.chdir(workspace)
    settings = Settings(
        workspace=workspace,
        sandbox=args.sandbox,
        sandbox_config=args.sandbox_config,
        log_level=args.log_level,
        approve_tool_calls=args.approve_tool_calls,
        approval_timeout=args.approval_timeout,
        tracing=args.otel,
        policy=args.policy,
        audit=args.audit,
        kernel_gateway_url=args.kernel_gateway_url,
        kernel_gateway_token=os.environ.get(UserEnv.KERNEL_GATEWAY_TOKEN) or None,
        kernel_name=args.kernel_name,
    )
    _announce_oversight(args)
    if args.transport == "stdio" and (problem := _stdin_problem()) is not None:
        print(
            f"ipybox: {problem}, so no MCP client can talk to this server over stdio. An MCP client "
            "starts `ipybox` itself with a pipe on its stdin (give it the command in the client's "
            "configuration); to serve clients over the network, use --transport streamable-http.",
            file=sys.stderr,
        )
        raise SystemExit(1)
    provider = _start_tracing() if args.otel else None
    try:
        if args.transport == "stdio":
            _run(_pooled(settings, args.pool, _serve_stdio))
        else:
            from ipybox.mcp_server._http import serve_http

            # uvicorn handles SIGINT and SIGTERM itself: it shuts the sessions (and their
            # executors) down, then raises the signal again.
            with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
                asyncio.run(
                    _pooled(
                        # The pool makes the sessions' folders ahead, as the server would.
                        dataclasses.replace(settings, session_folders=not args.shared_workspace),
                        args.pool,
                        lambda pooled: serve_http(
                            pooled,
                            host=args.host,
                            port=args.port,
                            allowed_hosts_extra=args.allow_host,
                            # 0 means never, as None does.
                            session_timeout=args.session_timeout or None,
                            shared_workspace=args.shared_workspace,
                            max_sessions=args.max_sessions,
                        ),
                    )
                )
    except IpyboxError as exc:
        print(f"ipybox: could not start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if provider is not None:
            provider.shutdown()  # sends the spans still buffered


def _stdin_problem() -> str | None:
    """What makes stdin unusable for MCP over stdio, or ``None``: it is closed, or a device other
    than a terminal (``< /dev/null``), which reads nothing and which asyncio cannot watch."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return "stdin is closed"
    if stat.S_ISCHR(mode) and not os.isatty(0):
        return f"stdin is {os.devnull} or another device that is not a terminal"
    return None


def _announce_oversight(args: argparse.Namespace) -> None:
    """Say which policy decides the inner tool calls, and where they are recorded."""
    from ipybox.app.approval import default_audit_path
    from ipybox.mcp_server._announce import announce

    policy: Policy | None = args.policy
    if policy is not None:
        count = len(policy.rules)
        announce(
            f"policy {args.policy_path}: {count} rule{'' if count == 1 else 's'} loaded, "
            f"default {policy.default!r}"
        )
    if args.audit:
        announce(f"audit trail: {default_audit_path()} (shown by `ipybox audit`)")
    else:
        announce("audit trail: off (--no-audit)")


def _start_tracing() -> Any:
    try:
        from ipybox.app._tracing import configure_otlp

        return configure_otlp()
    except ImportError as exc:
        print(
            f"ipybox: --otel needs the OpenTelemetry SDK and OTLP exporter ({exc}); install them with "
            "`pip install 'ipybox[otel]'` (or `uv tool install 'ipybox[otel]'`), or drop --otel.",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


async def _pooled(
    settings: Settings, size: int | None, serve: Callable[[Settings], Coroutine[Any, Any, None]]
) -> None:
    """Run `serve` with the settings, on a kernel pool of `size` ready kernels (``--pool``) if given;
    the pool (its gateway and kernels) stops when `serve` ends."""
    if size is None:
        await serve(settings)
        return
    from ipybox.mcp_server._announce import announce, stage

    async def show_filling() -> None:
        with stage(f"a pool of {size} {'sandboxed ' if settings.sandbox else ''}kernels"):
            await pool.filled(lambda ready: announce(f"kernels ready: {ready} of {size}"))

    async with settings.kernel_pool(size) as pool:
        # The person who started the server sees the pool fill, while the server already serves.
        filling = asyncio.create_task(show_filling())
        try:
            await serve(dataclasses.replace(settings, pool=pool))
        finally:
            filling.cancel()
            # Broad: how the display ended (cancelled, or the pool failed, which serving reports) changes nothing.
            with contextlib.suppress(BaseException):
                await filling


async def _serve_stdio(settings: Settings) -> None:
    from mcp.server.stdio import stdio_server

    from ipybox.mcp_server._announce import announce, stage
    from ipybox.mcp_server._stdio import stdio_pipes

    async with contextlib.AsyncExitStack() as stack:
        with stage(f"the {'sandboxed ' if settings.sandbox else ''}kernel"):
            tools = await stack.enter_async_context(settings.session())
        announce("serving MCP over stdin/stdout")
        stdin, stdout = await stack.enter_async_context(stdio_pipes())
        server = build_server(SingleSession(tools))
        async with stdio_server(stdin=stdin, stdout=stdout) as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` until it ends or SIGINT/SIGTERM arrive; either way everything it started stops."""

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # Windows
                loop.add_signal_handler(signum, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await coro

    asyncio.run(runner())
