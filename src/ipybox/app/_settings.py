"""`ExecutorSettings`: everything a `CodeExecutor` is configured with, checked once and frozen.

The keyword arguments of `CodeExecutor` build one of these; the executor's parts (the tool
server, the kernels) are then made from it and never read the executor's state behind its back.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from ipybox._wire import KernelEnv
from ipybox.gateway import _limits

__all__ = ["DEFAULT_MAX_RESULT_SIZE", "DEFAULT_WARM_IMPORTS", "ExecutorSettings", "gateway_log_level"]

# The largest tool result the tool server hands back to a kernel, in bytes.
DEFAULT_MAX_RESULT_SIZE = 32 * 1024 * 1024

_MIN_PROCESSES = 16
DEFAULT_WARM_IMPORTS: tuple[str, ...] = ()
"""What a kernel imports in the background while idle unless told otherwise: nothing. Warming
``("matplotlib.pyplot",)`` makes a first plot after an idle moment about 0.4 s faster but costs every
kernel about 31 MB (the pool's memory per session goes from 36 to 67 MB, over its 45 MB target, and
an idle executor with its spare from 167 to 234 MB), so it is the application's choice. A sandboxed
kernel builds matplotlib's font cache anew at its first import (1.5-2 s of CPU), which every spare
would pay."""


@dataclass(frozen=True, kw_only=True)
class ExecutorSettings:
    """How a `CodeExecutor` runs its kernels and tool server; see `CodeExecutor` for each field.

    Values are checked when the settings are made, so a bad one is refused by the constructor
    with a message naming it, not later by `start()`: `working_dir` is made absolute (that it is
    an existing folder is checked by `start()`, which may come after the folder is made),
    `kernel_env` is copied into a read-only mapping.

    Raises:
        ValueError: If a value is out of range or of the wrong kind, or `sandbox_config` is
            given without `sandbox`.
    """

    tool_server_host: str = "localhost"
    tool_server_port: int | None = None
    kernel_gateway_host: str = "localhost"
    kernel_gateway_port: int | None = None
    kernel_env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    images_dir: Path | None = None
    approval_timeout: float = 60
    connect_timeout: float = 30
    sandbox: bool = False
    sandbox_config: Path | None = None
    log_level: str = "WARNING"
    approve_tool_calls: bool = True
    approve_shell_cmds: bool = False
    require_shell_escape: bool = False
    working_dir: Path | None = None
    memory_limit: int | str | None = None
    max_processes: int | None = None
    spare_kernel: bool = True
    max_result_size: int = DEFAULT_MAX_RESULT_SIZE
    sandbox_hidden: tuple[Path, ...] = ()
    tool_channel: Literal["http", "stdin"] | None = None
    kernel_gateway_url: str | None = None
    # Never in a repr: with it, anyone could open kernels on the gateway.
    kernel_gateway_token: str | None = field(default=None, repr=False)
    kernel_name: str | None = None
    kernel_start_timeout: float = 120
    warm_imports: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kernel_gateway_url is not None:
            self._check_remote()
        elif self.kernel_gateway_token is not None or self.kernel_name is not None:
            given = "kernel_gateway_token" if self.kernel_gateway_token is not None else "kernel_name"
            raise ValueError(
                f"{given} was given without kernel_gateway_url; it applies only to kernels on an existing "
                "gateway. Pass kernel_gateway_url as well, or drop it."
            )
        _check_positive("kernel_start_timeout", self.kernel_start_timeout, "seconds")
        self._choose_tool_channel()
        if self.sandbox_config is not None and not self.sandbox:
            raise ValueError(
                f"sandbox_config={str(self.sandbox_config)!r} was given without sandbox=True; the kernel "
                "would run unsandboxed. Pass sandbox=True as well, or drop sandbox_config."
            )
        _check_positive("approval_timeout", self.approval_timeout, "seconds")
        _check_positive("connect_timeout", self.connect_timeout, "seconds")
        if isinstance(self.max_result_size, bool) or not isinstance(self.max_result_size, int):
            raise ValueError(
                f"max_result_size must be a positive number of bytes, not {self.max_result_size!r}."
            )
        _check_positive("max_result_size", self.max_result_size, "bytes")
        for name in ("tool_server_port", "kernel_gateway_port"):
            _check_port(name, getattr(self, name))
        gateway_log_level(self.log_level)
        if self.memory_limit is not None:
            _limits.parse_memory(self.memory_limit)
        if self.max_processes is not None and (
            isinstance(self.max_processes, bool)
            or not isinstance(self.max_processes, int)
            or self.max_processes < _MIN_PROCESSES
        ):
            raise ValueError(
                f"max_processes must be at least {_MIN_PROCESSES} (a kernel runs several threads), "
                f"not {self.max_processes!r}."
            )
        # Frozen: the normalised values are set once, here.
        object.__setattr__(self, "kernel_env", MappingProxyType(_checked_env(self.kernel_env)))
        if self.working_dir is not None and not self.remote:
            object.__setattr__(self, "working_dir", Path(self.working_dir).resolve())
        object.__setattr__(self, "sandbox_hidden", tuple(Path(folder) for folder in self.sandbox_hidden))
        warm = self.warm_imports
        if warm is None:
            warm = DEFAULT_WARM_IMPORTS
        object.__setattr__(self, "warm_imports", _checked_modules(warm))

    def _choose_tool_channel(self) -> None:
        """A remote kernel reaches nothing but its gateway: its tool calls come over its stdin channel."""
        if self.tool_channel is None:
            # Frozen: set once here, as the dataclass's own __init__ would.
            object.__setattr__(self, "tool_channel", "stdin" if self.remote else "http")
        elif self.tool_channel not in ("http", "stdin"):
            raise ValueError(f"tool_channel must be 'http' or 'stdin', not {self.tool_channel!r}.")
        elif self.remote and self.tool_channel == "http":
            raise ValueError(
                "tool_channel='http' was given with kernel_gateway_url; a kernel on a remote gateway cannot "
                "reach this process's tool server, its calls come over the gateway's WebSocket. Drop "
                "tool_channel."
            )

    @property
    def remote(self) -> bool:
        """Whether kernels run on an existing gateway (`kernel_gateway_url`) rather than on one the
        executor starts: then tool calls and files travel over the kernel's own channels."""
        return self.kernel_gateway_url is not None

    def _check_remote(self) -> None:
        """Refuse what a kernel on an existing gateway cannot have, saying why."""
        url = self.kernel_gateway_url
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"kernel_gateway_url must be the http:// or https:// address of a Jupyter gateway, "
                f"e.g. 'http://gateway.example.com:8888', not {url!r}."
            )
        if self.kernel_gateway_token is not None and (
            not isinstance(self.kernel_gateway_token, str) or not self.kernel_gateway_token
        ):
            raise ValueError(
                "kernel_gateway_token must be a non-empty string, or None for a gateway without one."
            )
        if self.kernel_name is not None and (not isinstance(self.kernel_name, str) or not self.kernel_name):
            raise ValueError(
                f"kernel_name must be the name of a kernel spec of the gateway (GET /api/kernelspecs lists "
                f"them), or None for its default, not {self.kernel_name!r}."
            )
        if self.working_dir is not None and not Path(self.working_dir).is_absolute():
            raise ValueError(
                f"working_dir={str(self.working_dir)!r} is relative; with kernel_gateway_url it is a folder on "
                "the kernel's host: give its absolute path there."
            )
        cluster = "the gateway's cluster runs and isolates the kernels (use its own policies)"
        refused = {
            "sandbox": (self.sandbox, f"the kernel does not run on this machine; {cluster}"),
            "sandbox_config": (
                self.sandbox_config is not None,
                f"there is no local sandbox to configure; {cluster}",
            ),
            "sandbox_hidden": (bool(self.sandbox_hidden), f"there is no local sandbox; {cluster}"),
            "memory_limit": (
                self.memory_limit is not None,
                "the gateway starts the kernel; set limits where it runs (e.g. the kernel pod's resources)",
            ),
            "max_processes": (
                self.max_processes is not None,
                "the gateway starts the kernel; set limits where it runs (e.g. the kernel pod's pids limit)",
            ),
            "kernel_gateway_host": (
                self.kernel_gateway_host != "localhost",
                "no local gateway is started; kernel_gateway_url says where the gateway is",
            ),
            "kernel_gateway_port": (
                self.kernel_gateway_port is not None,
                "no local gateway is started; kernel_gateway_url says where the gateway is",
            ),
        }
        for name, (given, why) in refused.items():
            if given:
                raise ValueError(f"{name} cannot be used with kernel_gateway_url: {why}. Drop {name}.")

    @property
    def exec_wall(self) -> bool:
        """Whether the kernel cannot start programs, and its approved shell commands run on the
        tool server in a sandbox of their own (sandboxed on Linux, with shell commands approved;
        macOS has no such filter: there shell approval stays a guard in the kernel)."""
        return self.sandbox and self.approve_shell_cmds and sys.platform == "linux"

    def import_folders(self) -> tuple[Path, ...]:
        """The folders the application itself puts on the kernel's import path: the working
        directory (this process's when none is given) and the absolute entries of `kernel_env`'s
        ``PYTHONPATH`` (a relative one depends on where the kernel process starts, not on the
        working directory). The tool server runs the servers whose API was generated there;
        nothing the kernel does at run time changes them. A remote kernel's folders are on its
        host: only this process's working directory counts."""
        home = Path.cwd().resolve() if self.working_dir is None or self.remote else self.working_dir
        if self.remote:
            return (home,)
        entries = self.kernel_env.get("PYTHONPATH", "").split(os.pathsep)
        folders = [home, *(Path(entry).resolve() for entry in entries if os.path.isabs(entry))]
        return tuple(dict.fromkeys(folders))

    def kernel_settings(self) -> dict[str, str]:
        """The kernel's environment before the tool server's address: `kernel_env` and what the
        kernel extension (``ipybox.kernel._ext``) reads."""
        env = dict(self.kernel_env)
        if self.working_dir is not None:
            env[KernelEnv.WORKING_DIR] = str(self.working_dir)
        if self.approve_shell_cmds:
            env[KernelEnv.APPROVE_SHELL] = "1"
        if self.exec_wall:
            env[KernelEnv.EXEC_WALL] = "1"
        if self.require_shell_escape:
            env[KernelEnv.REQUIRE_SHELL_ESCAPE] = "1"
        if self.warm_imports:
            env[KernelEnv.WARM_IMPORTS] = ",".join(self.warm_imports)
        return env


