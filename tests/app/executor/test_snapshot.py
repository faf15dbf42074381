"""`CodeExecutor.save_snapshot` / `load_snapshot` on real kernels, sandboxed and not, and pooled.

The attacks: a snapshot whose pickle runs code when loaded runs it in the kernel only (never in
this process), with no more rights than a cell; a kernel that forges its snapshot file (a link to
a file it should not hand over, a damaged frame) gets nothing written.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from ipybox import CodeExecutor, KernelPool, SnapshotReport
from ipybox.errors import SnapshotError

# private-ok: the tests craft snapshot files (another Python's, a damaged one) with the format's
# own constants, which only the format module defines.
from ipybox.kernel._snapshot_format import END, MAGIC, TAIL_BYTES
from tests.sandbox_support import require_sandbox

pytestmark = pytest.mark.asyncio(loop_scope="module")

STATE = """
import collections, json as js, os, socket, threading
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm2(self):
        return self.x ** 2 + self.y ** 2
def double(v):
    return 2 * v
square = lambda v: v * v
points = [Point(i, i + 1) for i in range(3)]
alias = points
counts = collections.Counter("hello")
handle = open("notes.txt", "w")
sock = socket.socket()
worker = threading.Thread(target=lambda: None)
gen = (i for i in range(3))
os.makedirs("sub", exist_ok=True)
os.chdir("sub")
_private = 7
"""

CHECK = """
print(double(21), square(3), points[2].norm2(), alias is points, counts["l"], js.dumps([1]),
      type(points[0]).__name__, _private, os.getcwd().endswith("sub"))
"""


@pytest.fixture(autouse=True)
def state_dir(workdir: Path) -> Path:
    """This module's executors share one registry, the module's (see `workdir`)."""
    return workdir / "state"


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=["unsandboxed", pytest.param("sandboxed", marks=pytest.mark.slow)],
)
async def executor(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[CodeExecutor]:
    if request.param == "sandboxed":
        require_sandbox()
    async with CodeExecutor(sandbox=request.param == "sandboxed") as ex:  # in workdir; chdir persists
        yield ex


@pytest.fixture
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder outside the kernel's working directory, for the snapshot files."""
    yield tmp_path_factory.mktemp("snapshots")


async def _fresh(executor: CodeExecutor, workdir: Path) -> None:
    await executor.reset()
    await executor.execute(f"import os\nos.chdir({str(workdir)!r})")


async def test_a_snapshot_keeps_variables_functions_classes_modules_and_the_working_dir(
    executor: CodeExecutor, workdir: Path, outside: Path
) -> None:
    await _fresh(executor, workdir)
    await executor.execute(STATE)
    report = await executor.save_snapshot(outside / "state.snap")
    assert isinstance(report, SnapshotReport)
    assert {"Point", "double", "square", "points", "alias", "counts", "_private"} <= set(report.names)
    assert report.modules == {
        "collections": "collections",
        "js": "json",
        "os": "os",
        "socket": "socket",
        "threading": "threading",
    }
    assert report.left_out["handle"].startswith("an open file")
    assert report.left_out["sock"].startswith("a socket")
    assert report.left_out["worker"].startswith("a thread")
    assert report.left_out["gen"].startswith("a generator")
    assert not {"In", "Out", "_", "_i", "get_ipython", "exit"} & set(report.names)
    assert any("history" in item for item in report.not_kept)
    assert report.working_dir == str(workdir / "sub")
    assert report.size == (outside / "state.snap").stat().st_size > 0
    assert not [name for name in os.listdir(workdir) if name.startswith(".ipybox-snapshot")]

    await _fresh(executor, workdir)
    loaded = await executor.load_snapshot(outside / "state.snap")
    assert set(loaded.names) == set(report.names)
    assert loaded.modules == report.modules
    assert "handle" in loaded.left_out
    result = await executor.execute(CHECK)
    assert result.text == "42 9 13 True 2 [1] Point 7 True"
    assert not [name for name in os.listdir(workdir) if name.startswith(".ipybox-snapshot")]
    await executor.execute(f"handle.close() if 'handle' in dir() else None\nos.chdir({str(workdir)!r})")


