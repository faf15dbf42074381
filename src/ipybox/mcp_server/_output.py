"""Shaping cell output for an agent: clean text, bounded length, small images."""

from __future__ import annotations

import base64
import io
import os
import time
from pathlib import Path

from ipybox._infra import strip_ansi
from ipybox.app.sandbox import Confined, ConfinedPathError, remove_entry, write_new

# Images are scaled so that the longer side is at most this many pixels: a model sees about
# (w * h) / 750 tokens per image, so 768 x 768 stays under a thousand tokens.
MAX_IMAGE_SIDE = 768
MAX_IMAGE_BYTES = 50 * 1024 * 1024
OUTPUT_DIR = ".ipybox/outputs"
_KEEP_OUTPUTS = 100


def clean(text: str) -> str:
    """Remove ANSI escape sequences and collapse carriage-return rewrites of a line.

    A progress bar that redraws itself with ``\\r`` leaves only its final state, as a
    terminal would show it.
    """
    text = strip_ansi(text).replace("\r\n", "\n")
    if "\r" not in text:
        return text
    return "\n".join(_last_redraw(line) for line in text.split("\n"))


def _last_redraw(line: str) -> str:
    parts = line.split("\r")
    # A trailing "\r" (the cursor went back, nothing written yet) keeps the previous state.
    while len(parts) > 1 and parts[-1] == "":
        parts.pop()
    return parts[-1]


def last_line(text: str, limit: int = 200) -> str:
    """The last non-empty line of `text`, shortened to `limit` characters."""
    for line in reversed(clean(text).splitlines()):
        if line := line.strip():
            return line if len(line) <= limit else line[: limit - 1] + "…"
    return ""


def truncate(text: str, max_chars: int, workspace: Path) -> str:
    """Keep the head and the tail of `text` within about `max_chars` characters.

    The middle is replaced by a marker that says how much was left out and names a file in
    the workspace that holds the complete output.
    """
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    try:
        path = _save_full_output(text, workspace)
    except (ConfinedPathError, OSError) as exc:
        where = f"the complete output was not saved ({exc})"
    else:
        where = f"the complete output is in {path.relative_to(workspace)} in the workspace"
    # The tail matters most (the traceback or the final value), so it gets the larger share.
    head_len = max_chars * 2 // 5
    tail_len = max_chars - head_len
    head, tail = text[:head_len], text[len(text) - tail_len :]
    omitted = len(text) - head_len - tail_len
    marker = f"\n[... {omitted} of {len(text)} characters omitted; {where} ...]\n"
    return head + marker + tail


def _save_full_output(text: str, workspace: Path) -> Path:
    now = time.time_ns()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now // 1_000_000_000))
    # The sub-second part keeps names unique and in order, for pruning below.
    name = f"output-{stamp}-{now % 1_000_000_000:09d}.txt"
    with Confined(workspace) as root:
        folder = root.open_dir(OUTPUT_DIR, create=True)
        try:
            write_new(folder, name, text)
            # Only the recent outputs are worth keeping: an agent reads a saved output soon or never.
            saved = sorted(entry for entry in os.listdir(folder) if entry.startswith("output-"))
            for old in saved[: max(0, len(saved) - _KEEP_OUTPUTS)]:
                remove_entry(folder, old)
        finally:
            os.close(folder)
    return workspace / OUTPUT_DIR / name


def read_image(path: Path, workspace: Path, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of the image file `path` in `workspace`, read without following links.

    Kernel code can replace the images folder or the file between the kernel client saving it
    and the server reading it back.

    Raises:
        ConfinedPathError: If the file is refused (a link on the way, more than one hard link,
            not a regular file, over `max_bytes`, or not inside `workspace`).
    """
    try:
        relative = path.relative_to(workspace)
    except ValueError:
        raise ConfinedPathError(f"The image {str(path)!r} is not in the workspace.") from None
    with Confined(workspace) as root:
        return root.read_bytes(relative.as_posix(), max_bytes)


# Images with more pixels are not decoded (a small PNG file can hold a huge image); a larger
# one that must be scaled is skipped with a note.
MAX_IMAGE_PIXELS = 25_000_000
# An image that cannot be decoded for scaling is passed on unchanged if its file is this small.
_MAX_UNSCALED_BYTES = 4 * 1024 * 1024


class ImageSkipped(Exception):
    """An image that is not passed on; the message says why."""


def scaled_png(data: bytes, max_side: int = MAX_IMAGE_SIDE) -> str:
    """The PNG `data` as base64, scaled down so its longer side is at most `max_side`.

    Blocking and CPU-bound: run it in a worker thread. An image within `max_side` is passed on
    as it is, without being decoded; so is a PNG file of at most 4 MiB that Pillow cannot
    decode (other viewers may show what Pillow refuses, e.g. a bad ancillary chunk).

    Raises:
        ImageSkipped: The image has more than `MAX_IMAGE_PIXELS` pixels, or cannot be decoded
            and is not a PNG file small enough to pass on unscaled.
    """
    from PIL import Image  # imported on first image: Pillow is not needed before

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if max(width, height) <= max_side:
                return base64.b64encode(data).decode("ascii")
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageSkipped(
                    f"it is {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} pixels ipybox scales; "
                    "save a smaller figure"
                )
            image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
            buffer = io.BytesIO()
            image.save(buffer, format="PNG", optimize=True)
    except Image.DecompressionBombError as exc:
        raise ImageSkipped(f"it has too many pixels to scale ({exc})") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # UnidentifiedImageError is an OSError
        return _unscaled(data, exc)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _unscaled(data: bytes, error: BaseException) -> str:
    """A PNG that could not be decoded, as base64 if it is small enough to pass on as it is."""
    if len(data) > _MAX_UNSCALED_BYTES or not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise ImageSkipped(
            f"it could not be decoded ({error}) and is not a small PNG file to pass on as it is"
        )
    return base64.b64encode(data).decode("ascii")
