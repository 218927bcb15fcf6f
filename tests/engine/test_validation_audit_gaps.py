"""Bounds of request validation that a mutation audit found unpinned: each value just past a
bound is refused with a ValueError naming its field, and the bound itself is accepted.

SamplingParams and the InputProcessor are pure functions of the request and the model's fixed
facts, so most of these run on them directly (a one-character-per-token fake tokenizer makes
prompt lengths exact); one test runs the max_model_len edge through a tiny engine.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.sampling_params import INT64_MAX, MAX_BAD_WORD_CHARS, MAX_LOGPROBS

VOCAB = 100
MAX_MODEL_LEN = 16
MAX_NUM_SEQS = 4


class CharTokenizer:
    """One token per character (ids 3..52), so a text of k characters is k tokens."""

    def encode(self, text: str, add_special_tokens: bool = True, **_: object) -> list[int]:
        return [3 + ord(c) % 50 for c in text]


class TooBigTokenizer:
    """A tokenizer with more tokens than the model's embedding has rows."""

    def encode(self, text: str, add_special_tokens: bool = True, **_: object) -> list[int]:
        return [VOCAB + 5 for _ in text]


@pytest.fixture()
def proc() -> InputProcessor:
    return InputProcessor(CharTokenizer(), VOCAB, MAX_MODEL_LEN, MAX_NUM_SEQS)


def tok(ids):
    return {"prompt_token_ids": ids}


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("n", dict(n=0)),  # (refused when built, not only when the engine gets it)
        ("best_of", dict(n=1, best_of=2.0)),  # a float best_of would reach range() in the engine
        ("top_p", dict(top_p=0)),  # (0, 1]: 0 keeps no token
        ("top_k", dict(top_k=-2)),  # only -1 and 0 mean "off"
        ("min_p", dict(min_p=1.01)),
        ("presence_penalty", dict(presence_penalty=2.01)),
        ("frequency_penalty", dict(frequency_penalty=-2.01)),
        ("repetition_penalty", dict(repetition_penalty=0)),  # dividing logits by 0
        ("repetition_penalty", dict(repetition_penalty=0.005)),
        ("min_tokens", dict(min_tokens=5, max_tokens=4)),
        ("stop", dict(stop=["ok", ""])),  # an empty stop string would match at once
        ("logprobs", dict(logprobs=MAX_LOGPROBS + 1)),
        ("logprobs", dict(logprobs=-1)),
        ("prompt_logprobs", dict(prompt_logprobs=MAX_LOGPROBS + 1)),
        ("logit_bias", dict(logit_bias={1: 100.5})),
        ("logit_bias", dict(logit_bias={1: -100.5})),
        ("allowed_token_ids", dict(allowed_token_ids=[])),  # would mask every token
        ("bad_words", dict(bad_words=["w" * (MAX_BAD_WORD_CHARS + 1)])),
    ],
)  # fmt: skip
def test_the_value_just_past_each_bound_is_refused_naming_its_field(field, kwargs):
    """Every range SamplingParams documents is closed where vLLM closes it; a value just outside
    is a ValueError whose message starts with the field (the server's error ``param``)."""
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field), err.value


def test_each_bound_itself_is_accepted():
    """The edges are valid input: refusing them would turn away requests vLLM takes."""
    for kwargs in [
        dict(top_p=1), dict(top_p=1e-6), dict(min_p=0), dict(min_p=1),
        dict(presence_penalty=2, frequency_penalty=-2), dict(presence_penalty=-2, frequency_penalty=2),
        dict(repetition_penalty=0.01), dict(min_tokens=4, max_tokens=4), dict(logprobs=0, prompt_logprobs=0),
        dict(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS), dict(logit_bias={1: -100, 2: 100}),
        dict(bad_words=["w" * MAX_BAD_WORD_CHARS]), dict(n=2, best_of=2), dict(allowed_token_ids=[0]),
    ]:  # fmt: skip
        SamplingParams(**kwargs)


def test_minus_one_means_off_for_seed_and_top_k():
    """vLLM's spellings of "unset": seed=-1 is no seed (a seeded generator would make every
    such request draw alike) and top_k=-1 is top-k off, stored as 0 for the sampler."""
    params = SamplingParams(seed=-1, top_k=-1)
    assert params.seed is None and params.top_k == 0


@pytest.mark.parametrize(
    "field, good, bad",
    [
        ("top_k", dict(top_k=VOCAB), dict(top_k=VOCAB + 1)),
        ("stop_token_ids", dict(stop_token_ids=[VOCAB - 1]), dict(stop_token_ids=[VOCAB])),
        ("allowed_token_ids", dict(allowed_token_ids=[VOCAB - 1]), dict(allowed_token_ids=[VOCAB])),
        ("logit_bias", dict(logit_bias={VOCAB - 1: 1.0}), dict(logit_bias={VOCAB: 1.0})),
        ("logit_bias", dict(logit_bias={0: 1.0}), dict(logit_bias={"-1": 1.0})),
        ("n", dict(n=MAX_NUM_SEQS), dict(n=MAX_NUM_SEQS + 1)),
        ("best_of", dict(n=1, best_of=MAX_NUM_SEQS), dict(n=1, best_of=MAX_NUM_SEQS + 1)),
    ],
)  # fmt: skip
def test_vocabulary_and_batch_bounds_are_exact(proc, field, good, bad):
    """Token ids must lie in [0, vocab_size) (id vocab_size would index past the logits row) and
    n/best_of samples must fit max_num_seqs; the last valid value is still accepted."""
    proc.process(tok([1, 2]), SamplingParams(max_tokens=2, **good))
    with pytest.raises(ValueError) as err:
        proc.process(tok([1, 2]), SamplingParams(max_tokens=2, **bad))
    assert str(err.value).startswith(field), err.value


