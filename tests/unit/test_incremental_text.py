"""The server's streamed text is decoded a few tokens at a time (`IncrementalText`): it must add up to the text
decoded whole, and never take back what it already sent."""

from __future__ import annotations

import pytest

from posttrain.data.tiny_world import build_tiny_tokenizer
from posttrain.serve.parsing import IncrementalText

TEXTS = [
    "Hello there, friend.",
    "Héllo wörld 😀 日本語 ok\n  two  spaces\ttab",
    "<think>\nadd 12 and 30\n</think>\n\n42",
    "🙂🙂🙂 ééé",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_adds_up_to_the_whole_decode_and_only_grows(text):
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    incremental = IncrementalText(tokenizer)
    seen = [incremental.update(ids[: i + 1]) for i in range(len(ids))]
    assert seen[-1] == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))
    assert not any(s.endswith("\ufffd") for s in seen)  # half a character is held back, not sent


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "the tiny tokenizer has the emoji as one token; this test needs it split"
    incremental = IncrementalText(tokenizer)
    assert [incremental.update(ids[: i + 1]) for i in range(len(ids))] == [""] * (len(ids) - 1) + ["😀"]
