"""A sandboxed kernel against the SysV IPC objects of the host: each kernel has an IPC namespace of
its own, so it reaches none of the application's and leaves none of its own behind."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipybox import CodeExecutor
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.slow

_IPC_CREAT = 0o1000
_IPC_RMID = 0

# Kernel code: attach to the application's segment by its key and to every segment in sight by
# its id, overwriting what it reads; then create a segment and a message queue of its own.
ATTACK = """
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
read = {}
ids = [libc.shmget(KEY, 0, 0)]
ids += [int(line.split()[1]) for line in open("/proc/sysvipc/shm").readlines()[1:]]
for shmid in ids:
    address = libc.shmat(shmid, None, 0)
    if shmid >= 0 and address not in (None, ctypes.c_void_p(-1).value):
        read[shmid] = ctypes.string_at(address, 32).split(b"\\0")[0].decode(errors="replace")
        ctypes.memmove(address, b"OVERWRITTEN\\0", 12)
own = libc.shmget(OWN_KEY, 4096, 0o1000 | 0o666)
queue = libc.msgget(OWN_KEY, 0o1000 | 0o666)
print(json.dumps({"read": read, "own": own, "queue": queue}))
"""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmat.restype = ctypes.c_void_p


def _keys(kind: str) -> set[int]:
    """The keys of the host's SysV IPC objects of `kind` (``shm`` or ``msg``)."""
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


@pytest.fixture
def secret_segment() -> Iterator[tuple[int, int]]:
    """A 0600 segment of this process holding a secret: (key, address)."""
    key = 0x1B000000 | (os.getpid() & 0xFFFFFF)
    shmid = _libc.shmget(key, 4096, _IPC_CREAT | 0o600)
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    address = _libc.shmat(shmid, None, 0)
    ctypes.memmove(address, b"APP-SECRET\0", 11)
    try:
        yield key, address
    finally:
        _libc.shmdt(ctypes.c_void_p(address))
        _libc.shmctl(shmid, _IPC_RMID, None)


@pytest.mark.skipif(not Path("/proc/sysvipc").exists(), reason="Linux SysV IPC only")
async def test_a_sandboxed_kernel_reaches_no_host_ipc_object_and_leaves_none(
    tmp_path: Path, secret_segment: tuple[int, int]
) -> None:
    require_sandbox()
    key, address = secret_segment
    own_key = key ^ 0x00800000
    code = ATTACK.replace("OWN_KEY", str(own_key)).replace("KEY", str(key))
    async with CodeExecutor(sandbox=True, working_dir=tmp_path, spare_kernel=False) as executor:
        result = json.loads(str((await executor.execute(code)).text))
        assert result["read"] == {}, f"the kernel read the host's segments: {result['read']}"
        assert result["own"] >= 0 and result["queue"] >= 0, result
        assert own_key not in _keys("shm") and own_key not in _keys("msg")
    assert ctypes.string_at(address, 10) == b"APP-SECRET"
    assert own_key not in _keys("shm") and own_key not in _keys("msg")
