"""Infrastructure the application process shares: one helper for each thing it does in several places.

- `listen`: a listening TCP or Unix socket, to hand to uvicorn (the port is read back from it).
- `Uvicorn`: uvicorn serving an ASGI app in this process's event loop.
- `DIRECT_TEXT`: the scope extension through which a WebSocket connection hands the app a
  synchronous handler of text messages; `disconnected`: wait for an HTTP client to hang up.
- `BearerToken` and `Guard`: the bearer token, Host and Origin checks, for HTTP and WebSocket alike.
- `kill_tree`: stop a process with its descendants (and its process group); `running`.
- `strip_ansi`: remove terminal escape sequences; `ANSI_TAIL` finds one a later chunk completes.
- `spawn_with_own_pipes` and `OwnPipes`: a child process whose exit a grandchild cannot hide.

Application side only: the kernel-side modules (``kernel/_tool_client.py``, ``kernel/_ext.py``)
use the standard library alone and must not import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

# The scope extension through which a WebSocket connection of the tool server's uvicorn protocol
# hands an application a synchronous handler of text messages.
DIRECT_TEXT = "ipybox.direct_text"


# --- listening sockets


def listen(host: str | Path, port: int = 0, *, backlog: int = 128) -> socket.socket:
    """A non-blocking socket listening on TCP `host`:`port` (port ``0`` picks a free one), or, for
    a `Path`, a Unix socket at that path that only this user may connect to.

    Raises:
        OSError: The address could not be bound (e.g. the port is in use).
    """
    if isinstance(host, Path):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that name it, and
        # without it every response waits for the client's delayed ACK (~40 ms).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if isinstance(host, Path):
            sock.bind(str(host))
            # Connecting needs write permission, which the umask never gives to others.
            host.chmod(0o600)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# --- serving an ASGI app


class Uvicorn(uvicorn.Server):
    """uvicorn serving an ASGI app in this event loop, on sockets bound by the caller (`listen`).

    `ready` is set once it accepts connections; `request_exit` stops it at once. With
    ``handle_signals=False`` (an embedded server) SIGINT and SIGTERM are left to the
    application; with ``True`` (a server that is the process) uvicorn handles them and raises
    the signal again once shut down. Other keyword arguments go to ``uvicorn.Config``.
    """

    def __init__(self, app: ASGIApp, *, handle_signals: bool = False, **config: object) -> None:
        super().__init__(uvicorn.Config(app, **config))  # type: ignore[arg-type]
        self.ready = asyncio.Event()
        self._handle_signals = handle_signals
        self._exit_requested = asyncio.Event()

    def request_exit(self) -> None:
        """Ask the server to shut down now, rather than at its next 0.1 s tick."""
        self.should_exit = True
        self._exit_requested.set()

    async def start(self, sockets: list[socket.socket]) -> asyncio.Task[None]:
        """Serve on `sockets` in a task of its own; return it once the server accepts connections.

        Raises:
            RuntimeError: The server stopped before it was ready; the message says why.
        """
        task = asyncio.create_task(self.serve(sockets=sockets), name="ipybox-uvicorn")
        ready = asyncio.create_task(self.ready.wait())
        try:
            await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            ready.cancel()
            task.cancel()
            raise
        if ready.done():
            return task
        ready.cancel()
        try:
            await task
        except BaseException as exc:  # broad: uvicorn ends a failed start with SystemExit (the task is done)
            raise RuntimeError(str(exc) or type(exc).__name__) from exc
        raise RuntimeError("uvicorn stopped before it was ready")

    async def main_loop(self) -> None:
        # uvicorn's own loop, except that it wakes at once when an exit is requested.
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_requested.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self._handle_signals:
            with super().capture_signals():
                yield
        else:
            yield


# --- bearer token, Host and Origin


class BearerToken:
    """Checks an ``Authorization`` header value against a bearer token.

    The rule: ``<scheme> <token>``, the scheme ``Bearer`` in any case (RFC 9110), white space
    around the value and between the two ignored, the token compared in constant time.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("A bearer token must not be empty; generate one with secrets.token_urlsafe().")
        self._token = token.encode()

    def accepts(self, authorization: bytes | str) -> bool:
        """Whether `authorization` (an ``Authorization`` header value) carries the token."""
        value = authorization.encode() if isinstance(authorization, str) else authorization
        scheme, _, credentials = value.strip().partition(b" ")
        # compare_digest takes as long whatever the scheme: the scheme test comes after it.
        matches = hmac.compare_digest(credentials.lstrip(), self._token)
        return matches and scheme.lower() == b"bearer"


