"""The snapshot file's layout, read by both sides: no pickle here, only bytes and JSON.

Standard library only. A snapshot is written by the kernel (untrusted); the application reads only
this frame around the pickles, to check a file before it copies or hands it on, and never the
pickles inside:

    MAGIC | pickle of the 1st name | pickle of the 2nd name | ... | trailer JSON | length | END

The trailer (JSON, at most `MAX_TRAILER_BYTES`) lists each name's pickle (offset, size, SHA-256),
the modules to import again, the names left out with their reasons, the working directory and the
Python that wrote it. It comes last because the kernel learns what it holds only while it writes;
a truncated file loses its end first, and with it the ``END`` mark.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"IPYBOX-SNAPSHOT\x01"
END = b"IPYBXEND"
FORMAT_VERSION = 1
MAX_TRAILER_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_SNAPSHOT_BYTES = 2 * 1024 * 1024 * 1024
"""The largest snapshot file taken by default (2 GiB), when saved and when loaded."""
_TAIL = struct.Struct(">I")
TAIL_BYTES = _TAIL.size + len(END)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_REASON = 500


class SnapshotFormatError(ValueError):
    """The file is not a whole snapshot of this format (the message says what is wrong)."""


@dataclass(frozen=True)
class Segment:
    """One name's pickle in the file."""

    name: str
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Trailer:
    """What a snapshot says about itself (checked for shape, not believed about the pickles)."""

    python: str
    implementation: str
    pickler: str
    working_dir: str
    segments: tuple[Segment, ...]
    modules: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "python": self.python,
            "implementation": self.implementation,
            "pickler": self.pickler,
            "working_dir": self.working_dir,
            "segments": [[s.name, s.offset, s.size, s.sha256] for s in self.segments],
            "modules": self.modules,
            "left_out": self.left_out,
        }


def encode_trailer(trailer: Trailer) -> bytes:
    """The trailer, its length and the end mark, as they close the file."""
    data = json.dumps(trailer.to_json(), separators=(",", ":")).encode()
    if len(data) > MAX_TRAILER_BYTES:
        raise SnapshotFormatError(f"The snapshot's table of names is over {MAX_TRAILER_BYTES} bytes.")
    return data + _TAIL.pack(len(data)) + END


def trailer_length(head: bytes, tail: bytes, file_size: int) -> int:
    """The trailer's length, from the file's first `len(MAGIC)` and last `TAIL_BYTES` bytes.

    Raises:
        SnapshotFormatError: If the file is not a snapshot, or is cut short.
    """
    if head != MAGIC:
        raise SnapshotFormatError(
            "it is not an ipybox snapshot (its first bytes are not an ipybox snapshot's)"
        )
    if file_size < len(MAGIC) + TAIL_BYTES or tail[len(tail) - len(END) :] != END:
        raise SnapshotFormatError("it is cut short (truncated): its end mark is missing")
    (length,) = _TAIL.unpack(tail[: _TAIL.size])
    if length > MAX_TRAILER_BYTES or length > file_size - len(MAGIC) - TAIL_BYTES:
        raise SnapshotFormatError("its table of names is damaged (a length past the file)")
    return int(length)


def parse_trailer(data: bytes, file_size: int) -> Trailer:
    """Check the trailer's shape: each field of its type, the pickles one after another from the
    magic to the trailer, and nothing else in the file.

    Raises:
        SnapshotFormatError: Saying what is wrong, including a format this version cannot read.
    """
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SnapshotFormatError("its table of names is damaged (not JSON)") from None
    if not isinstance(raw, dict):
        raise SnapshotFormatError("its table of names is damaged (not an object)")
    if raw.get("format") != FORMAT_VERSION:
        raise SnapshotFormatError(
            f"it is of snapshot format {raw.get('format')!r}, and this ipybox reads format {FORMAT_VERSION}; "
            "load it with the ipybox version that saved it"
        )
    texts = [raw.get(key) for key in ("python", "implementation", "pickler", "working_dir")]
    segments, modules, left_out = raw.get("segments"), raw.get("modules"), raw.get("left_out")
    if not all(isinstance(text, str) and len(text) <= 4096 for text in texts):
        raise SnapshotFormatError("its table of names is damaged (a field is not text)")
    if not (isinstance(segments, list) and isinstance(modules, dict) and isinstance(left_out, dict)) or not (
        _names_map(modules) and _names_map(left_out)
    ):
        raise SnapshotFormatError("its table of names is damaged (a list of names of the wrong shape)")
    parsed: list[Segment] = []
    offset = len(MAGIC)
    for item in segments:
        if not (
            isinstance(item, list)
            and len(item) == 4
            and _is_name(item[0])
            and item[1] == offset
            and isinstance(item[2], int)
            and not isinstance(item[2], bool)
            and item[2] > 0
            and isinstance(item[3], str)
            and _SHA256.fullmatch(item[3])
        ):
            raise SnapshotFormatError("its table of names is damaged (a pickle out of place)")
        parsed.append(Segment(item[0], item[1], item[2], item[3]))
        offset += item[2]
    if offset + len(data) + TAIL_BYTES != file_size:
        raise SnapshotFormatError("its size does not match its table of names (cut short or added to)")
    python, implementation, pickler, working_dir = (str(text) for text in texts)
    return Trailer(python, implementation, pickler, working_dir, tuple(parsed), dict(modules), dict(left_out))


def _is_name(value: object) -> bool:
    return isinstance(value, str) and value.isidentifier() and len(value) <= 256


def _names_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        _is_name(key) and isinstance(text, str) and len(text) <= _MAX_REASON for key, text in value.items()
    )


def reason(text: str) -> str:
    """`text` cut to the length a trailer's reason may have."""
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."
