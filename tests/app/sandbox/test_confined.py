"""`ipybox.app.sandbox._confined`: trusted file access inside a folder that hostile code writes at the same time."""

from __future__ import annotations

# private-ok: the confined file module (ipybox.app.sandbox._confined) is internal; its unit tests race it
# against a swapping attacker directly, which the public paths only reach one file at a time.
import ctypes
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipybox.app.sandbox._confined import Confined, ConfinedPathError, TooLargeError, write_new
from ipybox.code_exec import CodeExecutor
from ipybox.mcp_apigen import generate_mcp_sources
from tests.conftest import DEMO_SERVER
from tests.servers.demo_server import png_bytes

SWAPS = 3000


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("outside")
    return root, outside


def _renameat2_exchange() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    function: Callable[..., int] = ctypes.CDLL(None, use_errno=True).renameat2
    return function


@pytest.fixture
def swapping(dirs: tuple[Path, Path]) -> Iterator[threading.Thread]:
    """A thread swapping root/sub (a folder) with a link to outside, SWAPS times, atomically."""
    exchange = _renameat2_exchange()
    if exchange is None:
        pytest.skip("the race needs Linux's renameat2(RENAME_EXCHANGE)")
    root, outside = dirs
    (root / "sub").mkdir()
    (root / "sub" / "inside.txt").write_text("inside")
    (root / "sub.link").symlink_to(outside)
    a, b = bytes(root / "sub"), bytes(root / "sub.link")
    stop = threading.Event()

    def swap() -> None:
        for _ in range(SWAPS):
            if stop.is_set():
                break
            assert exchange(-100, a, -100, b, 2) == 0, ctypes.get_errno()
            time.sleep(0)  # let the other thread run between two swaps

    thread = threading.Thread(target=swap)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join()


