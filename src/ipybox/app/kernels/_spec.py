"""What a gateway's kernels run as: the kernel spec the gateway starts them from, and for sandboxed
kernels the srt settings file and the launcher command that puts each kernel inside srt.

Written once per gateway start, into the gateway's private Jupyter folder, which kernels cannot
write (`KernelGateway` makes it; the settings protect it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipybox._wire import KernelEnv, ToolServerEnv
from ipybox.app import sandbox as _sandbox
from ipybox.app.sandbox import KernelConfinement
from ipybox.gateway import _kernel_launch, _limits

__all__ = ["KERNEL_ARGS", "KERNEL_NAME", "SandboxSetup", "write_kernel_spec"]

KERNEL_NAME = "ipybox-python"
KERNEL_ARGS = [
    "--HistoryManager.enabled=False",
    # ipykernel sleeps 0.5 ms before every execute reply so that output tends to arrive
    # first on notebook frontends. KernelClient waits for the iopub idle status, which
    # always follows the output, so the sleep only adds latency.
    "--IPythonKernel._execute_sleep=0",
    # Agents pay tokens for every escape sequence: no colours in tracebacks.
    "--InteractiveShell.colors=nocolor",
    # Shell approval, the shell-escape guard and the kept working directory (see the module).
    "--IPKernelApp.extensions=ipybox.kernel._ext",
    # ipykernel's kernel without its debugger (which ipybox kernels never serve): 8 MB less each.
    "--IPKernelApp.kernel_class=ipybox.kernel._kernel.Kernel",
    # IPython would put the working directory on sys.path before loading the extension, so an
    # `ipybox/` planted there would run in every later kernel of the same working directory, other
    # sessions' included. The extension adds it once ipybox is loaded (kernel._ext).
    "--InteractiveShellApp.ignore_cwd=True",
]


@dataclass(frozen=True)
class SandboxSetup:
    """How a gateway's kernels are sandboxed.

    Attributes:
        srt: The ``srt`` command.
        config: A custom settings object (`_sandbox.load_config`), or ``None`` for the defaults.
        working_dir: The kernels' working directory.
        hidden: Folders the kernels can neither read nor write (but `working_dir`).
        registry_dir: The folder of the trusted registry, which the kernels can never write.
    """

    srt: str
    config: dict[str, Any] | None
    working_dir: Path
    hidden: tuple[Path, ...]
    registry_dir: Path
    # A pool's folder of per-kernel tool folders (each kernel's named by its own environment).
    tools_base: Path | None = None


def write_kernel_spec(
    jupyter_dir: Path,
    *,
    env: Mapping[str, str],
    limits: _limits.KernelLimits,
    sandbox: SandboxSetup | None,
) -> KernelConfinement:
    """Write the kernel spec of ipybox kernels (and the sandbox's settings) to `jupyter_dir`.

    Kernels run this interpreter's ipykernel with `KERNEL_ARGS`, inside srt when sandboxed.
    IPython's history database is turned off: agents do not read it, and writing it costs
    a few ms on every execution.

    Args:
        jupyter_dir: The gateway's private Jupyter folder.
        env: The kernels' environment (it names the tool server's socket, the exec wall, the
            ``PYTHONPATH`` a sandbox keeps readable).
        limits: The kernels' limits, applied by the launcher.
        sandbox: How kernels are sandboxed; ``None``: they are not.

    Returns:
        Where a sandboxed kernel writes and what stays read-only there (empty unsandboxed).
    """
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    # -P: nothing the kernel imports while it starts comes from the folder it starts in (the
    # working directory, which kernel code writes): a planted ``ipykernel_launcher.py`` there would
    # otherwise run in every later kernel, a pool's ready kernels (other executors') included.
    argv = [sys.executable, "-P", "-m", "ipykernel_launcher", "-f", "{connection_file}", *KERNEL_ARGS]
    if sandbox is not None and env.get(KernelEnv.EXEC_WALL) == "1":
        # The wall goes up before anything of the kernel runs (see _exec_wall).
        argv[1:4] = ["-P", "-m", "ipybox.kernel._exec_wall", "ipykernel_launcher"]
    spec: dict[str, object] = {
        "display_name": "Python 3 (ipybox)",
        "language": "python",
        # Kernel channels are ZMQ sockets on localhost: encrypt them (CurveZMQ) so that
        # other local users cannot read or inject kernel messages.
        "metadata": {"debugger": False, "supported_encryption": ["curve"]},
    }
    confinement = KernelConfinement()
    if sandbox is None:
        # The kernel ends with its gateway even if the gateway ends before ipykernel watches it.
        argv[1:4] = ["-P", "-m", "ipybox.kernel._with_gateway", "ipykernel_launcher"]
        spec["argv"] = limits.launcher(argv)
    else:
        # In its own PID namespace the kernel's parent is PID 1, which ipykernel's parent
        # poller takes for "the parent exited"; its launcher ends it with the gateway instead.
        # A sandboxed kernel's launcher applies the limits itself, after forking its watcher.
        spec["argv"], confinement = _sandboxed(
            jupyter_dir, [*argv, "--IPKernelApp.parent_handle=0"], env, limits, sandbox
        )
        # bwrap forwards no signals to the kernel: interrupt it with a control message.
        spec["interrupt_mode"] = "message"
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return confinement


def _sandboxed(
    jupyter_dir: Path,
    argv: list[str],
    env: Mapping[str, str],
    limits: _limits.KernelLimits,
    sandbox: SandboxSetup,
) -> tuple[list[str], KernelConfinement]:
    """The launcher command that runs `argv` inside srt, after writing srt's settings file."""
    runtime, tmp = jupyter_dir / "runtime", jupyter_dir / "tmp"
    for path in (runtime, tmp):
        path.mkdir()
    working_dir = sandbox.working_dir
    settings_file = jupyter_dir / "srt-settings.json"
    confinement = write_sandbox_settings(settings_file, jupyter_dir, env, sandbox)
    launch = {
        "srt": sandbox.srt,
        "settings": str(settings_file),
        "runtime": str(runtime),
        "tmp": str(tmp),
        "lock": str(runtime / "gateway.lock"),
        "working_dir": str(working_dir),
        "prefix": limits.launcher([]),
        "font_cache": _matplotlib_cache(),
    }
    if sandbox.tools_base is not None:
        launch["tools_base"] = str(sandbox.tools_base)
    launcher = Path(_kernel_launch.__file__).resolve()
    command = [
        sys.executable,
        "-I",
        "-S",
        str(launcher),
        json.dumps(launch),
        "{connection_file}",
        "--",
        *argv,
    ]
    return command, confinement


