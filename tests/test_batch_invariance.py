"""Batch invariance: a request's logprobs are bit-identical whatever shares its steps.

The same prompt, run alone, inside batches of other requests (1 to 64 of them, of mixed
lengths), with its prefill chunked at 16, 64 or 2,048 tokens, and from a cold or a warm prefix
cache, must give the same tokens and exactly the same logprob values (``torch.equal``) - the
sampled token's, the top-20 and every prompt token's. This holds because every kernel sums in
an order that does not depend on the number of rows in the step (kernels/csrc: the small-step
GEMM keeps the dense GEMM's sequential k order; attention runs per token with one key order).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "as his father had taught him. At the top he trimmed the wick, polished the great lens and "
    "looked out over the grey water, where"
)
OTHERS = [
    "Hi",
    "List three colours:",
    "def add(a, b):\n    return",
    "The history of the printing press begins in",
    "Translate to French: the cat sleeps on the warm windowsill while the rain falls outside.",
    " ".join(["A long filler sentence about rivers, mountains and valleys."] * 12),
]
MAX_TOKENS = 12


def _params(sampling: str, prompt_logprobs: bool = True) -> SamplingParams:
    p = 5 if prompt_logprobs else None
    if sampling == "greedy":
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=20, prompt_logprobs=p)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, logprobs=20, prompt_logprobs=p)


def _record(output) -> tuple[list[int], torch.Tensor]:
    """The tokens and every logprob value of one request's output, in a fixed order."""
    values: list[float] = []
    for entry in output.prompt_logprobs or []:
        if entry is not None:
            values += [entry[t].logprob for t in sorted(entry)]
    comp = output.outputs[0]
    for token, entry in zip(comp.token_ids, comp.logprobs):
        values += [entry[token].logprob] + [entry[t].logprob for t in sorted(entry)]
    return list(comp.token_ids), torch.tensor(values, dtype=torch.float32)


def _run(llm: LLM, sampling: str, batch: int, prompt_logprobs: bool = True) -> tuple[list[int], torch.Tensor]:
    """The target prompt with `batch` - 1 other requests (mixed lengths and max_tokens) around it."""
    tokens, values, _ = _run_counting_hits(llm, sampling, batch, prompt_logprobs)
    return tokens, values


def _run_counting_hits(llm: LLM, sampling: str, batch: int, prompt_logprobs: bool) -> tuple[list[int], torch.Tensor, int]:
    """``_run``, and how many of the target's prompt tokens came from the prefix cache."""
    others = [OTHERS[i % len(OTHERS)] + f" ({i})" for i in range(batch - 1)]
    prompts = others[: len(others) // 2] + [PROMPT] + others[len(others) // 2 :]
    params = [SamplingParams(max_tokens=1 + (i * 7) % 20, temperature=0.0) for i in range(len(prompts))]
    target = len(others) // 2
    params[target] = _params(sampling, prompt_logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return (*_record(outs[target]), outs[target].num_cached_tokens)


@pytest.fixture(scope="module")
def engines():
    made: dict[tuple, LLM] = {}

    def get(chunk: int, prefix_caching: bool = False) -> LLM:
        key = (chunk, prefix_caching)
        if key not in made:
            made[key] = LLM(max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching, max_num_seqs=64)
        return made[key]

    return get


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_logprobs_do_not_depend_on_the_batch_chunking_or_cache(engines, sampling):
    base_tokens, base = _run(engines(2048), sampling, batch=1)
    assert len(base_tokens) == MAX_TOKENS and base.numel() > MAX_TOKENS * 20
    cases = {f"batch of {b}": (engines(2048), b) for b in (2, 5, 17, 64)}
    cases.update({f"chunked at {c}": (engines(c), 9) for c in (16, 64)})
    for name, (llm, b) in cases.items():
        tokens, values = _run(llm, sampling, batch=b)
        assert tokens == base_tokens, name
        assert torch.equal(values, base), f"{name}: max difference {(values - base).abs().max().item():.3g}"
    _check_cold_and_warm_cache(engines(2048), engines(64, prefix_caching=True), sampling)


def _check_cold_and_warm_cache(plain: LLM, cached: LLM, sampling: str) -> None:
    """Without prompt logprobs (a request asking for them computes every prompt position, so
    it never reads the cache): cold, then warm, against the plain engine alone."""
    base_tokens, base, _ = _run_counting_hits(plain, sampling, 1, prompt_logprobs=False)
    cached.reset_prefix_cache()
    for run in ("cold cache", "warm cache"):
        tokens, values, hits = _run_counting_hits(cached, sampling, 3, prompt_logprobs=False)
        assert (hits > 0) == (run == "warm cache"), f"{run}: {hits} prompt tokens from the cache"
        assert tokens == base_tokens, run
        assert torch.equal(values, base), f"{run}: max difference {(values - base).abs().max().item():.3g}"


def test_the_fast_mode_is_batch_invariant_too():
    """``activation_dtype="int8"`` with an fp16 cache: each row's activations are quantized on
    their own scales and its K/V rounded alone, so the property holds in the fast mode as well
    (its kernels run through the same one-call stack)."""
    kw = dict(max_num_seqs=64, activation_dtype="int8", kv_cache_dtype="float16")
    whole = LLM(max_num_batched_tokens=2048, enable_prefix_caching=False, **kw)
    chunked = LLM(max_num_batched_tokens=16, enable_prefix_caching=False, **kw)
    base_tokens, base = _run(whole, "greedy", batch=1)
    assert len(base_tokens) == MAX_TOKENS and base.numel() > MAX_TOKENS * 20
    for name, (llm, b) in {"batch of 17": (whole, 17), "chunked at 16": (chunked, 9)}.items():
        tokens, values = _run(llm, "greedy", batch=b)
        assert tokens == base_tokens, name
        assert torch.equal(values, base), f"{name}: max difference {(values - base).abs().max().item():.3g}"
    del chunked
    _check_cold_and_warm_cache(whole, LLM(max_num_batched_tokens=64, enable_prefix_caching=True, **kw), "greedy")