class Guard:
    """ASGI middleware that refuses, for HTTP requests and WebSocket connections alike, a Host
    not in `allowed_hosts` (421; `None` allows any), an ``Origin`` header that is not one of
    those hosts (403; what a DNS-rebinding or cross-site web page sends), and a request without
    the bearer `token` (401; `None` asks for none). A refused WebSocket is closed before it opens
    (the client sees 403). Other scopes (lifespan) pass.

    Args:
        hint: Appended to the 401 message: where the client finds the token.
        jsonrpc: Refuse HTTP requests with a JSON-RPC error body, the form MCP clients show to
            their user (they show only a stand-in for any other body); else ``{"error": message}``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        allowed_hosts: Iterable[str] | None,
        hint: str = "",
        jsonrpc: bool = False,
    ) -> None:
        self.app = app
        self.token = BearerToken(token) if token is not None else None
        self.allowed_hosts = {host.lower() for host in allowed_hosts} if allowed_hosts is not None else None
        self.allowed_origins = {
            f"{scheme}://{host}" for host in self.allowed_hosts or () for scheme in ("http", "https")
        }
        self.hint = hint
        self.jsonrpc = jsonrpc

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """The status and message to refuse an HTTP or WebSocket scope with, or `None` to let it in."""
        host, origin, authorization = "", None, None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1").lower()
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"authorization":
                authorization = value
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return 421, f"Host {host!r} is not served here; use one of {sorted(self.allowed_hosts)}."
        if origin is not None and origin.lower().rstrip("/") not in self.allowed_origins:
            return 403, f"Requests from origin {origin!r} are not allowed."
        if self.token is not None and (authorization is None or not self.token.accepts(authorization)):
            return 401, f"Send the server's token as 'Authorization: Bearer <token>'{self.hint}."
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refused = self.refusal(scope)
            if refused is not None:
                if scope["type"] == "http":
                    await refuse_http(send, *refused, jsonrpc=self.jsonrpc)
                else:
                    await send({"type": "websocket.close", "code": 1008, "reason": refused[1][:120]})
                return
        await self.app(scope, receive, send)


# JSON-RPC's "Invalid Request": what a refused request's error is, to an MCP client.
_INVALID_REQUEST = -32600


async def refuse_http(send: Send, status: int, message: str, *, jsonrpc: bool = False) -> None:
    """Answer an HTTP request with `status` and ``{"error": message}`` (with `jsonrpc`, a JSON-RPC
    error with no id: the request was refused before it was read)."""
    error: object = {"code": _INVALID_REQUEST, "message": message} if jsonrpc else message
    body = json.dumps(
        {"jsonrpc": "2.0", "id": None, "error": error} if jsonrpc else {"error": error}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="ipybox"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- process trees


async def disconnected(receive: Receive) -> None:
    """Return once the client has closed its connection (the request body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def kill_tree(pid: int, grace: float = 0.0, *, group: bool = False, groups: bool = False) -> None:
    """Stop `pid` and every process it started: SIGTERM, up to `grace` seconds to end, then SIGKILL.

    With `group`, every process of the process group `pid` leads goes too, also those whose
    parent has already ended. With `groups`, so does every process group a descendant leads (a
    kernel's: Jupyter starts each kernel in a session of its own), with what its processes start
    after the tree was listed (srt's proxy bridges, started while it sets the sandbox up). With
    ``grace=0`` all are killed at once, without waiting. A process of ours that ends is not reaped
    here: the caller waits for it.
    """
    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.Error:
        procs = []
    leaders = [pid] if group else []
    if groups:
        leaders += [proc.pid for proc in procs[1:] if _leads_group(proc.pid)]
    if grace > 0:
        _signal(leaders, procs, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            procs = [proc for proc in procs if running(proc)]
            if not procs and not any(_group_exists(leader) for leader in leaders):
                return
            await asyncio.sleep(0.01)
    _signal(leaders, procs, signal.SIGKILL)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _signal(leaders: list[int], procs: list[psutil.Process], signum: int) -> None:
    for leader in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(leader, signum)
    for proc in procs:
        # psutil checks that the pid still names the same process (no pid reuse).
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signum)


def running(proc: psutil.Process) -> bool:
    """Whether a process still runs; an exited one waiting to be reaped (a zombie) does not."""
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# --- terminal escapes

# CSI (colours, cursor moves), OSC (titles, hyperlinks; ended by BEL or ST), DCS/SOS/PM/APC
# strings (ended by ST), and the two- or three-byte escapes (charset selection, ESC c, ESC 7).
ANSI = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[PX^_][^\x1b]*\x1b\\|[ -/]*[0-Z\\`-~])"
)


# The start of one of those sequences, at the end of a text, that a later chunk of the same stream
# completes (the same grammar, each part's ending optional).
ANSI_TAIL = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*\x1b?|[PX^_][^\x1b]*\x1b?|[ -/]*)\Z")


def strip_ansi(text: str) -> str:
    """`text` without terminal escape sequences."""
    return ANSI.sub("", text)


@dataclasses.dataclass
class OwnPipes:
    """A child's standard input and output as pipes of ours, not of its asyncio process object.

    On Python 3.11, waiting for a process whose pipes asyncio holds ends only when every copy of
    them is closed: one grandchild that outlives the child (a kernel of the gateway) holds the
    wait for ever. With pipes of our own the wait ends when the child does; `close` them after.
    """

    output: asyncio.StreamReader
    transport: asyncio.ReadTransport
    stdin: int

    def close(self) -> None:
        self.transport.close()
        with contextlib.suppress(OSError):
            os.close(self.stdin)


async def spawn_with_own_pipes(
    command: list[str], env: dict[str, str], cwd: Path
) -> tuple[asyncio.subprocess.Process, OwnPipes]:
    """Start `command` with its input and output (stderr too) on pipes of our own (see `OwnPipes`)."""
    # The input is held open, never written: the child can tell from its end of file that this
    # process ended, however it ended (even SIGKILL).
    stdin_read, stdin_write = os.pipe()
    output_read, output_write = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            *command, stdin=stdin_read, stdout=output_write, stderr=output_write, env=env, cwd=cwd
        )
    except BaseException:
        os.close(stdin_write)
        os.close(output_read)
        raise
    finally:
        os.close(stdin_read)
        os.close(output_write)
    output = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(output), os.fdopen(output_read, "rb", buffering=0)
    )
    return process, OwnPipes(output, transport, stdin_write)
