"""DP=2 gives DP=1's greedy tokens on the parity prompts, with chunked prefill, prefix caching
and preemption on (fp32 is batch-invariant: where a request runs, and with whom, changes
nothing). Two replica processes of the real default model, one core each."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.data_parallel.client import DPAsyncLLM
from pagedllm.engine.stats import StepStats
from tests.parity import parity_prompts

MAX_TOKENS = 16
# A 32-token step budget (chunked prefill) and a pool so small that the ~1,500-token prompt and
# its neighbours preempt each other.
ENGINE = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=100, enable_prefix_caching=True)


class _Preemptions:
    def __init__(self) -> None:
        self.total = 0

    def record(self, stats: StepStats) -> None:
        self.total += stats.num_preemptions


async def _generate_dp(prompts: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
    llm = DPAsyncLLM(EngineConfig(data_parallel_size=2, **ENGINE), log_stats_interval=1e9)
    preemptions = _Preemptions()
    llm.add_stat_logger(preemptions)
    routed = [0, 0]

    async def one(i: int, p: list[int]) -> list[int]:
        tokens: list[int] = []
        stream = await llm.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), f"p{i}")
        for rank, (n, _) in enumerate(llm.replica_loads()):
            routed[rank] = max(routed[rank], n)
        async for out in stream:
            tokens += out.outputs[0].token_ids
        return tokens

    try:
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        assert llm.num_in_flight() == 0 and [n for n, _ in llm.replica_loads()] == [0, 0]
    finally:
        llm.shutdown()
    return list(tokens), routed, preemptions.total


def test_dp2_greedy_tokens_equal_dp1(default_tokenizer):
    prompts = parity_prompts(default_tokenizer)
    dp1 = LLM(log_stats_interval=1e9, **ENGINE)
    ref = dp1.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    ref_tokens = [o.outputs[0].token_ids for o in ref]
    del dp1
    tokens, routed, preemptions = asyncio.run(_generate_dp(prompts))
    for i, (mine, theirs) in enumerate(zip(tokens, ref_tokens)):
        assert mine == theirs, f"prompt {i} ({len(prompts[i])} tokens): DP=2 {mine} != DP=1 {theirs}"
    assert all(n > 0 for n in routed), f"both replicas should get work: {routed}"
    assert preemptions > 0, "the tiny pool should preempt"
