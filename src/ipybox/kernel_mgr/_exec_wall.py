"""A seccomp filter that stops a process, and everything it forks, from starting a program.

Runs in the kernel (standard library only). Once installed, ``execve`` and ``execveat`` fail with
``EPERM``, and so do ``ptrace``, ``process_vm_readv`` and ``process_vm_writev`` (the kernel cannot
drive another process to start one for it). A filter cannot be removed, holds for every thread of
the process (``SECCOMP_FILTER_FLAG_TSYNC``) and is inherited by every child: ``fork`` still works,
a new program does not. A system call of another architecture than the kernel's own (32-bit
``int 0x80`` on x86_64) kills the process.

Used by a sandboxed kernel whose shell commands need approval: the approved ones run outside the
kernel, on the tool server, in a sandbox of their own (``ipybox.tool_exec._shell``).
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


def install() -> None:
    """Install the filter on every thread of this process.

    Raises:
        OSError: The platform or architecture has no such filter, or the system refused it; the
            caller must not run code it was meant to hold in.
    """
    machine = platform.machine()
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
