"""Ends an unsandboxed kernel with the gateway that started it, however and whenever the gateway ends.

Runs in the kernel (standard library only), as its launcher: ``python -P -m
ipybox.kernel._with_gateway ipykernel_launcher <args>`` arranges the kernel's end, then runs
``ipykernel_launcher``. ipykernel's own parent poller starts only once the kernel is up, and a
parent already gone by then it takes for "no parent to watch": it then waits for the kernel to be
adopted by init (PID 1), which never happens where another process adopts orphans (a service
manager, a container's init, a test runner's subreaper). A gateway killed while its kernel started
(SIGKILL, the out-of-memory killer) so left the kernel running for good.

Here, before anything of the kernel runs, the kernel asks Linux for SIGKILL when its parent ends
(``PR_SET_PDEATHSIG``), then checks that its parent is still the gateway (``JPY_PARENT_PID``, which
jupyter_client sets) and exits at once if not; elsewhere a thread checks every second. Linux sends
the signal when the thread that started the process ends: the gateway starts kernels from its
event loop's thread, which lives as long as the gateway. A sandboxed kernel ends with its gateway
through its launcher's watcher instead (``ipybox.gateway._kernel_launch``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["end_with_parent"]

_PR_SET_PDEATHSIG = 1
_SIGKILL = 9


def end_with_parent(parent: int) -> None:
    """End this process when `parent` is no longer its parent: at once if it is not now."""
    if sys.platform == "linux":
        import ctypes

        if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, _SIGKILL) == 0:
            if os.getppid() != parent:  # it ended before the signal was asked for
                os._exit(1)
            return
    import threading
    import time

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=poll, name="ipybox-end-with-gateway", daemon=True).start()


def main() -> None:
    """Arrange the kernel's end with its parent, then run the module named by the first argument
    as ``__main__`` with the rest."""
    import runpy

    parent = int(os.environ.get("JPY_PARENT_PID") or 0)
    if parent:
        end_with_parent(parent)
    module = sys.argv[1]
    del sys.argv[1]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
