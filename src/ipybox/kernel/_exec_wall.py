"""A wall that stops a process, and everything it forks, from starting a program or driving another.

Runs in the kernel (standard library only), as its launcher: ``python -P -m
ipybox.kernel._exec_wall ipykernel_launcher <args>`` installs the wall while the process has
one thread and nothing of the kernel (its configuration, IPython's startup files) has run yet,
then runs ``ipykernel_launcher``. Once installed:

- a seccomp filter makes ``execve`` and ``execveat`` fail with ``EPERM``, and so do ``ptrace``,
  ``process_vm_readv`` and ``process_vm_writev``; a system call of another architecture than
  the kernel's own (32-bit ``int 0x80`` on x86_64) kills the process, x32 ones fail;
- a Landlock domain refuses to execute any file and, as Landlock does for every domain, keeps the
  process from tracing or opening the memory (``/proc/<pid>/mem``) of any process outside it:
  the sandbox's own helpers (bwrap, srt's socat proxies) run without the filter.

Neither can be removed, and every thread and child inherits both: ``fork`` still works, a new
program does not. Used by a sandboxed kernel whose shell commands need approval: the approved
ones run outside the kernel, on the tool server, in a sandbox of their own
(``ipybox.app.sandbox._shell``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import NamedTuple

__all__ = ["install"]


class _Arch(NamedTuple):
    audit_arch: int  # <linux/audit.h>
    denied: tuple[int, ...]  # execve, execveat, ptrace, process_vm_readv, process_vm_writev (asm/unistd*.h)
    seccomp: int
    # x32 system calls have this bit set and share the x86_64 audit architecture: all refused.
    x32_bit: int | None


_ARCHES = {
    "x86_64": _Arch(0xC000003E, (59, 322, 101, 310, 311), 317, 0x40000000),
    "aarch64": _Arch(0xC00000B7, (221, 281, 117, 270, 271), 277, None),
}

_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000
# Classic BPF: load a word at an absolute offset, jump if equal / greater or equal, return.
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
# struct seccomp_data: int nr; __u32 arch; ...
_NR_OFFSET = 0
_ARCH_OFFSET = 4


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def program(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for `machine` (``platform.machine()``) as ``(code, jt, jf, k)`` instructions."""
    arch = _ARCHES[machine]
    deny = (_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM)
    head = [
        (_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        (_JEQ_K, 1, 0, arch.audit_arch),
        (_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    checks: list[tuple[int, int, int, int]] = []
    if arch.x32_bit is not None:
        checks.append((_JGE_K, 0, 0, arch.x32_bit))  # jt filled in below
    checks += [(_JEQ_K, 0, 0, number) for number in arch.denied]
    # Every check jumps to `deny`, which follows the final `allow`.
    body = [(code, len(checks) - index, 0, k) for index, (code, _, _, k) in enumerate(checks)]
    return [*head, *body, (_RET_K, 0, 0, _SECCOMP_RET_ALLOW), deny]


def _machine() -> str:
    """The architecture of this process's system calls (a 32-bit Python on x86_64 is not x86_64)."""
    machine = platform.machine()
    return machine if ctypes.sizeof(ctypes.c_void_p) == 8 else f"32-bit {machine}"


def unavailable() -> str | None:
    """Why the wall cannot be installed on this machine, or ``None`` if it can (checked without
    installing anything, so that a gateway refuses to start rather than start kernels that exit)."""
    machine = _machine()
    if os.uname().sysname != "Linux" or machine not in _ARCHES:
        return f"it needs Linux on x86_64 or aarch64, not {os.uname().sysname} on {machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION): the ABI version, or an error.
    if libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), 1) < 1:
        code = ctypes.get_errno()
        return f"Landlock is not available ({os.strerror(code)}): it needs Linux 5.13 or later with Landlock enabled"
    return None


def install() -> None:
    """Install the wall: the seccomp filter on every thread of this process, then the Landlock
    domain (on the calling thread: call it before any other thread starts).

    Raises:
        OSError: The platform or architecture has no such filter, or the system refused it; the
            caller must not run code it was meant to hold in.
    """
    machine = _machine()
    if os.uname().sysname != "Linux" or machine not in _ARCHES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {os.uname().sysname} on {machine}")
    instructions = program(machine)
    array = (_SockFilter * len(instructions))(*(_SockFilter(*ins) for ins in instructions))
    prog = _SockFprog(len(instructions), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(
        ctypes.c_long(_ARCHES[machine].seccomp),
        ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(prog),
    )
    if result != 0:
        # With TSYNC, a positive result is the id of a thread that could not be synchronised.
        code = ctypes.get_errno() if result < 0 else errno.EBUSY
        raise OSError(code, f"seccomp(SECCOMP_SET_MODE_FILTER, TSYNC) failed ({result})")
    _restrict_with_landlock(libc)


class _RulesetAttr(ctypes.Structure):
    # The first field is all that Landlock's first version reads (and all this needs).
    _fields_ = [("handled_access_fs", ctypes.c_uint64)]


# The same on every architecture (the generic system call table).
_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_ACCESS_FS_EXECUTE = 1


def _restrict_with_landlock(libc: ctypes.CDLL) -> None:
    """Enter a Landlock domain that handles executing files and allows it nowhere."""
    attr = _RulesetAttr(_LANDLOCK_ACCESS_FS_EXECUTE)
    ruleset = libc.syscall(
        ctypes.c_long(_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0
    )
    if ruleset < 0:
        code = ctypes.get_errno()
        raise OSError(
            code,
            f"Landlock is not available ({os.strerror(code)}); it needs Linux 5.13 or later with it enabled",
        )
    try:
        if libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


def main() -> None:
    """Install the wall, then run the module named by the first argument as ``__main__`` with the rest.

    A process whose wall cannot be installed exits (status 1) with the reason on stderr rather than
    run what it was meant to hold in.
    """
    import runpy
    import sys

    try:
        install()
    except OSError as exc:
        print(
            f"[ipybox] The kernel cannot install its wall against starting programs ({exc}), which a "
            "sandboxed kernel with approve_shell_cmds=True needs; it exits rather than run without it. "
            "Start with approve_shell_cmds=False, or on Linux 5.13+ (x86_64 or aarch64) with seccomp and Landlock.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
    module = sys.argv[1]
    del sys.argv[1]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
