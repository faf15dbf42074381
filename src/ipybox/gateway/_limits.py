"""Memory and process limits for a kernel and everything it starts.

Two halves in one file. In the application, `KernelLimits` decides how to enforce the limits
and makes the kernel spec start every kernel through this file run as a script (standard
library only, ``python -I -S``: it adds a few ms per kernel start), which applies them to itself and then
executes the kernel's command (srt's, when sandboxed), so they hold for all its descendants.
The file lives in ``ipybox.gateway`` with that script half, which the gateway's kernel spec runs
outside the sandbox; the application imports the deciding half (``ipybox.app.kernels._gateway``).

How, measured on Linux:

- A control group per kernel where one can be created (cgroup v2 with the memory and pids
  controllers delegated to ipybox's group, else writable v1 ``memory`` and ``pids``
  hierarchies): ``memory.max`` / ``memory.limit_in_bytes`` count the whole tree, the kernel's
  OOM killer ends it when it goes over (`KernelLimits.memory_exceeded` tells), and ``pids.max`` makes
  ``fork`` fail once the tree holds that many tasks (threads count too). Everything left in a
  kernel's group is killed when the next kernel starts and when the gateway stops.
- Else rlimits, which hold per process, not for the tree: ``RLIMIT_DATA`` for memory (an
  allocation over it raises ``MemoryError``; ``RLIMIT_AS`` is not used because it also counts
  address space that libraries such as numpy's BLAS reserve without using), and
  ``RLIMIT_NPROC`` for processes, which counts all processes of the user and which Linux does
  not enforce for root: as root without a control group, `max_processes` cannot be enforced
  and the gateway refuses to start rather than run without it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512M"`` or ``"2g"`` (binary units).

    Raises:
        ValueError: The value is not a positive size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(value).lower())
        if match is None:
            raise ValueError(f"memory_limit must be bytes or a size such as '512M' or '2G', not {value!r}.")
        size = int(float(match[1]) * _UNITS[match[2]])
    if size < 32 * 2**20:
        raise ValueError(f"memory_limit must be at least 32M (a kernel needs more to start), not {value!r}.")
    return size


class LimitsUnavailableError(Exception):
    """The limits asked for cannot be enforced here (the message says why and what to do)."""


class KernelLimits:
    """How the limits of one gateway's kernels are enforced; see the module docstring.

    Args:
        memory: Bytes of memory for each kernel and its descendants, or ``None``.
        processes: Tasks (processes and threads) for each kernel and its descendants, or ``None``.
    """

    def __init__(self, memory: int | None, processes: int | None) -> None:
        self.memory = memory
        self.processes = processes
        self.groups: dict[str, dict[str, str]] = {}  # group folder -> files to write in each kernel's group
        self.rlimits: dict[str, int] = {}
        self._memory_groups: list[Path] = []
        self.how = "none"

    def setup(self) -> None:
        """Create ipybox's control groups, or choose rlimits.

        Raises:
            LimitsUnavailableError: A limit cannot be enforced on this machine.
        """
        if self.memory is None and self.processes is None:
            return
        if sys.platform != "linux":
            self._setup_rlimits()
            return
        name = f"ipybox-{os.getpid()}-{secrets.token_hex(4)}"
        for setup in (self._setup_v2, self._setup_v1):
            try:
                if setup(name):
                    break
            except (OSError, ValueError):
                self.cleanup()
        if not self.groups:
            self._setup_rlimits()

    def gateway_env(self) -> dict[str, str]:
        """What the gateway process needs to `reap` kernels' groups (it never reaches kernels)."""
        return {"IPYBOX_KERNEL_GROUPS": json.dumps(list(self.groups))} if self.groups else {}

    def launcher(self, argv: list[str]) -> list[str]:
        """The kernel command `argv`, started with the limits applied."""
        if not self.groups and not self.rlimits:
            return argv
        spec = json.dumps({"groups": self.groups, "rlimits": self.rlimits})
        return [sys.executable, "-I", "-S", str(Path(__file__).resolve()), spec, "--", *argv]

    def memory_exceeded(self) -> bool:
        """Whether a kernel that is gone was killed for its memory (each such kernel is told once).

        The group of such a kernel is kept by the launcher of the next one (which removes the
        others), so that its count is still here to read; it is removed now.
        """
        exceeded = False
        for group in self._memory_groups:
            for child in group.glob("kernel-*"):
                if not _alive(int(child.name.removeprefix("kernel-"))) and _oom_kills(child) > 0:
                    exceeded = True
                    _empty_and_remove(child)
        return exceeded

    def cleanup(self) -> None:
        """Kill every process left in the kernels' groups and remove the groups."""
        for group in self.groups:
            root = Path(group)
            for child in root.glob("kernel-*"):
                _empty_and_remove(child)
            _empty_and_remove(root)
        self.groups.clear()
        self._memory_groups.clear()

    def _setup_v2(self, name: str) -> bool:
        mount = _mount_point("cgroup2", None)
        own = _own_group("")
        if mount is None or own is None:
            return False
        parent = mount / own.lstrip("/")
        needed = {c for c, v in (("memory", self.memory), ("pids", self.processes)) if v is not None}
        if not needed <= set((parent / "cgroup.controllers").read_text().split()):
            return False
        if not needed <= set((parent / "cgroup.subtree_control").read_text().split()):
            # Only possible where the parent holds no process itself (the "no internal processes" rule).
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in needed))
        _remove_stale(parent)
        group = parent / name
        group.mkdir(mode=0o755)
        self.groups[str(group)] = {}
        (group / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in needed))
        files = self.groups[str(group)]
        if self.memory is not None:
            files["memory.max"] = str(self.memory)
            files["memory.swap.max"] = "0"
            self._memory_groups.append(group)
        if self.processes is not None:
            files["pids.max"] = str(self.processes)
        self.how = "cgroup v2"
        return True

    def _setup_v1(self, name: str) -> bool:
        wanted = [(c, v) for c, v in (("memory", self.memory), ("pids", self.processes)) if v is not None]
        folders: list[tuple[str, int, Path]] = []
        for controller, value in wanted:
            mount = _mount_point("cgroup", controller)
            own = _own_group(controller)
            if mount is None or own is None or not os.access(mount / own.lstrip("/"), os.W_OK):
                return False
            folders.append((controller, value, mount / own.lstrip("/") / name))
        for controller, value, group in folders:
            _remove_stale(group.parent)
            group.mkdir(mode=0o755)
            files = self.groups[str(group)] = {}
            if controller == "memory":
                files["memory.limit_in_bytes"] = str(value)
                if (group / "memory.memsw.limit_in_bytes").exists():
                    files["memory.memsw.limit_in_bytes"] = str(value)
                self._memory_groups.append(group)
            else:
                files["pids.max"] = str(value)
        self.how = "cgroup v1"
        return True

    def _setup_rlimits(self) -> None:
        if self.processes is not None and os.geteuid() == 0:
            raise LimitsUnavailableError(
                "max_processes cannot be enforced here: no writable control group (cgroup) for the "
                "pids controller was found, and Linux does not enforce RLIMIT_NPROC for root. Run as "
                "another user, give ipybox a writable cgroup, or pass max_processes=None."
            )
        if self.memory is not None:
            self.rlimits["RLIMIT_DATA"] = self.memory
        if self.processes is not None:
            self.rlimits["RLIMIT_NPROC"] = self.processes
        self.how = "rlimits"


