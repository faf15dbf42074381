"""What one execution's messages amount to: its output text (kept within a limit, without
escape sequences), its images (saved to the images folder) and its error, if any."""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import logging
import os
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipybox._infra import ANSI_TAIL, strip_ansi
from ipybox.app.sandbox import Confined, ConfinedPathError, write_new
from ipybox.errors import ExecutionError

__all__ = ["DEFAULT_MAX_OUTPUT_CHARS", "AnsiStripper", "ExecutionResult", "KeptText", "Outcome"]

# The logger keeps the name of the module's public (or former) path.
logger = logging.getLogger("ipybox.kernel_mgr.client")

_ANSI_TAIL_MAX = 4096
# Characters of one execution's output text that an `ExecutionResult` keeps (its head and tail).
DEFAULT_MAX_OUTPUT_CHARS = 16 * 1024 * 1024
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class ExecutionResult:
    """The result of code that ran to completion.

    Attributes:
        text: Everything the code printed or displayed as text, or ``None`` if nothing. Output
            over the client's ``max_output_chars`` keeps its head and tail, with a note of how
            much was dropped between them; an output the client could not read (say an image
            that is not base64 PNG data) is skipped with a note in its place.
        images: Paths of the PNG images the code displayed (e.g. matplotlib plots).
    """

    text: str | None
    images: list[Path] = field(default_factory=list)


@dataclass
class Outcome:
    """What the messages of one execution said so far: its output, error and progress.

    Args:
        kept: The output text kept for the result.
        images_dir: Where the execution's PNG images are saved.
    """

    kept: KeptText
    images_dir: Path
    images: list[Path] = field(default_factory=list)
    error: dict[str, Any] | None = None
    idle: bool = False
    replied: bool = False
    # The reply's user expressions (`KernelClient.evaluate`), as the kernel sent them.
    expressions: dict[str, Any] = field(default_factory=dict)
    # One per stream name (stdout, stderr): an escape sequence may be split across its chunks.
    strippers: dict[str, AnsiStripper] = field(default_factory=dict)

    def read(self, msg: dict[str, Any], busy: asyncio.Event) -> str | None:
        """Take in one message of the execution; the output text it carries, if any. `busy` is set
        once the kernel has started the code."""
        content = msg["content"]
        if not isinstance(content, dict):
            return None  # not a Jupyter message's content: nothing in it to read
        match msg["msg_type"]:
            case "execute_reply":
                self.replied = True
                self.reply(content)
            case "status":
                self.idle = content.get("execution_state") == "idle"
            case "execute_input":
                # Published once the kernel takes SIGINT as KeyboardInterrupt; before that
                # it ignores the signal, so an interrupt waits for this.
                busy.set()
            case "stream":
                return self.stream(content)
            case "execute_result" | "display_data":
                return self.display(content.get("data"))
            case "error":
                self.error = content
        return None

    def reply(self, content: dict[str, Any]) -> None:
        if isinstance(expressions := content.get("user_expressions"), dict):
            self.expressions = expressions
        if content.get("status") == "error" and self.error is None:
            self.error = content
        elif content.get("status") == "aborted":
            self.error = {
                "ename": "Aborted",
                "evalue": "The kernel aborted the execution without running it.",
            }

    def stream(self, content: dict[str, Any]) -> str:
        chunk = content.get("text", "")
        if not isinstance(chunk, str):
            return _skipped("a stream output", "its text is not a string")
        name = str(content.get("name", ""))
        stripper = self.strippers.get(name)
        if stripper is None:
            stripper = self.strippers[name] = AnsiStripper()
        return stripper.feed(chunk)

    def result(self) -> ExecutionResult:
        """The execution's result; `ExecutionError` if it raised."""
        if self.error is not None:
            ename = str(self.error.get("ename", ""))
            evalue = str(self.error.get("evalue", ""))
            lines = self.error.get("traceback")
            lines = [str(line) for line in lines] if isinstance(lines, list) else []
            traceback = strip_ansi("\n".join(lines))
            raise ExecutionError(
                traceback or f"{ename}: {evalue}", ename=ename, evalue=evalue, traceback=traceback
            )
        text = self.kept.text(strip="\n")
        return ExecutionResult(text=text or None, images=self.images)

    def display(self, data: Any) -> str | None:
        """Save a display bundle's PNG, or return its text; a note for one that cannot be read."""
        if not isinstance(data, dict):
            return _skipped("a display output", "its data is not a mapping of MIME types")
        if "image/png" in data:
            png = data["image/png"]
            # The signature is checked on the first bytes: b64decode skips what is not base64.
            if not isinstance(png, str) or not _is_png(png):
                return _skipped("an image/png output", "it is not base64-encoded PNG data")
            saved = self._save_image(png)
            if isinstance(saved, str):
                return saved
            self.images.append(saved)
            return None
        if "text/plain" in data:
            plain = data["text/plain"]
            if not isinstance(plain, str):
                return _skipped("a text/plain output", "it is not a string")
            return strip_ansi(plain) + "\n"
        return None

    def _save_image(self, b64: str) -> Path | str:
        """Save a PNG the code displayed; its path, or a line of output saying why it was not saved."""
        try:
            return self._write_image(b64)
        except (ConfinedPathError, OSError, ValueError) as exc:  # ValueError: not base64
            logger.warning("An image was not saved: %s", exc)
            return f"[The image was not saved: {exc}]\n"

    def _write_image(self, b64: str) -> Path:
        # Kernel code can write the images folder (by default in its working directory): the
        # folder is walked without following links, so one put in its place is refused, and the
        # file is created new. Its parent is taken as the application names it.
        folder = Path(os.path.normpath(self.images_dir.absolute()))
        name = f"{uuid.uuid4().hex[:12]}.png"
        folder.parent.mkdir(parents=True, exist_ok=True)
        with Confined(folder.parent, label=repr(str(folder.parent))) as parent:
            fd = parent.open_dir([folder.name] if folder.name else [], create=True)
            try:
                write_new(fd, name, base64.b64decode(b64))
            finally:
                os.close(fd)
        return folder / name


