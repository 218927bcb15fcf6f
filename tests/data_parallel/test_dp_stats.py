"""Step stats from several replicas: LoRA request counts are summed over the replicas' latest."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.data_parallel.client import DPAsyncLLM
from pagedllm.engine.stats import StepStats


def _stats(lora=None) -> StepStats:
    return StepStats(1, 1, 1, 0, 0.1, 0, lora=lora)


def test_lora_counts_are_summed_over_replicas():
    fake = SimpleNamespace(_lora_counts={})
    merge = DPAsyncLLM._merge_lora
    assert merge(fake, 0, _stats()).lora is None
    assert merge(fake, 0, _stats(({"a": 2}, {}))).lora == ({"a": 2}, {})
    assert merge(fake, 1, _stats(({"a": 1, "b": 1}, {"b": 3}))).lora == ({"a": 3, "b": 1}, {"b": 3})
    assert merge(fake, 0, _stats(({}, {}))).lora == ({"a": 1, "b": 1}, {"b": 3})  # replica 0 is idle now