def _matplotlib_cache() -> str:
    """Where matplotlib keeps its font list for this user, as matplotlib finds it (without importing
    it); empty if there is no home folder to look in."""
    configured = os.environ.get("MPLCONFIGDIR")
    if configured:
        return configured
    try:
        home = Path.home()
    except RuntimeError:
        return ""
    if sys.platform.startswith(("linux", "freebsd")):
        return str(Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "matplotlib")
    return str(home / ".matplotlib")


def write_sandbox_settings(
    settings_file: Path, jupyter_dir: Path, env: Mapping[str, str], sandbox: SandboxSetup
) -> KernelConfinement:
    """Write the srt settings of kernels working in ``sandbox.working_dir`` to `settings_file`.

    Returns:
        Where those kernels write and what stays read-only there.
    """
    working_dir = sandbox.working_dir
    settings = _sandbox.sandbox_settings(
        sandbox.config,
        working_dir=working_dir,
        # The settings written here are those of the shell sandbox (`KernelGateway.confinement`) and
        # of the start check, whose private folder is `tmp`; each kernel runs under a copy whose
        # private folder is its own, in `runtime` (_kernel_launch).
        private_dirs=[jupyter_dir / "tmp"],
        protected=_protected(jupyter_dir, settings_file, sandbox),
        tool_socket=Path(socket) if (socket := env.get(ToolServerEnv.SOCKET)) else None,
        readable=(
            *(Path(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(entry)),
            *_sandbox.srt_support(sandbox.srt),
        ),
        hidden=sandbox.hidden,
    )
    partial = settings_file.with_name(settings_file.name + ".partial")
    partial.write_text(json.dumps(settings, indent=2))
    partial.replace(settings_file)
    filesystem = settings["filesystem"]
    return KernelConfinement(
        writable=(
            *(working_dir / Path(path).expanduser() for path in filesystem["allowWrite"]),
            jupyter_dir / "runtime",
        ),
        readonly=tuple(working_dir / Path(path).expanduser() for path in filesystem["denyWrite"]),
    )


def _protected(jupyter_dir: Path, settings_file: Path, sandbox: SandboxSetup) -> list[Path]:
    """What no sandboxed kernel may write, whatever the settings say: the trusted registry, the
    trusted installation, the kernel spec, the settings, and the protected names in subfolders."""
    registry_dir = sandbox.registry_dir
    # A folder that does not exist cannot be protected: srt skips it, and the kernel could create it.
    registry_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    working_dir = sandbox.working_dir
    return [
        registry_dir,
        *(
            path
            for path in _trusted_installation(sandbox.srt)
            if path != working_dir and path not in working_dir.parents
        ),
        jupyter_dir / "kernels",
        settings_file,
        # srt looks for the protected names from its own working directory, which is not the
        # kernel's: those in subfolders are found here (the working directory's own are fixed).
        *_sandbox.nested_protected(working_dir),
    ]


def _trusted_installation(srt: str) -> list[Path]:
    """What the application, the gateway and srt run from: the Python environment, ipybox's own
    package (a checkout's ``src/`` when installed editable) and srt's ``node_modules``. A working
    directory that holds them (a clone with its ``.venv``) must not let the kernel change them:
    the next start would run the change outside the sandbox."""
    # ipybox's own folder, found from a module that lies directly in it (``gateway/``), so that it
    # stays right wherever this module moves.
    package = Path(_kernel_launch.__file__).resolve().parents[1]
    paths = [Path(sys.prefix), package]
    real_srt = Path(srt).resolve()
    modules = [parent for parent in real_srt.parents if parent.name == "node_modules"]
    paths.append(modules[-1] if modules else real_srt)
    return paths
