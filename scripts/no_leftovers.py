"""Run a command, then fail if anything it started is still running once it has ended.

Usage: python scripts/no_leftovers.py [--warn] [--grace SECONDS] COMMAND [ARGS...]
(``scripts/test.sh`` runs pytest so)

On Linux this process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process the
command started whose parent ended (a kernel's srt bridge, a daemon that forked away) is adopted
here rather than by init, so it is still found at the end, however far from its parent it ended
up. Elsewhere only the command's living descendants are found.

What still runs when the command ends gets a grace period to finish on its own (clean-ups of a
few seconds end then; 30 s unless --grace says otherwise); whatever is left after it is named on
stderr and killed, and the exit status is 1 (or the command's own, when that failed). With
``--warn`` they are named and killed but the exit status is the command's own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import psutil

_PR_SET_CHILD_SUBREAPER = 36
_GRACE = 30.0


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _living(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:
            continue  # it ended while we looked
    return alive


def _describe(process: psutil.Process) -> str:
    try:
        return f"pid {process.pid}: {' '.join(process.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {process.pid}: (ended)"


def _options(argv: list[str]) -> tuple[bool, float, list[str]]:
    """``--warn``, ``--grace SECONDS`` and the command."""
    warn = argv[:1] == ["--warn"]
    if warn:
        argv = argv[1:]
    grace = _GRACE
    if argv[:1] == ["--grace"] and len(argv) > 1:
        grace, argv = float(argv[1]), argv[2:]
    return warn, grace, argv


def main(argv: list[str]) -> int:
    warn, grace, argv = _options(argv)
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    adopting = _become_subreaper()
    child = subprocess.Popen(argv)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda received, _frame: child.send_signal(received))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the command itself
    while True:
        # Reaps what this process adopted as it ends, until the command itself has ended.
        pid, status = os.wait()
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            child.returncode = code
            break
    me = psutil.Process()
    _, alive = psutil.wait_procs(_living(me.children(recursive=True)), timeout=grace)
    left = _living([*alive, *me.children(recursive=True)])
    left = list({process.pid: process for process in left}.values())
    if left:
        where = "" if adopting else " (its orphans cannot be followed on this system)"
        print(
            f"\n{'WARNING' if warn else 'FAILED'}: {len(left)} process(es) started by `{' '.join(argv)}` still ran {grace:g} s after it "
            f"ended{where}; each test must end what it starts. Killed now:",
            file=sys.stderr,
        )
        for process in left:
            print(f"  {_describe(process)}", file=sys.stderr)
        for process in left:
            try:
                process.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=10)
    if code != 0 or warn:
        return code
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
