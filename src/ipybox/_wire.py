"""The contract between ipybox's processes: environment variable names and the tool server's messages.

Each name is defined here once, and the process that writes it and the one that reads it both
import it from here. The kernel imports this module, so it uses the standard library only.

Two launch scripts run as ``python -I -S <file>`` and cannot import ipybox:
``gateway/_limits.py`` writes `GatewayEnv.KERNEL_GROUPS` as a literal; a test checks it
equals the name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final


@dataclass(frozen=True)
class ToolServerEnv:
    """Where a kernel's tool calls go.

    Written by the application (``app/executor/_executor.py``) into the kernel's environment; read by the
    kernel (``kernel/_tool_client.py``). `proxy` is set by whoever starts a kernel that reaches
    the tool server only through an HTTP proxy.
    """

    HOST: ClassVar[str] = "TOOL_SERVER_HOST"
    PORT: ClassVar[str] = "TOOL_SERVER_PORT"
    TOKEN: ClassVar[str] = "TOOL_SERVER_TOKEN"
    PROXY: ClassVar[str] = "TOOL_SERVER_PROXY"
    SOCKET: ClassVar[str] = "TOOL_SERVER_SOCKET"
    CHANNEL: ClassVar[str] = "TOOL_SERVER_CHANNEL"
    """``"stdin"``: tool calls go over the kernel's stdin channel (`StdinChannel`), not HTTP."""

    host: str = "localhost"
    port: int = 8900
    token: str | None = None
    proxy: str | None = None
    socket: str | None = None
    channel: str | None = None

    def to_env(self) -> dict[str, str]:
        """The environment variables that give this address (unset fields are left out)."""
        env = {self.HOST: self.host, self.PORT: str(self.port)}
        for name, value in (
            (self.TOKEN, self.token),
            (self.PROXY, self.proxy),
            (self.SOCKET, self.socket),
            (self.CHANNEL, self.channel),
        ):
            if value is not None:
                env[name] = value
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ToolServerEnv:
        """The address `environ` gives; an empty variable counts as unset (the token excepted)."""
        return cls(
            host=environ.get(cls.HOST) or "localhost",
            port=int(environ.get(cls.PORT) or 8900),
            token=environ.get(cls.TOKEN),
            proxy=environ.get(cls.PROXY) or None,
            socket=environ.get(cls.SOCKET) or None,
            channel=environ.get(cls.CHANNEL) or None,
        )


class KernelEnv:
    """What the kernel extension does at start; a flag is on when its value is ``"1"``.

    Written by the application (``app/executor/_executor.py``, ``app/kernels/_gateway.py``) into the kernel's
    environment; read, and removed from it, by the kernel extension (``kernel/_ext.py``).
    """

    START_DIR: Final = "IPYBOX_START_DIR"
    WORKING_DIR: Final = "IPYBOX_WORKING_DIR"
    APPROVE_SHELL: Final = "IPYBOX_APPROVE_SHELL"
    EXEC_WALL: Final = "IPYBOX_EXEC_WALL"
    REQUIRE_SHELL_ESCAPE: Final = "IPYBOX_REQUIRE_SHELL_ESCAPE"
    WARM_IMPORTS: Final = "IPYBOX_WARM_IMPORTS"
    """Comma-separated modules the kernel imports in the background once it is in use and idle."""


class PoolEnv:
    """What a pool's sandboxed kernel's launcher (``gateway/_kernel_launch.py``, which keeps the
    names as literals: a test checks them) reads from the kernel's own environment, written by the
    pool (``app/pool/_places.py``) into the request that creates the kernel."""

    SETTINGS: Final = "IPYBOX_KERNEL_SETTINGS"
    """The srt settings of the kernel's working directory, when it is not the gateway's."""


class GatewayEnv:
    """How the kernel gateway process runs.

    Written by the application (``app/kernels/_gateway.py``, and ``gateway/_limits.py`` as imported
    there) into the gateway's environment; read by the gateway (``gateway/_main.py``).
    """

    GATEWAY_LOCK: Final = "IPYBOX_GATEWAY_LOCK"
    EXIT_WITH_PARENT: Final = "IPYBOX_EXIT_WITH_PARENT"
    KERNEL_GROUPS: Final = "IPYBOX_KERNEL_GROUPS"


class McpServerEnv:
    """Marks the MCP server processes of one session so their leftovers can be found.

    Written by the application (``app/mcp_client/_session.py``) into each MCP server's environment; read back by
    the application from the processes it finds.
    """

    SESSION: Final = "IPYBOX_MCP_SESSION"


