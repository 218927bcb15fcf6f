"""Soft-capped attention (Gemma 2) keeps batch invariance: a request's logprobs are the same bits
whether its prefill runs whole or in chunks, from a cold or a warm prefix cache, and under
speculative verification (docs/determinism.md).

Soft-capping sends attention to the reference path. It used to compute each sequence's step as
one [query rows x context] product, whose sums depended on how many query rows the step held;
an adversarial review measured 1.4e-6 between chunked and whole prefill on this model.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    # (seed 5: a model whose greedy text repeats, so prompt lookup's drafts get accepted)
    return save_tiny_model(tmp_path_factory.mktemp("gemma2") / "m", "gemma2", seed=5, sliding_window=8, head_dim=16,
                           query_pre_attn_scalar=16)  # fmt: skip


PROMPT = {"prompt_token_ids": torch.randint(3, 250, (37,), generator=torch.Generator().manual_seed(0)).tolist()}


def _values(out) -> tuple[list[int], torch.Tensor]:
    v = [e[t].logprob for e in out.prompt_logprobs or [] if e for t in sorted(e)]
    v += [e[t].logprob for e in out.outputs[0].logprobs for t in sorted(e)]
    return list(out.outputs[0].token_ids), torch.tensor(v)


def _run(path, params: SamplingParams, runs: int = 1, **kw) -> list[tuple[list[int], torch.Tensor, int]]:
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, log_stats_interval=1e9, **kw)
    assert llm.llm_engine.arch.attn_logit_softcapping  # the soft-capped path runs
    outs = [llm.generate([PROMPT], params, use_tqdm=False)[0] for _ in range(runs)]
    if "speculative_config" in kw:  # drafts were verified (and some accepted)
        assert llm.llm_engine.stats.spec_total.num_accepted_tokens > 0
    return [(*_values(o), o.num_cached_tokens) for o in outs]


def test_soft_capped_logprobs_do_not_depend_on_chunking_cache_hits_or_drafts(gemma2):
    with_prompt = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    plain = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)
    ((tokens, whole, _),) = _run(gemma2, with_prompt, enable_prefix_caching=False)
    ((c_tokens, chunked, _),) = _run(gemma2, with_prompt, enable_prefix_caching=False, max_num_batched_tokens=8)
    assert c_tokens == tokens and torch.equal(chunked, whole), (chunked - whole).abs().max()
    ((tokens, base, _),) = _run(gemma2, plain, enable_prefix_caching=False)
    (_, cold, cold_hits), (w_tokens, warm, warm_hits) = _run(gemma2, plain, runs=2)
    assert cold_hits == 0 and warm_hits >= 32
    assert torch.equal(cold, base) and w_tokens == tokens and torch.equal(warm, base), (warm - base).abs().max()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "auto_length": False}
    ((s_tokens, drafted, _),) = _run(gemma2, plain, enable_prefix_caching=False, speculative_config=spec)
    assert s_tokens == tokens and torch.equal(drafted, base), (drafted - base).abs().max()