def test_paths_out_of_the_folder_are_refused(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    with Confined(root) as confined:
        for path in ["", "/etc/passwd", "../x", "a/../../x", "C:\\x", "a\x00b", "."]:
            with pytest.raises(ConfinedPathError):
                confined.read_bytes(path, 100)
            with pytest.raises(ConfinedPathError):
                confined.write_atomic(path, b"x")


def test_a_link_at_any_component_is_refused_and_named(dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    (root / "a").mkdir()
    (root / "a" / "link").symlink_to(outside)
    (root / "file-link").symlink_to(outside / "secret.txt")
    with Confined(root) as confined:
        for path in ["a/link/secret.txt", "file-link"]:
            with pytest.raises(ConfinedPathError, match="symbolic link") as raised:
                confined.read_bytes(path, 100)
            assert str(outside) in str(raised.value) and "os.unlink" in str(raised.value)
        with pytest.raises(ConfinedPathError, match="symbolic link"):
            confined.write_atomic("a/link/new.txt", b"x")
        with pytest.raises(ConfinedPathError, match="symbolic link"):
            confined.write_atomic("file-link", b"x")
        with pytest.raises(ConfinedPathError, match="symbolic link"):
            confined.mkdir("a/link/deeper")
    assert os.listdir(outside) == ["secret.txt"] and (outside / "secret.txt").read_text() == "outside"


def test_a_write_replaces_a_hard_link_instead_of_writing_through_it(dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    os.link(outside / "secret.txt", root / "hard")
    with Confined(root) as confined:
        with pytest.raises(ConfinedPathError, match="hard links"):
            confined.read_bytes("hard", 100)
        confined.write_atomic("hard", b"new")
    assert (outside / "secret.txt").read_text() == "outside"
    assert (root / "hard").read_bytes() == b"new"
    assert [name for name in os.listdir(root) if name.endswith(".tmp")] == []


def test_wrong_kinds_and_sizes_get_clear_errors(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    (root / "folder").mkdir()
    (root / "big").write_bytes(b"x" * 11)
    os.mkfifo(root / "pipe")
    with Confined(root) as confined:
        with pytest.raises(ConfinedPathError, match="is a folder"):
            confined.read_bytes("folder", 100)
        with pytest.raises(ConfinedPathError, match="is a folder"):
            confined.write_atomic("folder", b"x")
        with pytest.raises(ConfinedPathError, match="ends in '/'"):
            confined.write_atomic("new/", b"x")
        with pytest.raises(ConfinedPathError, match="There is no file"):
            confined.read_bytes("missing", 100)
        with pytest.raises(ConfinedPathError, match="not a regular file"):
            confined.read_bytes("pipe", 100)
        with pytest.raises(TooLargeError):
            confined.read_bytes("big", 10)
        assert confined.read_bytes("big", 11) == b"x" * 11
    assert not (root / "new").exists()


def test_remove_tree_deletes_links_not_what_they_point_to(dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    (root / "tree" / "deep").mkdir(parents=True)
    (root / "tree" / "deep" / "out").symlink_to(outside)
    (root / "top-link").symlink_to(outside)
    with Confined(root) as confined:
        confined.remove_tree("tree")
        confined.remove_tree("top-link")
        confined.remove_tree("never-there")
    assert os.listdir(root) == [] and os.listdir(outside) == ["secret.txt"]


@pytest.mark.timeout(120)
def test_a_folder_swapped_for_a_link_never_sends_a_read_or_write_outside(
    dirs: tuple[Path, Path], swapping: threading.Thread
) -> None:
    root, outside = dirs
    rounds = 0
    with Confined(root) as confined:
        while swapping.is_alive():
            rounds += 1
            try:
                confined.write_atomic(f"sub/new-{rounds}.txt", b"x")
            except ConfinedPathError as exc:
                assert "symbolic link" in str(exc)
            try:
                assert confined.read_bytes("sub/inside.txt", 100) == b"inside"
            except ConfinedPathError as exc:
                assert "symbolic link" in str(exc)
            try:
                confined.remove_tree(("sub", f"new-{rounds}.txt"))
            except ConfinedPathError as exc:
                assert "symbolic link" in str(exc)
    assert rounds > 0 and os.listdir(outside) == ["secret.txt"]


async def test_generated_packages_are_not_written_through_a_link_in_place_of_root_dir(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, outside = dirs
    monkeypatch.setenv("IPYBOX_STATE_DIR", str(root.parent / "state"))
    (root / "mcptools").symlink_to(outside)
    params = {"command": sys.executable, "args": [str(DEMO_SERVER)]}
    with pytest.raises(Exception, match="symbolic link"):
        await generate_mcp_sources("demo", params, root / "mcptools")
    assert os.listdir(outside) == ["secret.txt"]
    (root / "mcptools").unlink()
    (root / "mcptools").mkdir()
    (root / "mcptools" / "demo").symlink_to(outside)
    names = await generate_mcp_sources("demo", params, root / "mcptools")
    assert "echo" in names and (root / "mcptools" / "demo" / "echo.py").is_file()
    assert not (root / "mcptools" / "demo").is_symlink() and os.listdir(outside) == ["secret.txt"]
    assert sorted(os.listdir(root / "mcptools")) == ["_search_index.json", "demo"]


@pytest.mark.timeout(180)
async def test_images_are_not_written_through_a_link_in_place_of_images_dir(dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    show = f"from IPython.display import Image, display\ndisplay(Image(data={png_bytes()!r}))\n"
    async with CodeExecutor(images_dir=root / "images") as executor:
        await executor.execute(f"import os\nos.symlink({str(outside)!r}, {str(root / 'images')!r})")
        result = await executor.execute(show)
        assert result.images == []
        assert result.text is not None and "The image was not saved" in result.text
        assert "symbolic link" in result.text
        assert os.listdir(outside) == ["secret.txt"]
        await executor.execute(f"os.unlink({str(root / 'images')!r})")
        result = await executor.execute(show)
        assert len(result.images) == 1 and result.images[0].parent == root / "images"
        assert result.images[0].read_bytes() == png_bytes()


def test_a_replaced_file_keeps_its_permissions(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    (root / "run.sh").write_text("old")
    (root / "run.sh").chmod(0o750)
    with Confined(root) as confined:
        confined.write_atomic("run.sh", "new")
    assert (root / "run.sh").read_text() == "new" and (root / "run.sh").stat().st_mode & 0o777 == 0o750


def test_replace_folder_swaps_in_whole_and_keeps_the_old_one_on_failure(dirs: tuple[Path, Path]) -> None:
    root, outside = dirs
    (root / "pkg").mkdir()
    (root / "pkg" / "old.py").write_text("old")

    def broken(folder: int) -> None:
        write_new(folder, "half.py", "half")
        raise OSError("disk full")

    with Confined(root) as confined:
        with pytest.raises(OSError, match="disk full"):
            confined.replace_folder("pkg", broken)
        assert os.listdir(root) == ["pkg"] and os.listdir(root / "pkg") == ["old.py"]
        confined.replace_folder("pkg", lambda folder: write_new(folder, "new.py", "new"))
        assert os.listdir(root) == ["pkg"] and os.listdir(root / "pkg") == ["new.py"]
        (root / "pkg.link").symlink_to(outside)
        shutil.rmtree(root / "pkg")
        (root / "pkg.link").rename(root / "pkg")
        confined.replace_folder("pkg", lambda folder: write_new(folder, "new.py", "new"))
    assert not (root / "pkg").is_symlink() and os.listdir(root / "pkg") == ["new.py"]
    assert os.listdir(outside) == ["secret.txt"]


def test_components_given_as_a_sequence_are_checked_too(dirs: tuple[Path, Path]) -> None:
    root, _ = dirs
    with Confined(root) as confined:
        for parts in [("..",), ("a/../..",), ("",), (".",)]:
            with pytest.raises(ConfinedPathError, match="not a file or folder name"):
                confined.open_dir(parts, create=True)
        with pytest.raises(ConfinedPathError, match="cannot be removed"):
            confined.remove_tree(())
    assert os.listdir(root) == []
