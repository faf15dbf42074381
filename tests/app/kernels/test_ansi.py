"""Escape sequences are removed from kernel output, also when a chunk boundary splits one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

# Private: the stripper is fed chunk boundaries no real kernel can be made to produce on demand.
from ipybox.app.kernels._output import AnsiStripper


@given(st.lists(st.integers(min_value=0, max_value=60), max_size=6))
def test_escape_sequences_split_across_chunks_are_removed_whole(cuts: list[int]) -> None:
    text = "a\x1b[1;31mred\x1b[0m b\x1b]8;;https://x.org\x1b\\link\x1b]8;;\x07 c\x1b7d\x1b(Be"
    points = sorted({min(cut, len(text)) for cut in cuts})
    pieces = [text[start:end] for start, end in zip([0, *points], [*points, len(text)], strict=True)]
    stripper = AnsiStripper()
    assert "".join(stripper.feed(piece) for piece in pieces) == "ared blink cde"


def test_kept_text_is_whole_up_to_its_limit_and_else_its_head_and_tail() -> None:
    import random

    # Private: the kept text is fed sizes and chunkings a real kernel cannot be made to produce.
    from ipybox.app.kernels._output import KeptText

    rng = random.Random(7)
    for _ in range(300):
        limit = rng.randint(2, 60)
        chunks = [
            "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 25))) for _ in range(rng.randint(0, 12))
        ]
        whole = "".join(chunks)
        for kept in (KeptText(limit),):
            for chunk in chunks:
                kept.append(chunk)
            text = kept.text()
            if len(whole) <= limit:
                assert text == whole
            else:
                head, tail = limit // 2, limit - limit // 2
                dropped = len(whole) - limit
                assert text.startswith(whole[:head]) and text.endswith(whole[len(whole) - tail :])
                assert f"{dropped} characters" in text
                assert len(text) < limit + 200