def _is_png(b64: str) -> bool:
    try:
        return base64.b64decode(b64.lstrip()[:12]).startswith(_PNG_SIGNATURE)
    except (binascii.Error, ValueError):
        return False


def _skipped(what: str, why: str) -> str:
    return f"[ipybox skipped {what}: {why}]\n"


class KeptText:
    """The output text an execution keeps: whole up to `limit` characters, else its head and tail.

    The head takes the first half of the limit and the tail the last output that fits the
    other half; what lies between is counted and dropped, so memory stays bounded however much
    a kernel prints. The MCP server keeps a running cell's output with it too.
    """

    def __init__(self, limit: int) -> None:
        self._head_room = limit // 2
        self._tail_room = limit - self._head_room
        self._head: list[str] = []
        self._tail: deque[str] = deque()
        self._tail_size = 0
        self._dropped = 0

    def append(self, text: str) -> None:
        if self._head_room:
            part = text[: self._head_room]
            self._head.append(part)
            self._head_room -= len(part)
            text = text[len(part) :]
            if not text:
                return
        self._tail.append(text)
        self._tail_size += len(text)
        while self._tail_size > self._tail_room:
            excess = self._tail_size - self._tail_room
            first = self._tail[0]
            if len(first) <= excess:
                self._tail.popleft()
                cut = len(first)
            else:
                self._tail[0] = first[excess:]
                cut = excess
            self._tail_size -= cut
            self._dropped += cut

    def __bool__(self) -> bool:
        return bool(self._head)

    def recent(self, count: int = 10) -> str:
        """The last `count` chunks joined (for progress reports while a cell runs)."""
        tail = list(itertools.islice(reversed(self._tail), count))[::-1]
        head = self._head[len(self._head) - (count - len(tail)) :] if len(tail) < count else []
        return "".join([*head, *tail])

    def text(self, strip: str = "") -> str:
        """Everything kept, with a note where output was dropped; without the `strip` characters at its ends."""
        parts = [*self._head]
        if self._dropped:
            parts.append(
                f"\n[... ipybox dropped {self._dropped} characters of output here: an execution keeps at most "
                f"{self._head_room_total() + self._tail_room} characters, its beginning and its end ...]\n"
            )
        parts.extend(self._tail)
        # Stripping the end parts before joining spares a copy of the whole (megabytes, for a large output).
        return "".join(_strip_parts(parts, strip) if strip else parts)

    def _head_room_total(self) -> int:
        return sum(len(part) for part in self._head) + self._head_room


def _strip_parts(parts: list[str], chars: str) -> list[str]:
    """The parts whose join is ``"".join(parts).strip(chars)``."""
    first = next((i for i, part in enumerate(parts) if part.lstrip(chars)), len(parts))
    last = next((i for i in range(len(parts) - 1, first - 1, -1) if parts[i].rstrip(chars)), first - 1)
    kept = parts[first : last + 1]
    if kept:
        kept[0] = kept[0].lstrip(chars)
        kept[-1] = kept[-1].rstrip(chars)
    return kept


class AnsiStripper:
    """Removes escape sequences from one output stream whose chunks may split a sequence."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, text: str) -> str:
        """The text of this chunk without escape sequences; an unfinished one waits for the next."""
        if not self._held and "\x1b" not in text:
            return text  # nothing to strip (most output): no regular expression runs over it
        text = strip_ansi(self._held + text)
        tail = ANSI_TAIL.search(text)
        if tail is not None and len(text) - tail.start() <= _ANSI_TAIL_MAX:
            self._held = text[tail.start() :]
            return text[: tail.start()]
        self._held = ""
        return text