def _remove_stale(parent: Path) -> None:
    """Remove the groups of ipybox applications that ended without cleaning up (killed, say),
    with whatever their kernels left running."""
    for group in parent.glob("ipybox-*-*"):
        pid = group.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            for child in group.glob("kernel-*"):
                _empty_and_remove(child, timeout=0.5)
            _empty_and_remove(group, timeout=0.5)


def _mount_point(fstype: str, controller: str | None) -> Path | None:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        separator = fields.index("-")
        if fields[separator + 1] != fstype:
            continue
        if controller is None or controller in fields[separator + 3].split(","):
            return Path(fields[4])
    return None


def _own_group(controller: str) -> str | None:
    """This process's group path in the hierarchy of `controller` (``""``: the v2 one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller == "" and controllers == "") or controller in controllers.split(","):
            return path
    return None


def _empty_and_remove(group: Path, timeout: float = 2, remove: bool = True) -> None:
    """Kill every process in a control group, then remove it (it can go once they have exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not remove:
            return
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def reap(groups: list[str], pid: int | None) -> None:
    """In the gateway, once the kernel started as `pid` has ended: kill what it left in its
    groups (a fork bomb in a session of its own, say) and remove them, except a group whose
    kernel the OOM killer ended, kept until `KernelLimits.memory_exceeded` has read it."""
    if pid is None:
        return
    for folder in groups:
        group = Path(folder) / f"kernel-{pid}"
        if group.exists():
            _empty_and_remove(group, timeout=0.5, remove=_oom_kills(group) == 0)


def _oom_kills(group: Path) -> int:
    """Processes the OOM killer ended in a kernel's group (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (group / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            field, _, value = line.partition(" ")
            if field == "oom_kill":
                return int(value)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _launch(spec: dict[str, Any], argv: list[str]) -> None:
    """Apply the limits to this process, then become the kernel's command."""
    import resource

    pid = os.getpid()
    for folder, files in spec["groups"].items():
        parent = Path(folder)
        # The groups of kernels that are gone (after a crash or a reset), with whatever they
        # left running, such as a fork bomb's processes.
        # A group whose kernel the OOM killer ended stays (emptied) until the application has
        # read its count (`KernelLimits.memory_exceeded`).
        for old in parent.glob("kernel-*"):
            if not _alive(int(old.name.removeprefix("kernel-"))):
                _empty_and_remove(old, timeout=0.5, remove=_oom_kills(old) == 0)
        group = parent / f"kernel-{pid}"
        group.mkdir(exist_ok=True)
        for name, value in files.items():
            (group / name).write_text(str(value))
        (group / "cgroup.procs").write_text(str(pid))
    for name, value in spec["rlimits"].items():
        limit = int(str(value))
        resource.setrlimit(getattr(resource, name), (limit, limit))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    try:
        _launch(json.loads(sys.argv[1]), sys.argv[3:])
    except Exception as exc:  # broad: a process entry point
        # Never start the kernel without the limits it was given.
        print(f"ipybox could not apply the kernel's resource limits: {exc!r}", file=sys.stderr)
        sys.exit(1)