async def test_a_load_that_fails_for_some_names_keeps_the_others_and_says_why(
    executor: CodeExecutor, workdir: Path, outside: Path
) -> None:
    await _fresh(executor, workdir)
    (workdir / "gone_mod.py").write_text("class Thing:\n    pass\n")
    await executor.execute("import gone_mod\nthing = gone_mod.Thing()\nkept = {'a': 1}\nlater = thing")
    await executor.save_snapshot(outside / "half.snap")
    (workdir / "gone_mod.py").unlink()
    await _fresh(executor, workdir)
    report = await executor.load_snapshot(outside / "half.snap")
    assert "kept" in report.names
    assert report.left_out["gone_mod"].startswith(
        "module gone_mod could not be imported: ModuleNotFoundError"
    )
    assert report.left_out["thing"].startswith("could not be loaded: ModuleNotFoundError")
    assert report.left_out["later"] == "it refers to thing, which did not load"
    assert (await executor.execute("print(kept)")).text == "{'a': 1}"


async def test_bad_snapshot_files_get_clear_errors_and_lose_nothing(
    executor: CodeExecutor, workdir: Path, outside: Path
) -> None:
    await _fresh(executor, workdir)
    await executor.execute("x = list(range(1000))")
    good = outside / "good.snap"
    await executor.save_snapshot(good)
    data = good.read_bytes()
    with pytest.raises(SnapshotError, match=r"There is no snapshot at .*missing.snap.*check the path"):
        await executor.load_snapshot(outside / "missing.snap")
    (outside / "cut.snap").write_bytes(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="cut short"):
        await executor.load_snapshot(outside / "cut.snap")
    (outside / "foreign.snap").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(SnapshotError, match="not an ipybox snapshot"):
        await executor.load_snapshot(outside / "foreign.snap")
    with pytest.raises(SnapshotError, match=r"over the cap of 100 bytes; pass a larger max_bytes"):
        await executor.load_snapshot(good, max_bytes=100)
    flipped = bytearray(data)
    flipped[len(MAGIC) + 5] ^= 0xFF
    (outside / "flipped.snap").write_bytes(bytes(flipped))
    with pytest.raises(SnapshotError, match="damaged: the bytes of 'x' do not match"):
        await executor.load_snapshot(outside / "flipped.snap")
    (outside / "old.snap").write_bytes(_with_trailer(data, python="2.7"))
    with pytest.raises(SnapshotError, match=r"saved by CPython 2\.7, and this kernel runs CPython 3\.\d+"):
        await executor.load_snapshot(outside / "old.snap")
    assert good.read_bytes() == data
    assert (await executor.execute("print(len(x))")).text == "1000"
    # A save that fails replaces nothing: the earlier snapshot stays.
    with pytest.raises(SnapshotError, match="cannot be opened"):
        await executor.save_snapshot(outside / "no-such-folder" / "s.snap")
    await executor.execute("y = bytes(2 * 1024 * 1024)")
    report = await executor.save_snapshot(good, max_bytes=9 * 1024 * 1024)
    assert report.left_out["y"].startswith("too large: the snapshot would pass its cap of 9437184 bytes")
    assert "x" in report.names


def _with_trailer(data: bytes, **changes: str) -> bytes:
    length = int.from_bytes(data[-TAIL_BYTES : -len(END)], "big")
    start = len(data) - TAIL_BYTES - length
    trailer = json.loads(data[start : len(data) - TAIL_BYTES])
    trailer.update(changes)
    encoded = json.dumps(trailer).encode()
    return data[:start] + encoded + len(encoded).to_bytes(4, "big") + END


