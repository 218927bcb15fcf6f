"""The engine with each KV cache dtype: preemption by swap or recompute gives the same tokens
(a quantised block travels with its scales), and the default model still answers."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(20 + 5 * i)]} for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def one_thread():
    """Hundreds of tiny steps: on a busy 2-core machine each waits for a second thread's turn."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _generate(model, **kw) -> tuple[list[list[int]], int]:
    llm = LLM(str(model), dtype="float32", max_model_len=256, log_stats_interval=1e9, **kw)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.num_preemptions_total


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "float16"])
def test_preempted_requests_give_the_same_tokens(tiny_llama, kv_cache_dtype, tmp_path, one_thread):
    want, none = _generate(tiny_llama, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
    assert none == 0
    small = dict(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=6, max_num_batched_tokens=64, enable_prefix_caching=False)
    swapped, n_swap = _generate(tiny_llama, preemption_mode="swap", swap_space=0.01, swap_path=str(tmp_path / "swap"), **small)
    recomputed, n_rec = _generate(tiny_llama, **small)
    assert n_swap > 0 and n_rec > 0
    assert swapped == want and recomputed == want


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(num_kv_blocks=64, max_model_len=1024, log_stats_interval=1e9)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "float16", "int8", "fp8_e4m3"])
def test_the_default_model_answers_with_every_kv_dtype(default_llm, kv_cache_dtype):
    """One model load (the slow part): each dtype gets a fresh runner (and KV pools) around it."""
    from pagedllm.model import fused_stack
    from pagedllm.runner.model_runner import ModelRunner

    engine = default_llm.llm_engine
    old = engine.runner
    engine.runner = ModelRunner(old.model, num_blocks=64, block_size=16, max_num_seqs=engine.config.max_num_seqs,
                                max_model_len=1024, dtype=engine.config.torch_dtype, attention_backend="auto", seed=0,
                                kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    default_llm.reset_prefix_cache()  # the old pools' cached blocks mean nothing in the new ones
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = default_llm.chat(chat, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    runner = engine.runner
    reason = fused_stack.why_not(runner.model, runner.kv_caches)
    if kv_cache_dtype in ("auto", "bfloat16", "float16"):
        assert reason is None  # fp32 / 16-bit caches: the one-call stack still runs
    else:
        assert reason is not None and "KV cache" in reason
