"""Log-probabilities against transformers' fp32 logits, and streaming text, on the real default model."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import RequestOutputKind

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=256, log_stats_interval=1e9)


def test_logprobs_match_transformers_log_softmax(llm, hf_default_model):
    hf_model = hf_default_model
    tok = llm.get_tokenizer()
    prompts = [
        "The capital of France is",
        tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}], tokenize=False, add_generation_prompt=True),
        "def add(a, b):\n    return",
    ]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=5)
    worst = 0.0
    for out in llm.generate(prompts, params, use_tqdm=False):
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        n_prompt = len(out.prompt_token_ids)
        for j, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[n_prompt - 1 + j]
            top = row.topk(5)
            assert entry[tid].rank == 1
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert t in entry, f"top-5 token {t} missing at step {j}"
                worst = max(worst, abs(entry[t].logprob - v))
                assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        # prompt logprobs: position p predicts prompt token p + 1
        for p in range(1, n_prompt):
            entry = out.prompt_logprobs[p]
            tid = out.prompt_token_ids[p]
            assert entry[tid].logprob == pytest.approx(float(ref[p - 1, tid]), abs=1e-4)
            assert entry[tid].rank == int((ref[p - 1] > ref[p - 1, tid]).sum()) + 1
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    print(f"worst logprob difference vs transformers: {worst:.2e}")


def _chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    "prompt",
    [
        lambda tok: _chat(tok, "Translate 'good morning, my friend' into Chinese and Japanese."),
        lambda tok: "My favourite emoji, one per line:\n1. 😀\n2. 🎉\n3. 🌞\n4.",
    ],
    ids=["cjk", "emoji"],
)
def test_streamed_pieces_concatenate_to_the_final_text(llm, prompt):
    tok = llm.get_tokenizer()
    prompt = prompt(tok)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=60)
    engine.add_request(prompt, params, request_id="stream", output_kind=RequestOutputKind.DELTA)
    pieces, tokens, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                pieces.append(c.text)
                tokens += c.token_ids
            if out.finished:
                final = out
    assert final is not None and final.outputs[0].finish_reason is not None
    text = "".join(pieces)
    assert all("\ufffd" not in p for p in pieces)
    full = tok.decode(tokens, skip_special_tokens=True)
    if full.endswith("\ufffd"):
        # Cut by max_tokens inside a multi-byte character: the stream ends before the token
        # holding its first bytes, where a one-shot decode ends in U+FFFD.
        assert full.startswith(text) and full[len(text) :].strip(" \ufffd") == ""
    else:
        assert text == full
    (whole,) = llm.generate(prompt, params, use_tqdm=False)
    assert text == whole.outputs[0].text and tokens == whole.outputs[0].token_ids
    assert any(ord(ch) > 0x2E80 for ch in text), f"expected CJK or emoji in {text!r}"
