"""Incremental detokenization: exact for byte-level BPE and multi-byte UTF-8, stop strings across tokens."""

from __future__ import annotations

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer, prime_tokens
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


def test_of_several_stop_strings_the_earliest_in_the_text_wins(default_tokenizer):
    """Both stop strings end with the same token; the one that starts first cuts the text,
    whatever the order of the list (vLLM's rule)."""
    ids = default_tokenizer.encode("one two three four", add_special_tokens=False)
    for stop in (["three", "two three"], ["two three", "three"]):
        detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=stop))
        hit = None
        for t in ids:
            if (hit := detok.update([t])) is not None:
                break
        assert hit == "two three" and detok.text == "one ", stop


def test_special_tokens_skipped_or_kept(default_tokenizer):
    ids = default_tokenizer.encode("hi", add_special_tokens=False) + [default_tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(default_tokenizer, SamplingParams())
    keep = IncrementalDetokenizer(default_tokenizer, SamplingParams(skip_special_tokens=False))
    skip.update(ids)
    keep.update(ids)
    assert skip.text == "hi" and keep.text == "hi" + default_tokenizer.eos_token


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A tiny Llama-2-style tokenizer: Metaspace words, byte fallback, and a decoder that strips
    the leading space of a text's first token."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tk.train_from_iterator(["The capital of France is Paris. The cat sat on the mat."] * 20, trainer)
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(256):  # the byte-fallback tokens, ordinary (not special) as in Llama 2 / Gemma
        vocab[f"<0x{i:02X}>"] = len(vocab)
    tk = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_the_first_generated_word_keeps_its_space_after_the_prompt(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    full = tok.encode("The capital of France is Paris", add_special_tokens=False)
    output = full[len(prompt):]
    assert full[: len(prompt)] == prompt and tok.decode(output) == "Paris"  # decoded alone: the space is gone
    detok = IncrementalDetokenizer(tok, SamplingParams(), prime=prime_tokens(tok, prompt, True))
    detok.update(output)
    assert detok.take_delta(finished=True) == detok.text == " Paris"
    assert tok.decode(prompt) + detok.text == tok.decode(full)


def test_a_prompt_that_ends_inside_a_character_is_completed_by_the_output(default_tokenizer):
    ids = default_tokenizer.encode("Hello 😀 world", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if default_tokenizer.decode(ids[:k]).endswith("\ufffd"))
    prime = prime_tokens(default_tokenizer, ids[:cut], True)
    assert prime == ids[max(0, cut - 4) : cut] or len(prime) > 4  # a short suffix, not the whole prompt
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(), prime=prime)
    detok.update(ids[cut:])
    assert detok.text == " 😀 world"  # (the space is in the token that starts the emoji)


def test_a_byte_run_that_is_not_utf8_does_not_fail_the_request(sentencepiece_tokenizer):
    """The decoder turns "A" + a lone lead byte into U+FFFD U+FFFD, rewriting text already read:
    tokenizers' stream raises "Invalid prefix"; the detokenizer starts a new stream there."""
    tok = sentencepiece_tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in ("<0x41>", "<0xE6>")] + tok.encode("cat sat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["sat"]))
    streamed, hit = "", None
    for t in ids:
        if (hit := detok.update([t])) is not None:
            break
        streamed += detok.take_delta(finished=False)
    streamed += detok.take_delta(finished=True)
    assert hit == "sat" and streamed == detok.text and detok.text.startswith("A") and detok.text.endswith("cat ")


def test_cumulative_text_never_shows_what_a_stop_string_takes_back(default_tokenizer):
    ids = default_tokenizer.encode("The cat sat on the mat. Done", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, SamplingParams(stop=["sat on the mat"]))
    shown = []
    for t in ids:
        hit = detok.update([t])
        shown.append(detok.visible_text(finished=hit is not None))
        if hit:
            break
    assert shown[-1] == "The cat "
    assert all(shown[-1].startswith(s) for s in shown)  # every earlier output is a prefix of the last