class UserEnv:
    """Settings the user gives; read by the application or the ``ipybox`` MCP server."""

    STATE_DIR: Final = "IPYBOX_STATE_DIR"
    """Where the server registry lives (``app/mcp_client/_registry.py``)."""
    SRT: Final = "IPYBOX_SRT"
    """The sandbox runtime to use (``app/sandbox/_srt.py``)."""
    MCP_TOKEN: Final = "IPYBOX_MCP_TOKEN"
    """The bearer token of the MCP server's HTTP transport (``mcp_server/_http.py``)."""
    KERNEL_GATEWAY_TOKEN: Final = "IPYBOX_KERNEL_GATEWAY_TOKEN"
    """The token of the gateway ``--kernel-gateway-url`` names (``mcp_server/_cli.py``)."""


class RunFields:
    """The field names of a ``POST /run`` body.

    Built by the kernel (``kernel/_calls.py``); validated by the tool server
    (``app/tools/_server.py``), whose model has these fields.
    """

    SERVER_NAME: ClassVar[str] = "server_name"
    SERVER_PARAMS: ClassVar[str] = "server_params"
    TOOL_NAME: ClassVar[str] = "tool_name"
    TOOL_ARGS: ClassVar[str] = "tool_args"
    CONTENT: ClassVar[str] = "content"
    """Whether the answer carries every content part and the structured content."""

    ALL: ClassVar[frozenset[str]] = frozenset({SERVER_NAME, SERVER_PARAMS, TOOL_NAME, TOOL_ARGS, CONTENT})


def run_head(server_name: str, server_params: dict[str, Any] | None) -> dict[str, Any]:
    """The start of a ``/run`` body for one server (what every call to it repeats)."""
    head: dict[str, Any] = {RunFields.SERVER_NAME: server_name}
    if server_params:
        head[RunFields.SERVER_PARAMS] = server_params
    return head


class ToolServerPaths:
    """The tool server's endpoints that a kernel calls (``app/tools/_server.py`` serves them)."""

    RUN: Final = "/run"
    APPROVE: Final = "/approve"
    SHELL: Final = "/shell"
    RESET: Final = "/reset"


class AnswerFields:
    """The field names of the tool server's JSON answers to ``/run``, ``/approve`` and errors.

    Written by the tool server (``app/tools/_server.py``); read by the kernel
    (``kernel/_calls.py``). An error answers ``{ERROR: {KIND: <outcome kind>, MESSAGE: ...}}``.
    """

    RESULT: Final = "result"
    """The structured content, else the text parts joined (``/run``), or ``null`` (``/approve``)."""
    CONTENT: Final = "content"
    """Every MCP content block, when the request asked for `RunFields.CONTENT`."""
    STRUCTURED: Final = "structured"
    """The structured content beside `CONTENT`."""
    ERROR: Final = "error"
    KIND: Final = "kind"
    MESSAGE: Final = "message"


SHELL_SERVER_NAME: Final = "ipybox"
"""The server name of an approval that is not an MCP tool call (a kernel's shell command)."""


class ShellFields:
    """The field names of a ``POST /shell`` body, and its two kinds.

    Built by the kernel (``kernel/_calls.py``); validated by the tool server
    (``app/tools/_server.py``), whose model has these fields.
    """

    KIND: ClassVar[str] = "kind"
    """`SHELL` or `SHELL_MAGIC`; also the tool name the application is asked to approve."""
    CMD: ClassVar[str] = "cmd"
    """The command line (`SHELL`), or the cell given to the program on stdin (`SHELL_MAGIC`)."""
    ARGV: ClassVar[str] = "argv"
    """The cell magic's program and its arguments (`SHELL_MAGIC` only)."""
    CWD: ClassVar[str] = "cwd"
    """The kernel's current folder, where the command runs."""

    ALL: ClassVar[frozenset[str]] = frozenset({KIND, CMD, ARGV, CWD})

    SHELL: ClassVar[str] = "shell"
    SHELL_MAGIC: ClassVar[str] = "shell_magic"
    KINDS: ClassVar[frozenset[str]] = frozenset({SHELL, SHELL_MAGIC})


def asks_about_shell(server_name: str, tool_name: str) -> bool:
    """Whether an ask-only approval (``POST /approve``, or an ask-only call on the stdin channel)
    names what it may only name: the kernel's own shell command. Any other name would have the
    application asked about a tool call that never runs."""
    return server_name == SHELL_SERVER_NAME and tool_name in ShellFields.KINDS