def test_prompt_token_ids_must_be_inside_the_vocabulary(proc):
    """The id equal to vocab_size is the first one outside the embedding table."""
    assert proc.process(tok([0, VOCAB - 1]), SamplingParams(max_tokens=2)).prompt_token_ids == [0, VOCAB - 1]
    with pytest.raises(ValueError, match=rf"^prompt_token_ids contains {VOCAB},"):
        proc.process(tok([1, VOCAB]), SamplingParams(max_tokens=2))


def test_a_text_prompt_must_leave_room_for_one_token(proc):
    """A prompt of max_model_len tokens leaves no position to generate into: refused whether it
    comes as text or as ids. One token shorter is accepted, with max_tokens defaulting to 1."""
    ok = proc.process("a" * (MAX_MODEL_LEN - 1), SamplingParams(max_tokens=None))
    assert len(ok.prompt_token_ids) == MAX_MODEL_LEN - 1 and ok.sampling_params.max_tokens == 1
    assert not ok.max_tokens_given
    for prompt in ("a" * MAX_MODEL_LEN, tok([5] * MAX_MODEL_LEN)):
        with pytest.raises(ValueError, match="^prompt has 16 tokens; max_model_len is 16"):
            proc.process(prompt, SamplingParams(max_tokens=None))


def test_prompt_plus_max_tokens_may_reach_max_model_len_but_not_pass_it(proc):
    """prompt + max_tokens == max_model_len fits exactly (the last token needs no KV slot after
    it); one more is refused, naming both numbers."""
    ok = proc.process(tok([5] * 10), SamplingParams(max_tokens=MAX_MODEL_LEN - 10))
    assert ok.sampling_params.max_tokens == MAX_MODEL_LEN - 10 and ok.max_tokens_given
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(7\) = 17 exceeds max_model_len \(16\)"):
        proc.process(tok([5] * 10), SamplingParams(max_tokens=MAX_MODEL_LEN - 9))


def test_default_max_tokens_is_capped_by_the_longest_context_the_pool_holds(proc):
    """Without max_tokens a request runs to the shorter of max_model_len and what the KV pool
    can hold for one request (longest_context, set by the engine), never past either."""
    proc.longest_context = 10
    assert proc.process(tok([5] * 4), SamplingParams(max_tokens=None)).sampling_params.max_tokens == 6
    proc.longest_context = 1000
    assert proc.process(tok([5] * 4), SamplingParams(max_tokens=None)).sampling_params.max_tokens == MAX_MODEL_LEN - 4


def test_priority_must_be_a_64_bit_integer(proc):
    assert proc.process(tok([1]), SamplingParams(max_tokens=1), priority=INT64_MAX).priority == INT64_MAX
    for bad in (INT64_MAX + 1, -(2**63) - 1, True, 1.0):
        with pytest.raises(ValueError, match="^priority must be a 64-bit integer"):
            proc.process(tok([1]), SamplingParams(max_tokens=1), priority=bad)


def test_stop_strings_need_detokenize(proc):
    """Stop strings are matched in the detokenized text: with detokenize=False they could never
    fire, so the request is refused instead of silently running to max_tokens."""
    proc.process(tok([1]), SamplingParams(max_tokens=2, stop=["x"]))
    with pytest.raises(ValueError, match="^stop strings need detokenize=True"):
        proc.process(tok([1]), SamplingParams(max_tokens=2, stop=["x"], detokenize=False))


def test_cache_salt_must_be_a_non_empty_string(proc):
    """An empty salt would silently share the prefix cache with unsalted requests."""
    assert proc.process({"prompt_token_ids": [1], "cache_salt": "t1"}, SamplingParams(max_tokens=1)).cache_salt == "t1"
    for bad in ("", 5):
        with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
            proc.process({"prompt_token_ids": [1], "cache_salt": bad}, SamplingParams(max_tokens=1))


def test_a_tokenizer_bigger_than_the_model_is_refused_at_the_prompt():
    """A text prompt whose ids fall outside the model's vocabulary (a mismatched tokenizer) is
    a ValueError naming the prompt, not an embedding index error inside a step."""
    proc = InputProcessor(TooBigTokenizer(), VOCAB, MAX_MODEL_LEN, MAX_NUM_SEQS)
    with pytest.raises(ValueError, match="^prompt: the tokenizer gave token id 105"):
        proc.process("hi")


def test_the_engine_runs_a_request_that_fills_max_model_len_exactly(tiny_llama):
    """End to end: prompt + max_tokens == max_model_len is accepted and generates all its
    tokens; one more token is refused and the engine keeps serving."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=32, log_stats_interval=1e9)
    params = SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)
    (out,) = llm.generate(tok([5] * 10), params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 22 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate(tok([5] * 10), SamplingParams(temperature=0, max_tokens=23), use_tqdm=False)
    (again,) = llm.generate(tok([5] * 10), params, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_choice_constraint_refuses_an_empty_option():
    """An empty choice would let the constraint end at once with no output; refused when built,
    naming structured_outputs.choice."""
    from pagedllm.sampling_params import StructuredOutputsParams

    assert StructuredOutputsParams(choice=("yes", "no")).choice == ["yes", "no"]
    with pytest.raises(ValueError, match=r"^structured_outputs\.choice must be a non-empty list of non-empty strings"):
        StructuredOutputsParams(choice=["yes", ""])
