"""``LLM(data_parallel_size=2)``: the offline API over two replica processes gives one engine's
outputs, in input order, and validates every prompt before queueing any."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


def test_offline_dp2_equals_one_engine(tiny_llama_tok):
    prompts = [{"prompt_token_ids": [10 + i] * (5 + 7 * i)} for i in range(6)] + ["The capital of France is"]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 6 + [SamplingParams(temperature=0, max_tokens=4, n=2, logprobs=2)]
    one = LLM(str(tiny_llama_tok), num_kv_blocks=64, log_stats_interval=1e9)
    ref = one.generate(prompts, params, use_tqdm=False)
    dp = LLM(str(tiny_llama_tok), num_kv_blocks=64, log_stats_interval=1e9, data_parallel_size=2)
    try:
        assert dp.get_tokenizer() is not None
        outs = dp.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
        assert outs[-1].outputs[0].text == ref[-1].outputs[0].text and outs[-1].outputs[0].logprobs
        # Replicas leave the prompt out of their outputs; the API process puts it back.
        assert [(o.prompt, o.prompt_token_ids) for o in outs] == [(o.prompt, o.prompt_token_ids) for o in ref]
        with pytest.raises(ValueError, match="max_tokens"):
            dp.generate(["ok", "bad"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=10**9)])
        assert dp.data_parallel.num_in_flight() == 0
        dp.reset_prefix_cache()
        with pytest.raises(ValueError, match="beam_search"):
            from pagedllm.engine.beam_search import BeamSearchParams

            dp.beam_search(["x"], BeamSearchParams(beam_width=2, max_tokens=2))
    finally:
        dp.shutdown()