async def test_attack_a_pickle_that_runs_code_on_load_runs_only_in_the_kernel_with_a_cells_rights(
    executor: CodeExecutor, workdir: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _fresh(executor, workdir)
    target = outside / "escaped.txt"
    # Loading `evil` runs code: it records the process that unpickled it, then writes outside the
    # working directory, as a cell may only without the sandbox.
    payload = (
        "import os\n"
        "open(f'unpickled-by-{os.getpid()}', 'w').close()\n"
        f"open({str(target)!r}, 'w').write('escaped')\n"
    )
    await executor.execute(
        f"class Evil:\n    def __reduce__(self):\n        return (exec, ({payload!r},))\nevil = Evil()\nplain = 1"
    )
    await executor.save_snapshot(outside / "evil.snap")
    cell = await executor.execute(
        f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('written')\nexcept OSError as e:\n"
        "    print('refused')"
    )
    target.unlink(missing_ok=True)

    def tripwire(*args: object, **kwargs: object) -> object:
        raise AssertionError("the application unpickled a snapshot")

    # No unpickling in this (the application's) process.
    monkeypatch.setattr(pickle, "loads", tripwire)
    monkeypatch.setattr(pickle, "load", tripwire)
    monkeypatch.setattr(pickle, "Unpickler", tripwire)
    await _fresh(executor, workdir)
    kernel_pid = int((await executor.execute("import os\nprint(os.getpid())")).text or "0")
    report = await executor.load_snapshot(outside / "evil.snap")
    monkeypatch.undo()
    marks = sorted(name for name in os.listdir(workdir) if name.startswith("unpickled-by-"))
    for name in marks:
        (workdir / name).unlink()
    assert marks == [f"unpickled-by-{kernel_pid}"] and kernel_pid != os.getpid()
    assert "plain" in report.names
    if cell.text == "refused":  # sandboxed: neither a cell nor the snapshot writes outside
        assert not target.exists()
        assert report.left_out["evil"].startswith("could not be loaded:")
    else:
        assert cell.text == "written" and target.read_text() == "escaped"
    target.unlink(missing_ok=True)


async def test_attack_a_kernel_that_forges_its_snapshot_file_gets_nothing_written(
    executor: CodeExecutor, workdir: Path, outside: Path
) -> None:
    await _fresh(executor, workdir)
    secret = outside / "secret.txt"
    secret.write_text("not for the kernel")
    dest = outside / "forged.snap"
    # The kernel's save is replaced: its staging file is made a link to a file of the user's.
    await executor.execute(
        "import ipybox.kernel._snapshot as m, os\n"
        "_real = m.save\n"
        f"m.save = lambda path, cap: os.symlink({str(secret)!r}, path)"
    )
    with pytest.raises(SnapshotError, match=r"not a regular file of its own|cannot be opened"):
        await executor.save_snapshot(dest)
    await executor.execute("m.save = lambda path, cap: open(path, 'wb').write(b'IPYBOX-SNAPSHOT\\x01 junk')")
    with pytest.raises(SnapshotError, match="is not a snapshot ipybox can load"):
        await executor.save_snapshot(dest)
    await executor.execute("m.save = _real")
    assert not dest.exists()
    assert not [name for name in os.listdir(workdir) if name.startswith(".ipybox-snapshot")]


@pytest.mark.slow
async def test_a_pooled_executor_saves_and_loads_snapshots(tmp_path: Path) -> None:
    async with KernelPool(size=1, working_dir=tmp_path) as pool:
        async with CodeExecutor(pool=pool, working_dir=tmp_path) as first:
            await first.execute("def f(v):\n    return v + 1\ndata = {'k': [1, 2]}")
            saved = await first.save_snapshot(tmp_path / "pooled.snap")
        async with CodeExecutor(pool=pool, working_dir=tmp_path) as second:
            loaded = await second.load_snapshot(tmp_path / "pooled.snap")
            assert set(loaded.names) == set(saved.names) == {"f", "data"}
            assert (await second.execute("print(f(data['k'][1]))")).text == "3"


async def test_no_trusted_module_can_unpickle_a_snapshot() -> None:
    """Only the kernel side imports a pickler or the kernel's snapshot code: the application, the
    gateway and the MCP server check a snapshot's frame and never unpickle it."""
    import ast

    src = Path(__file__).parents[3] / "src" / "ipybox"
    forbidden = {"pickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "ipybox.kernel._snapshot"}
    found = []
    for path in src.rglob("*.py"):
        if path.parent.name == "kernel":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.relative_to(src)}: {name}" for name in names if name in forbidden]
    assert found == []
