"""Incremental detokenization: exact for byte-level BPE and multi-byte UTF-8, stop strings across tokens."""

from __future__ import annotations

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm import SamplingParams

TEXTS = [
    "Hello 😀 world! 你好，世界。 naïve café 🎉🎉",
    "日本語のテキストと emoji 👩‍👩‍👧 mixed",
    "plain ascii text with spaces   and\nnewlines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_text_and_never_break_a_character(default_tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams())
    pieces = []
    for i, tid in enumerate(ids):
        assert detok.update([tid]) is None
        pieces.append(detok.take_delta(finished=i == len(ids) - 1))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == default_tokenizer.decode(ids) == text
    if not text.isascii():
        assert sum(1 for p in pieces if p) < len(ids)  # some tokens were partial characters


def test_stop_string_across_tokens_is_cut_and_never_streamed(default_tokenizer):
    text = "The answer is forty-two. Done."
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["y-tw"]))
    streamed, hit = "", None
    for tid in ids:
        hit = detok.update([tid])
        streamed += detok.take_delta(finished=hit is not None)
        if hit:
            break
    assert hit == "y-tw"
    assert streamed == detok.text == "The answer is fort"


def test_include_stop_str_in_output(default_tokenizer):
    ids = default_tokenizer.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["three"], include_stop_str_in_output=True))
    hit = None
    for t in ids:
        if (hit := detok.update([t])) is not None:
            break
    assert hit == "three" and detok.text == "one two three"


def test_special_tokens_skipped_or_kept(default_tokenizer):
    ids = default_tokenizer.encode("hi", add_special_tokens=False) + [default_tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(default_tokenizer, SamplingParams())
    keep = IncrementalDetokenizer(default_tokenizer, SamplingParams(skip_special_tokens=False))
    skip.update(ids)
    keep.update(ids)
    assert skip.text == "hi" and keep.text == "hi" + default_tokenizer.eos_token
