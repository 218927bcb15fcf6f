"""A tiny random Gemma 3 (5 sliding layers of window 24, 1 global) generating well past its window
in a pool too small to hold one request without freeing: the sliding groups give their blocks
back as the requests run, requests get preempted and hit the prefix cache, and every token
still matches transformers (full recompute, greedy)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.conftest import save_tiny_model
from tests.parity import assert_greedy_parity, oracle_generate

MAX_NEW = 48
# 6 groups of 1 layer: an 88-token request would need 6 x 6 = 36 blocks without freeing; with it,
# in 16-token chunks, at most 6 (full) + 5 x 4 (sliding).
POOL = 30


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    import transformers

    path = save_tiny_model(tmp_path_factory.mktemp("gemma") / "g", "gemma3_text", seed=1, head_dim=16,
                           num_hidden_layers=6, sliding_window=24, query_pre_attn_scalar=24,
                           tie_word_embeddings=True, max_position_embeddings=512)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 20, 9)]
    return path, prompts, [oracle_generate(hf, p, MAX_NEW) for p in prompts]


def test_tiny_gemma3_frees_behind_the_window_and_matches_transformers(tiny_gemma):
    path, prompts, expected = tiny_gemma
    llm = LLM(str(path), dtype="float32", num_kv_blocks=POOL, max_num_batched_tokens=16, log_stats_interval=1e9)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert kv.windows == (None,) + (24,) * 5
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for run in ("cold", "warm"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (out, want) in enumerate(zip(outs, expected)):
            assert assert_greedy_parity(f"{run} prompt {i}", out.outputs[0].token_ids, want)  # exact
        kv.check_integrity()
    assert kv.num_skipped_total > 0  # blocks behind the window went back while requests ran
    assert engine.num_preemptions_total > 0
    # Recomputed requests adopted their own blocks back (the windows' blocks freed last).
    assert kv.num_cached_hits_total > 0
    assert kv.num_free_blocks == POOL
