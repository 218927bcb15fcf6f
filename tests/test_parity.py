"""Greedy parity with transformers on the real default model (SmolLM2-135M-Instruct GGUF), fp32.

Ten diverse prompts (raw and chat-formatted, 1 to ~1,500 tokens) in ONE ``generate`` call
must give exactly transformers' tokens (batch 1, no padding) - also with few sequences per
step, bigger blocks, a 32-token step budget (chunked prefill) with a KV pool so small that
requests get preempted and recomputed, prefix caching off, and a second, warm-cache run; two
of these with speculative decoding (n-gram drafts) on.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import ops
from pagedllm.model.loader import default_model_path
from tests.parity import assert_engines_agree, assert_greedy_parity, oracle_generate, parity_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def default_tokenizer():
    from pagedllm.model.loader import resolve_model
    from pagedllm.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return parity_prompts(default_tokenizer)


@pytest.fixture(scope="module")
def oracle(prompts, hf_default_model):
    return [oracle_generate(hf_default_model, p, MAX_TOKENS) for p in prompts]


CONFIGS = {
    "default+warm-rerun": dict(),  # prefix caching and chunked prefill are on by default
    # Speculative decoding (n-gram drafts, verified in the same batch) changes speed, never tokens.
    "max_num_seqs=3+ngram-spec": dict(max_num_seqs=3, speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
    # The model as its own draft (method draft_model): every draft is accepted, tokens unchanged.
    # auto_length off in these two: draft every step (drafting the model itself never pays).
    "max_num_seqs=4+self-draft-spec": dict(
        max_num_seqs=4, speculative_config={"model": str(default_model_path()), "auto_length": False}
    ),
    # The shipped EAGLE head drafting (its own paged KV cache) in a tiny pool that preempts.
    "tiny-pool-preemption-chunk64+eagle-spec": dict(
        num_kv_blocks=130,
        max_num_batched_tokens=64,
        speculative_config={"method": "eagle", "disable_by_batch_size": 16, "auto_length": False},
    ),
    "block_size=32": dict(block_size=32),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "tiny-pool-preemption-chunk32+ngram-spec": dict(
        num_kv_blocks=130, max_num_batched_tokens=32, speculative_config={"method": "ngram", "disable_by_batch_size": 16}
    ),
    "tiny-pool-preemption-swap": dict(
        num_kv_blocks=130, max_num_batched_tokens=512, preemption_mode="swap", swap_space=0.5, enable_prefix_caching=False
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_parity_with_transformers(config, prompts, oracle):
    kwargs = dict(dtype="float32", num_kv_blocks=1024, log_stats_interval=1e9) | CONFIGS[config]
    llm = LLM(**kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    exact = [
        assert_greedy_parity(f"{config} prompt {i} ({len(p)} tokens)", o.outputs[0].token_ids, ref)
        for i, (p, o, ref) in enumerate(zip(prompts, outs, oracle))
    ]
    print(f"{config}: {sum(exact)}/{len(exact)} prompts exact")
    # Measured on AMD EPYC (AVX2): 10/10 exact in every config. One reported near-tie flip is
    # tolerated for CPUs whose kernels sum in another order; ten would not pass.
    assert sum(exact) >= len(exact) - 1, f"{config}: only {sum(exact)}/{len(exact)} prompts exact"
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
    if config.startswith("tiny-pool-preemption"):
        assert llm.llm_engine.num_preemptions_total > 0
        assert any(o.num_preemptions > 0 for o in outs)
    if "spec" in config:
        assert llm.llm_engine.stats.spec_total.num_accepted_tokens > 0
    if "self-draft" in config:
        spec = llm.llm_engine.stats.spec_total
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    if config.endswith("swap"):
        assert kv.num_swap_outs > 0
    if config == "default+warm-rerun":
        warm = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
        )
        assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in outs]
        assert sum(o.num_cached_tokens for o in warm) >= 0.9 * sum(len(p) for p in prompts) - 16 * len(prompts)


def test_bf16_fast_path_gives_the_pure_torch_bf16_tokens(prompts, monkeypatch):
    """bf16: the kernels and the fp32 matmuls on bf16 values change speed, not answers.

    Oracle: our own pure-torch bf16 path (torch's bf16 matmuls, the reference attention).
    """
    # The pure-torch bf16 oracle is slow on CPUs without bf16 arithmetic (the suite's slowest
    # test at 141 s with every prompt): the ~1,500-token prompt, whose prefill dominates, is left
    # to the fp32 parity tests.
    prompts = [p for p in prompts if len(p) <= 512]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    runs = {}
    for name, matmul in (("fast", "fp32"), ("pure-torch", "bf16")):
        monkeypatch.setenv("PAGEDLLM_BF16_MATMUL", matmul)
        ctx = ops.torch_only() if name == "pure-torch" else contextlib.nullcontext()
        with ctx:
            backend = "reference" if name == "pure-torch" else "auto"
            llm = LLM(dtype="bfloat16", num_kv_blocks=1024, attention_backend=backend, log_stats_interval=1e9)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[name] = [o.outputs[0] for o in outs]
    exact = [
        assert_engines_agree(f"bf16 prompt {i}", a, b, tie_tol=0.25)
        for i, (a, b) in enumerate(zip(runs["fast"], runs["pure-torch"]))
    ]
    # Measured on AMD EPYC (2026-11-23, kernels without -ffast-math): 7/10 exact with every
    # prompt, 7/9 without the longest; the flips are ties of at most 0.16 nats. bf16 holds 8 significant bits: a logit near 20 moves
    # in steps of 0.125, and one rounding flip of an activation diverges the rest.
    print(f"bf16: {sum(exact)}/{len(exact)} prompts exact")
    assert sum(exact) >= 0.6 * len(exact), f"only {sum(exact)}/{len(exact)} prompts exact"