ASK_ONLY_RULE: Final = (
    f"an approval request asks about a shell command only: server_name {SHELL_SERVER_NAME!r}, "
    f"tool_name {ShellFields.SHELL!r} or {ShellFields.SHELL_MAGIC!r}, no content"
)
"""What `asks_about_shell` requires, in the words of the refusal."""


class ShellAnswerFields:
    """The field names of the tool server's answer to ``POST /shell``.

    Written by the tool server (``app/tools/_server.py``); read by the kernel extension
    (``kernel/_ext.py``).
    """

    STDOUT: ClassVar[str] = "stdout"
    STDERR: ClassVar[str] = "stderr"
    EXIT_CODE: ClassVar[str] = "exit_code"
    STOPPED: ClassVar[str] = "stopped"
    """Why the command was stopped before its end (a time or output limit), else ``None``."""

    ALL: ClassVar[frozenset[str]] = frozenset({STDOUT, STDERR, EXIT_CODE, STOPPED})


class StdinChannel:
    """Tool calls over the kernel's own stdin channel, for a kernel that can reach nothing but its gateway.

    The kernel (``kernel/_stdin.py``) asks with ``input(PROMPT_PREFIX + request)``: ipykernel sends an
    ``input_request`` to the client that runs the cell, and its ``input_reply`` carries the answer,
    mid-cell. The application (``app/tools/_stdin_channel.py``) parses the request strictly and runs each call
    through the tool server's ``/run`` path. ipykernel pairs a reply with whichever request waits, so
    one request is in flight per kernel: a request starts every call queued meanwhile and hands back
    the results that are ready (long-polling when none is).

    A request is ``{"calls": [{"id", "server_name", "tool_name", "tool_args", "content", "ask_only"}, ...],
    "ack": [ids], "seq": n}`` (exactly these fields): ``seq`` numbers the request (optional; the reply
    carries it back, so that the kernel tells the reply to its request from a late reply to an earlier
    one, which ipykernel would hand to whichever request waits), ``calls`` are new calls (``content`` as in ``/run``,
    optional; ``ask_only``, optional, makes the call one that only asks, as ``/approve`` does, about a
    shell command the kernel runs itself: only ``ipybox.shell`` and ``ipybox.shell_magic`` may), ``ack`` the ids whose results arrived (the application sends a result again until it is
    acknowledged; a result nobody waits for any more, of an interrupted call, is acknowledged and
    dropped). A call whose id is in flight already (sent again after a late reply) is not run again.
    The reply is ``{"seq": n, "idle": bool, "results": [{"id", "status", "answer"}, ...]}``, ``answer``
    being the JSON answer ``/run`` would give with that HTTP status, or ``{"seq": n, "error": message,
    "ids": [ids]}`` when the request was refused as a whole (none of its calls started).
    """

    VALUE: ClassVar[str] = "stdin"
    """The value of `ToolServerEnv.CHANNEL` that selects this channel."""
    CALLS: ClassVar[str] = "calls"
    ACK: ClassVar[str] = "ack"
    ID: ClassVar[str] = "id"
    RESULTS: ClassVar[str] = "results"
    STATUS: ClassVar[str] = "status"
    ANSWER: ClassVar[str] = "answer"
    IDLE: ClassVar[str] = "idle"
    ERROR: ClassVar[str] = "error"
    IDS: ClassVar[str] = "ids"
    ASK_ONLY: ClassVar[str] = "ask_only"
    SEQ: ClassVar[str] = "seq"


PROMPT_PREFIX: Final = "\x1b]ipybox-tool-call;"
"""What starts the prompt of a tool call request, rather than a plain ``input()`` prompt."""
MAX_MESSAGE_CHARS: Final = 8 * 1024 * 1024
"""The largest request (characters) or reply (bytes) either side sends (a gateway takes 10 MiB)."""
REQUEST_FIELDS: Final = frozenset({StdinChannel.CALLS, StdinChannel.ACK, StdinChannel.SEQ})
"""The fields of a request, and nothing else."""
CALL_FIELDS: Final = frozenset(
    {
        StdinChannel.ID,
        RunFields.SERVER_NAME,
        RunFields.TOOL_NAME,
        RunFields.TOOL_ARGS,
        RunFields.CONTENT,
        StdinChannel.ASK_ONLY,
    }
)
"""The fields of one call in a request, and nothing else (no ``server_params``: never from a kernel)."""
