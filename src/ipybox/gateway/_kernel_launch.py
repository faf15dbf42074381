"""Start one sandboxed kernel: in folders of its own, and never outliving its gateway.

The kernel spec of a sandboxed gateway runs this file as a script, outside the sandbox and before
srt (``python -I -S _kernel_launch.py SPEC CONNECTION_FILE -- KERNEL_ARGV``; standard library
only, like `ipybox.gateway._limits`). SPEC is the JSON object ``KernelGateway`` wrote into
the kernel spec: srt, the gateway's settings, folders and lock. The script:

- Gives the kernel private folders. The gateway put the kernel's connection file (its key) and
  its ZMQ sockets in a folder made for this kernel alone (``ipybox.gateway._main``); a fresh ``tmp``
  inside it holds the kernel's ``TMPDIR``, IPython and Jupyter folders (every variable that named
  the gateway's shared temporary folder is pointed at it); srt's own sockets sit beside it. The kernel's srt
  settings are the gateway's, with this folder as the only private one: no kernel sees another's
  folders, not even those of its own executor's spare or previous kernels.
- Ends the kernel with the gateway. A watcher process, forked here and so outside the sandbox,
  waits for the lock the gateway holds for its whole life (``IPYBOX_GATEWAY_LOCK``) and, once it
  is released (the gateway ended, even by SIGKILL), ends srt: srt passes SIGTERM to the shell it
  started, whose end makes bwrap (``--die-with-parent``) end the sandbox's PID namespace, every
  process in it included; after a grace period, this process's whole group (srt, that shell,
  bwrap) is killed. Nothing in the sandbox can stop it: it sees none of these processes. The
  watcher ends with srt (``PR_SET_PDEATHSIG``), so a kernel shut down normally leaves nothing
  behind.
- Gives the kernel an IPC namespace of its own (Linux): srt's bwrap shares the host's, where the
  kernel could attach to the SysV shared memory, semaphores and message queues of any process of
  the same user and leave its own behind. Not being root, this takes a user namespace that maps
  the user's uid and gid to themselves; srt's bwrap nests its own in it. If the system allows
  neither, the kernel does not start.

It then becomes srt (through the limits launcher when there are limits), so the gateway's
signals reach srt directly.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import stat
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs milliseconds at every kernel start
    from typing import Any

# ipybox._wire's ToolServerEnv.SOCKET, PoolEnv.SETTINGS and KernelEnv.START_DIR; this script
# cannot import ipybox (a test checks they agree).
TOOL_SERVER_SOCKET = "TOOL_SERVER_SOCKET"
KERNEL_SETTINGS = "IPYBOX_KERNEL_SETTINGS"
START_DIR = "IPYBOX_START_DIR"
SETTINGS_SUFFIX = ".srt-settings.json"
"""The kernel's own srt settings are its folder's path with this suffix."""
_PR_SET_PDEATHSIG = 1
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_GRACE = 5.0
_OWN_IPC = "--own-ipc"
# matplotlib's font lists copied into a kernel's folder: how many, and the largest (bytes).
_FONT_LISTS = 4
_FONT_LIST_SIZE = 8 << 20


def wrap(srt: str, settings_file: str, argv: list[str], tmp_dir: str, working_dir: str) -> list[str]:
    """The command that runs `argv` inside srt under `settings_file`, in `working_dir`, with
    `tmp_dir` as ``TMPDIR``.

    srt itself starts in a private folder (the gateway's), never in the working directory: it
    reads its working directory to choose what to protect and runs ``rg`` there. The kernel
    changes to `working_dir` inside the sandbox. srt joins its arguments into one shell command
    without quoting them, so `argv` is quoted here and given as ``-c``; ``exec`` leaves no shell
    between srt and the kernel. srt points ``TMPDIR`` at a folder of its own, which need not
    exist: it is set again for the kernel.
    """
    command = f"cd {shlex.quote(working_dir)} && TMPDIR={shlex.quote(tmp_dir)} exec {shlex.join(argv)}"
    return [srt, "--settings", settings_file, "-c", command]


def _private_folders(spec: dict[str, Any], connection_file: str) -> tuple[str, str]:
    """Make the kernel's own temporary folder and srt settings; return (settings file, tmp)."""
    folder = os.path.dirname(connection_file)
    if os.path.dirname(folder) != spec["runtime"]:
        raise RuntimeError(f"the connection file {connection_file} is not in a folder of the kernel's own")
    tmp = os.path.join(folder, "tmp")
    if os.path.islink(tmp):  # a restarted kernel starts with an empty one
        os.unlink(tmp)
    elif os.path.lexists(tmp):
        import shutil

        shutil.rmtree(tmp)
    os.mkdir(tmp, 0o700)
    shared = spec["tmp"]
    for key, value in list(os.environ.items()):
        if value == shared or value.startswith(shared + os.sep):
            os.environ[key] = tmp + value[len(shared) :]
    _seed_font_list(spec.get("font_cache"), os.environ.get("MPLCONFIGDIR", ""), tmp)
    # srt's own sockets go in the folder itself: in `tmp` their paths would be too long.
    os.environ["TMPDIR"] = folder
    with open(_settings_file(spec)) as file:
        settings = json.load(file)
    filesystem = settings["filesystem"]
    own = folder + SETTINGS_SUFFIX  # beside the folder, out of the kernel's sight
    filesystem["allowWrite"] = [path for path in filesystem["allowWrite"] if path != shared] + [folder]
    filesystem["denyWrite"] = [*filesystem["denyWrite"], own]
    tools_base = spec.get("tools_base")
    socket = os.environ.get(TOOL_SERVER_SOCKET, "")
    if tools_base and socket:
        # A pooled kernel: its tool server's socket is linked into a folder of its own, made by the
        # pool before the kernel and readable (never writable) by this kernel alone.
        tools = os.path.dirname(socket)
        if os.path.dirname(tools) != tools_base or os.path.islink(tools):
            raise RuntimeError(f"the tool server socket {socket} is not in a folder of the pool's")
        filesystem.setdefault("allowRead", []).append(tools)
    partial = own + ".partial"
    with open(partial, "w") as file:
        json.dump(settings, file)
    os.replace(partial, own)
    return own, tmp


def _seed_font_list(source: str | None, config_dir: str, tmp: str) -> None:
    """Copy the user's matplotlib font lists from `source` into the kernel's own matplotlib folder.

    A sandboxed kernel's matplotlib folder is in its private `tmp` (``MPLCONFIGDIR``), new for every
    kernel: without a font list there, its first import of matplotlib scanned every font on the
    system (2 to 5 s of CPU, in the first plot or, warmed, in every kernel). The list matplotlib keeps
    for the user (read here, outside the sandbox, which hides the home folder) names fonts by path;
    matplotlib checks its version and scans anew if it does not match. Copies only: nothing the
    kernel writes goes back. A folder the application chose (its own ``MPLCONFIGDIR``) is left alone.
    """
    if not source or not config_dir.startswith(tmp + os.sep):
        return
    try:
        names = sorted(
            name for name in os.listdir(source) if name.startswith("fontlist-v") and name.endswith(".json")
        )
    except OSError:
        return
    for name in names[:_FONT_LISTS]:
        try:  # a speed-up only: whatever fails, the kernel starts and scans the fonts itself
            fd = os.open(os.path.join(source, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as file:
                data = file.read(_FONT_LIST_SIZE + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            if not data or len(data) > _FONT_LIST_SIZE:
                continue
            os.makedirs(config_dir, 0o700, exist_ok=True)
            with open(os.path.join(config_dir, name), "xb") as copy:
                copy.write(data)
        except OSError:
            continue


def _settings_file(spec: dict[str, Any]) -> str:
    """The gateway's srt settings, or (a pool's kernel in a working directory of its own) those the
    pool wrote for that directory, in the pool's folder."""
    own = os.environ.get(KERNEL_SETTINGS, "")
    if not own:
        return str(spec["settings"])
    if not spec.get("tools_base") or os.path.dirname(own) != spec["tools_base"] or os.path.islink(own):
        raise RuntimeError(f"the settings {own} are not in a folder of the pool's")
    return own


def _working_dir(spec: dict[str, Any]) -> str:
    """The kernel's working directory: its own (a pool's kernel with settings of its own), else the gateway's."""
    if os.environ.get(KERNEL_SETTINGS) and os.environ.get(START_DIR):
        return os.environ[START_DIR]
    return str(spec["working_dir"])


def _end_with_gateway(lock_file: str) -> None:
    """Fork the watcher that kills this process's group once the gateway's lock is released."""
    fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW)
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    launcher = os.getpid()
    if os.fork() != 0:
        os.close(fd)
        return
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):  # holds none of the gateway's pipes open
            os.dup2(null, std)
        _end_with_parent(launcher)
        if os.getppid() == launcher:  # else srt already ended, and its group with it
            fcntl.flock(fd, fcntl.LOCK_SH)  # granted once the gateway's exclusive lock is gone
            # srt passes SIGTERM on (bwrap then ends the sandbox) and removes its stand-ins; its
            # end ends this watcher. What still runs after the grace period is killed.
            os.kill(launcher, signal.SIGTERM)
            import time

            time.sleep(_GRACE)
            os.killpg(launcher, signal.SIGKILL)
    finally:
        os._exit(0)


def _end_with_parent(parent: int) -> None:
    """End this process when its parent (srt) ends: at once on Linux, else within a second."""
    if sys.platform == "linux":
        import ctypes

        if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            return
    import threading
    import time

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=poll, daemon=True).start()


def _own_ipc_namespace() -> None:
    """Move this process (and so srt and the kernel) into a new IPC namespace (Linux only)."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWIPC) == 0:  # root, or CAP_SYS_ADMIN
        return
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWIPC) != 0:
        error = ctypes.get_errno()
        raise RuntimeError(
            f"the kernel needs an IPC namespace of its own, and this system refused a user namespace "
            f"to make one ({os.strerror(error)}): allow unprivileged user namespaces (on Ubuntu: "
            "sysctl kernel.apparmor_restrict_unprivileged_userns=0), or run as root"
        )
    for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(line)


def in_own_ipc_namespace(command: list[str]) -> list[str]:
    """`command`, run through this script in an IPC namespace of its own on Linux.

    For the other programs ipybox runs in srt on behalf of a kernel (approved shell commands,
    package installs). If the namespace cannot be made, the script writes why and exits with 1.
    """
    if sys.platform != "linux":
        return command
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), _OWN_IPC, *command]


def _launch(spec: dict[str, Any], connection_file: str, argv: list[str]) -> None:
    settings_file, tmp = _private_folders(spec, connection_file)
    _end_with_gateway(spec["lock"])
    _own_ipc_namespace()
    command = [*spec["prefix"], *wrap(spec["srt"], settings_file, argv, tmp, _working_dir(spec))]
    os.execvp(command[0], command)


if __name__ == "__main__" and sys.argv[1] == _OWN_IPC:
    try:
        _own_ipc_namespace()
    except Exception as exc:  # broad: a process entry point; never start the kernel unprepared
        print(f"ipybox could not prepare the sandbox: {exc}", file=sys.stderr)
        sys.exit(1)
    os.execvp(sys.argv[2], sys.argv[2:])
elif __name__ == "__main__":
    try:
        _launch(json.loads(sys.argv[1]), sys.argv[2], sys.argv[4:])
    except Exception as exc:  # broad: a process entry point
        # Never start a kernel that would share folders or outlive its gateway.
        print(f"ipybox could not prepare the sandboxed kernel: {exc!r}", file=sys.stderr)
        sys.exit(1)
