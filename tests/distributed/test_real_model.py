"""TP=2 and PP=2 on the real default model (SmolLM2-135M-Instruct, GGUF Q4_1: 9 query heads in
3 KV groups, split 6 + 3 at TP=2) give the one-process engine's greedy tokens, under chunked
prefill (64-token steps), prefix caching (a shared prefix) and preemption (a tiny KV pool).

All-reduce changes the summation order of o_proj / down_proj, so a token may flip on a near
tie: then both tokens must be in each other's top 5 within 0.1 nats (tests/parity.py)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.parity import assert_engines_agree

pytestmark = pytest.mark.slow  # the real default model (the repo's meaning of slow); ~20 s in all

MAX_TOKENS = 20
# 14 blocks of 16 tokens for 4 requests of up to ~150 tokens: some are preempted and recomputed.
ENGINE = dict(max_num_batched_tokens=64, num_kv_blocks=14, enable_prefix_caching=True, log_stats_interval=1e9)


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    tok = default_tokenizer
    shared = ("The committee postponed its decision until the engineers had finished the survey. " * 6).strip()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=True,
                                   add_generation_prompt=True, return_dict=False)  # fmt: skip
    return [
        tok.encode("The capital of France is"),
        chat,
        tok.encode(shared + "\nQuestion: what did the committee do?\nAnswer:"),
        tok.encode(shared + "\nSummary:"),  # shares its first blocks with the previous prompt
    ]


def _run(prompts, **kwargs):
    llm = LLM(**ENGINE, **kwargs)
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
        engine = llm.llm_engine
        return outs, engine.num_preemptions_total, engine.executor.worker_reports
    finally:
        llm.llm_engine.close()


@pytest.fixture(scope="module")
def reference(prompts):
    outs, preemptions, _ = _run(prompts)
    assert preemptions > 0  # the pool is small enough to preempt
    return outs


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_greedy_tokens_equal_one_process(prompts, reference, tp, pp):
    outs, preemptions, reports = _run(prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert preemptions > 0
    exact = [assert_engines_agree(f"prompt {i} tp={tp} pp={pp}", mine, ref) for i, (mine, ref) in
             enumerate(zip(outs, reference))]  # fmt: skip
    assert sum(exact) >= len(exact) - 1  # at most one near-tie flip
    if tp == 2:
        heads = [(r["num_heads"], r["num_kv_heads"]) for r in reports]
        assert heads == [(6, 2), (3, 1)]
    else:
        assert [r["num_layers"] for r in reports] == [15, 15]