def _check_positive(name: str, value: object, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of {unit}, not {value!r}.")


def _check_port(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"{name} must be a TCP port (0 to 65535) or None for a free one, not {value!r}.")


def _checked_modules(names: object) -> tuple[str, ...]:
    """`warm_imports` as a tuple, each a dotted module name (refused here, naming the bad one)."""
    if isinstance(names, str) or not isinstance(names, tuple | list):
        raise ValueError(
            f"warm_imports must be a tuple of module names such as ('matplotlib.pyplot',), not {names!r}."
        )
    for name in names:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(
                f"warm_imports has {name!r}, which is not a module name; give dotted names such as "
                "'matplotlib.pyplot', or () to import nothing ahead."
            )
    return tuple(names)


def _checked_env(kernel_env: Mapping[str, str] | None) -> dict[str, str]:
    """`kernel_env` as a dict, refused here with its offending entry rather than later by subprocess."""
    if kernel_env is None:
        return {}
    if not isinstance(kernel_env, Mapping):
        raise ValueError(f"kernel_env must be a dict of strings to strings, not {type(kernel_env).__name__}.")
    for name, value in kernel_env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise ValueError(
                f"kernel_env has the name {name!r}: names of environment variables are non-empty strings "
                "without '=' or NUL."
            )
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(
                f"kernel_env[{name!r}] is {value!r} ({type(value).__name__}); values of environment variables "
                f"are strings without NUL: pass str(value), e.g. {{{name!r}: {str(value)!r}}}."
            )
    return dict(kernel_env)


def gateway_log_level(level: str) -> str:
    """Translate a Python logging level name to the gateway's spelling of it.

    Raises:
        ValueError: `level` is not a logging level's name.
    """
    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL"):
        raise ValueError(f"Unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL.")
    return "WARN" if name == "WARNING" else name
