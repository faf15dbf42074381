"""Run a Jupyter Kernel Gateway as a child process.

Application side only. `KernelGateway` owns what the gateway process is given (its port, command
line, environment, kernel spec and, sandboxed, srt's settings and the runner of approved shell
commands) and its private folder; the process itself, its output and its stop are a
`GatewayProcess` (``_gateway_process.py``), one for each start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ipybox._infra import listen
from ipybox._wire import GatewayEnv, KernelEnv
from ipybox.app import sandbox as _sandbox
from ipybox.app._settings import gateway_log_level
from ipybox.app._state import state_dir
from ipybox.app.kernels._gateway_process import GatewayProcess, gateway_command
from ipybox.app.kernels._spec import SandboxSetup, write_kernel_spec, write_sandbox_settings
from ipybox.app.sandbox import KernelConfinement, ShellRunner
from ipybox.errors import GatewayError, SandboxUnavailableError
from ipybox.gateway import _limits
from ipybox.kernel import _exec_wall

_LOG_TAIL_LINES = 40
_PORT_ATTEMPTS = 5
# What the gateway logs when its port was taken: at INFO level "The port N is already in use", and
# at any level, once it gives up (port_retries=0), "... no available port could be found".
_PORT_TAKEN_LINES = ("is already in use", "no available port could be found")


def free_port(host: str = "localhost") -> int:
    """Return a TCP port on `host` that is free right now."""
    with listen(host, 0) as sock:
        port: int = sock.getsockname()[1]
        return port


class KernelGateway:
    """A Jupyter Kernel Gateway running as a child process of the application.

    The gateway serves the REST and WebSocket API that `KernelClient` uses to create
    IPython kernels and run code in them. Kernels do not inherit the application's
    environment: they get exactly ``PATH`` plus the variables in `env`.

    Example:
        ```python
        async with KernelGateway(port=0) as gateway:
            async with KernelClient(port=gateway.port) as client:
                result = await client.execute("print(1 + 1)")
        ```

    Args:
        host: Host name or address the gateway binds to.
        port: Port the gateway listens on; ``None`` or ``0`` picks a free one (read it
            from `port` after `start()`).
        sandbox: Run each kernel inside Anthropic's sandbox-runtime (``srt``); the gateway itself
            stays outside and talks to the kernel over ZMQ ``ipc://`` sockets. A Unix socket named
            by ``TOOL_SERVER_SOCKET`` in `env` stays reachable from inside.
        sandbox_config: Path of an srt settings file that replaces the default settings (the
            trusted registry stays unwritable and the tool server reachable whatever it says).
        log_level: Log level of the gateway process.
        log_to_stderr: Forward the gateway's log lines to this process's stderr. Either
            way the last lines are kept and reported if the gateway fails.
        env: Environment variables for the kernels the gateway starts.
        auth_token: If set, the gateway answers only requests that carry this token
            (give the same token to `KernelClient`), so other local users cannot reach
            its kernels.
        working_dir: Where kernels start (and what the sandbox lets them write); default the
            current directory.
        memory_limit: Memory for each kernel together with every process it starts, in bytes
            or as ``"512M"``/``"2G"``; ``None``: no limit. See `CodeExecutor` for how it holds.
        max_processes: Processes and threads each kernel may have at once, itself and every
            process it starts included; ``None``: no limit.
        sandbox_hidden: Folders a sandboxed kernel can neither read nor write, whatever
            `sandbox_config` says, except `working_dir` when it lies inside one.
        registry_dir: The folder of the trusted registry, which a sandboxed kernel can never
            write (``None``: that of this user's registry).
        per_kernel_env: Variables each kernel's create request may set (a pool gives each kernel
            its own folders this way); all others come from `env` alone.
        tools_base: A pool's folder of per-kernel tool folders: a sandboxed kernel whose
            ``TOOL_SERVER_SOCKET`` names a socket in one of them may read that folder.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int | None = 8888,
        sandbox: bool = False,
        sandbox_config: Path | None = None,
        log_level: str = "INFO",
        log_to_stderr: bool = False,
        env: dict[str, str] | None = None,
        *,
        auth_token: str | None = None,
        working_dir: Path | None = None,
        memory_limit: int | str | None = None,
        max_processes: int | None = None,
        sandbox_hidden: tuple[Path, ...] = (),
        registry_dir: Path | None = None,
        per_kernel_env: tuple[str, ...] = (),
        tools_base: Path | None = None,
    ) -> None:
        self.per_kernel_env = per_kernel_env
        self.tools_base = tools_base
        if sandbox_config is not None and not sandbox:
            raise ValueError(
                f"sandbox_config={str(sandbox_config)!r} was given without sandbox=True; the kernel would run "
                "unsandboxed. Pass sandbox=True as well, or drop sandbox_config."
            )
        if max_processes is not None and max_processes < 16:
            raise ValueError(
                f"max_processes must be at least 16 (a kernel runs several threads), not {max_processes!r}."
            )
        self.memory_limit = _limits.parse_memory(memory_limit) if memory_limit is not None else None
        self.max_processes = max_processes
        self._limits = _limits.KernelLimits(None, None)
        self.host = host
        self.working_dir = Path(working_dir or Path.cwd()).resolve()
        self.sandbox_hidden = tuple(Path(folder).resolve() for folder in sandbox_hidden)
        self.registry_dir = registry_dir if registry_dir is not None else state_dir()
        self.auth_token = auth_token
        self.port = port or 0
        self.sandbox = sandbox
        self.sandbox_config = sandbox_config
        self.log_level = gateway_log_level(log_level)
        self.log_to_stderr = log_to_stderr
        self.env = dict(env or {})
        loaders = sorted(
            key for key in self.env if key.startswith(_LOADER_ENV_PREFIXES) or key in _LOADER_ENV_KEYS
        )
        if loaders:
            raise ValueError(
                f"Kernel variables {', '.join(loaders)} cannot be set: the gateway and srt (trusted "
                "processes outside the sandbox) would load code from them. Set them inside the kernel "
                "instead (os.environ in a cell)."
            )
        self._child: GatewayProcess | None = None
        self._log_tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL_LINES)
        self._jupyter_dir: Path | None = None
        self._srt = ""
        self._sandbox_config: dict[str, Any] | None = None
        # What a sandboxed kernel may write (its settings' allowWrite) and what stays read-only
        # there, as the last start wrote them; trusted programs never run from there
        # (see ipybox.app.mcp_client._params.confine).
        self._confined = KernelConfinement()

    @property
    def url(self) -> str:
        """Base HTTP URL of the gateway."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The gateway process's id from `start()` until `stop()`, else None.

        Its kernels (and what they start) are its descendants: a caller that watches or accounts
        for the processes of its sandbox starts from here.
        """
        child = self._child
        return None if child is None else child.process.pid

    @property
    def running(self) -> bool:
        """Whether the gateway process is alive (one that exited but is not reaped yet is not)."""
        child = self._child
        return child is not None and child.running

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self, timeout: float = 60) -> None:
        """Start the gateway and wait until it answers HTTP requests.

        Args:
            timeout: Seconds to wait for the gateway to answer.

        Raises:
            GatewayError: If the gateway is already running, exits during start (for
                example because the port is in use), or does not answer in time. The
                message includes the gateway's last lines of output.
            SandboxUnavailableError: If ``sandbox=True`` and srt or a program it needs is
                missing (the message says what to install), or `sandbox_config` is unusable, or
                the kernel's wall against starting programs (``IPYBOX_EXEC_WALL``) cannot be
                installed on this machine. The kernel never runs unsandboxed instead.
            ValueError: If `working_dir` is not an existing folder.
        """
        if self._child is not None:
            raise GatewayError("The kernel gateway is already running; call stop() before start().")
        if not self.working_dir.is_dir():
            # Unchecked, a kernel started in the gateway's private folder instead, and a sandboxed
            # one never started (its start waited for it without end).
            raise ValueError(
                f"working_dir {str(self.working_dir)!r} is not an existing folder; create it first "
                "(kernels start there)."
            )
        if self.sandbox:
            self._srt = _sandbox.find_srt()
            if self.env.get(KernelEnv.EXEC_WALL) == "1" and (problem := _exec_wall.unavailable()):
                raise SandboxUnavailableError(
                    f"A sandboxed kernel whose shell commands need approval cannot be walled in here: {problem}. "
                    "Start with approve_shell_cmds=False (shell approval is then a guard in the kernel, which "
                    "code can go around), or on a machine that has it."
                )
            self._sandbox_config = _sandbox.load_config(self.sandbox_config) if self.sandbox_config else None
        self._limits = _limits.KernelLimits(self.memory_limit, self.max_processes)
        try:
            self._limits.setup()
        except _limits.LimitsUnavailableError as exc:
            raise GatewayError(str(exc)) from None
        try:
            await self._start_on_a_port(timeout)
        except BaseException:
            self._limits.cleanup()
            raise

    def memory_exceeded(self) -> bool:
        """Whether a kernel was killed for going over `memory_limit` since the last call."""
        return self._limits.memory_exceeded()

    async def _start_on_a_port(self, timeout: float) -> None:
        if self.port != 0:
            await self._start(timeout)
            return
        # A port found free can be taken by another process before the gateway binds it
        # (two executors starting at once): then the gateway exits, and another port is tried.
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port(self.host)
            try:
                await self._start(timeout)
                return
            except GatewayError:
                taken = any(text in line for line in self._log_tail for text in _PORT_TAKEN_LINES)
                if not taken or attempt + 1 == _PORT_ATTEMPTS:
                    self.port = 0
                    raise

    async def _start(self, timeout: float) -> None:
        self._log_tail.clear()
        where = _sandbox.private_base() if self.sandbox else None
        if self.sandbox:
            _sandbox.sweep()
        self._jupyter_dir = Path(tempfile.mkdtemp(prefix="ipybox-jupyter-", dir=where))
        # The gateway, and srt which it starts, run in a folder of their own that kernels cannot
        # write; kernels change to the working directory themselves.
        start_dir = self._jupyter_dir / "start"
        try:
            start_dir.mkdir()
            if self.sandbox:
                _sandbox.make_placeholders(self.working_dir, self._jupyter_dir)
            sandboxing = (
                SandboxSetup(
                    self._srt,
                    self._sandbox_config,
                    self.working_dir,
                    self.sandbox_hidden,
                    self.registry_dir,
                    self.tools_base,
                )
                if self.sandbox
                else None
            )
            self._confined = write_kernel_spec(
                self._jupyter_dir, env=self.env, limits=self._limits, sandbox=sandboxing
            )
            child = await GatewayProcess.spawn(
                gateway_command(self.host, self.port, self.log_level, self.sandbox),
                self._gateway_env(),
                start_dir,
                self._log_tail,
                self.log_to_stderr,
            )
        except BaseException:
            if self.sandbox:
                _sandbox.remove_placeholders(self._jupyter_dir)
            shutil.rmtree(self._jupyter_dir, ignore_errors=True)
            self._jupyter_dir = None
            raise
        self._child = child
        jupyter_dir = self._jupyter_dir
        # A sandbox that cannot start is found while the gateway starts, not by a kernel that never answers.
        check = (
            asyncio.create_task(
                _sandbox.check(self._srt, jupyter_dir / "srt-settings.json", jupyter_dir / "tmp", start_dir)
            )
            if self.sandbox
            else None
        )
        try:
            await child.wait_ready(self.host, self.port, self.auth_token, timeout)
            if check is not None:
                await check
        except BaseException:
            if check is not None and not check.done():
                check.cancel()
                # Broad: the check's own end, even its cancellation, changes nothing: the start failed.
                with contextlib.suppress(BaseException):
                    await check
            await self._stop_process(10)
            raise

    async def stop(self, timeout: float = 10) -> None:
        """Stop the gateway and every kernel it started.

        Processes are asked to terminate, and killed if they are still alive after
        `timeout` seconds. Calling `stop()` on a stopped gateway does nothing.

        Args:
            timeout: Seconds to wait for a graceful exit before killing.
        """
        try:
            await self._stop_process(timeout)
        finally:
            # What the kernels started outside the gateway's process tree (a new session, a fork bomb).
            self._limits.cleanup()

    async def _stop_process(self, timeout: float) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            await asyncio.shield(child.terminate(timeout))
        finally:
            if self._jupyter_dir is not None:
                if self.sandbox:
                    # The kernels are gone: nothing binds the placeholders any more.
                    _sandbox.remove_placeholders(self._jupyter_dir)
                shutil.rmtree(self._jupyter_dir, ignore_errors=True)
                self._jupyter_dir = None
            await child.close()

    async def join(self) -> None:
        """Wait until the gateway process exits."""
        if self._child is not None:
            await self._child.process.wait()

    @property
    def confinement(self) -> KernelConfinement:
        """Where this gateway's sandboxed kernels write, what stays read-only there, and (for
        kernels walled in against starting programs) what runs their approved shell commands;
        empty while the gateway is stopped, or unsandboxed."""
        if not self.sandbox or self._jupyter_dir is None:
            return KernelConfinement()
        walled = self.env.get(KernelEnv.EXEC_WALL) == "1"
        return dataclasses.replace(self._confined, shell_runner=self._shell_runner() if walled else None)

    def folder_confinement(
        self, working_dir: Path, env: dict[str, str], settings_file: Path, private_dir: Path
    ) -> KernelConfinement:
        """For a pool's kernels working in `working_dir` (not the gateway's), with `env`: write their
        srt settings to `settings_file` (which the pool names to their launcher), put placeholders
        for the protected names there (journal in `private_dir`), and return their confinement.

        Raises:
            RuntimeError: If the gateway is not started, or not sandboxed.
        """
        if not self.sandbox or self._jupyter_dir is None:
            raise RuntimeError("Only a started, sandboxed gateway has kernel settings to write.")
        _sandbox.make_placeholders(working_dir, private_dir)
        setup = SandboxSetup(
            self._srt,
            self._sandbox_config,
            working_dir,
            self.sandbox_hidden,
            self.registry_dir,
            self.tools_base,
        )
        confined = write_sandbox_settings(settings_file, self._jupyter_dir, env, setup)
        if self.env.get(KernelEnv.EXEC_WALL) != "1":
            return confined
        runner = dataclasses.replace(self._shell_runner(), settings_file=settings_file)
        return dataclasses.replace(confined, shell_runner=runner)

    def _shell_runner(self) -> ShellRunner:
        """A new srt sandbox with the kernels' settings and temporary folder for each approved
        shell command, started as the gateway starts a kernel."""
        assert self._jupyter_dir is not None
        gateway_env = self._gateway_env()
        env = {key: value for key, value in gateway_env.items() if key in _GATEWAY_ENV_KEYS}
        env.update(
            {key: gateway_env[key] for key in gateway_env["KG_ENV_PROCESS_WHITELIST"].split(",") if key}
        )
        # The kernel's Python first, as in the kernel (kernel._ext); no folder the kernel can write.
        folders = [os.path.dirname(sys.executable), *env.get("PATH", os.defpath).split(os.pathsep)]
        path = [
            folder
            for folder in dict.fromkeys(folders)
            if os.path.isabs(folder)
            and not any(
                Path(folder).resolve().is_relative_to(writable) for writable in self._confined.writable
            )
        ]
        return ShellRunner(
            srt=self._srt,
            path=os.pathsep.join(path),
            settings_file=self._jupyter_dir / "srt-settings.json",
            tmp_dir=self._jupyter_dir / "tmp",
            start_dir=self._jupyter_dir / "start",
            env=env,
        )

    def _gateway_env(self) -> dict[str, str]:
        # Kernel code can read its parent's environment (/proc/<ppid>/environ) and can ask
        # the gateway for a kernel that inherits it, so the gateway gets only what it needs
        # to run, never the application's secrets.
        env = {key: value for key, value in os.environ.items() if key in _GATEWAY_ENV_KEYS}
        assert self._jupyter_dir is not None
        kernel_env = dict(self.env)
        # The gateway does not run in the working directory (see _start): the kernel changes to it.
        kernel_env[KernelEnv.START_DIR] = str(self.working_dir)
        if self.sandbox:
            # srt and the kernel keep their temporary files, srt's proxy sockets among them, in a
            # private folder that goes away with the gateway (each kernel in one of its own).
            kernel_env["TMPDIR"] = str(self._jupyter_dir / "tmp")
            kernel_env.setdefault("MPLCONFIGDIR", str(self._jupyter_dir / "tmp" / "matplotlib"))
            # Caches (fontconfig's among them) would go to the home folder, which is hidden.
            kernel_env.setdefault("XDG_CACHE_HOME", str(self._jupyter_dir / "tmp" / "cache"))
            # IPython's and Jupyter's folders are private too: startup files or kernel specs
            # written to the user's own would run unsandboxed in the user's other sessions.
            kernel_env["IPYTHONDIR"] = str(self._jupyter_dir / "tmp" / "ipython")
            kernel_env["JUPYTER_CONFIG_DIR"] = str(self._jupyter_dir / "tmp" / "jupyter-config")
            kernel_env["JUPYTER_DATA_DIR"] = str(self._jupyter_dir / "tmp" / "jupyter-data")
            # Each kernel gets these in a temporary folder of its own instead (_kernel_launch).
        env.update(kernel_env)
        # The gateway hands a kernel PATH plus the variables whitelisted here when the
        # create request carries an "env" object (KernelClient always sends one).
        env["KG_ENV_PROCESS_WHITELIST"] = ",".join(kernel_env)
        if self.per_kernel_env:
            env["KG_ENV_WHITELIST"] = ",".join(self.per_kernel_env)
        env["PYTHONUNBUFFERED"] = "1"
        env[GatewayEnv.EXIT_WITH_PARENT] = "1"
        env.update(self._limits.gateway_env())
        if self.sandbox:
            env[GatewayEnv.GATEWAY_LOCK] = str(self._jupyter_dir / "runtime" / "gateway.lock")
        env["JUPYTER_PATH"] = str(self._jupyter_dir)
        env["JUPYTER_RUNTIME_DIR"] = str(self._jupyter_dir / "runtime")
        if self.auth_token:
            env["KG_AUTH_TOKEN"] = self.auth_token  # in the environment: argv is world-readable
        return env


_GATEWAY_ENV_KEYS = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "SYSTEMROOT"}
)
# Variables that make the gateway or srt (outside the sandbox) load code.
_LOADER_ENV_PREFIXES = ("LD_", "DYLD_")
_LOADER_ENV_KEYS = frozenset({"NODE_OPTIONS", "NODE_PATH", "BASH_ENV"})
