"""``pagedllm bench throughput --data-parallel-size 2`` runs its workload through the replicas."""

from __future__ import annotations

from pagedllm.bench.throughput import run_pagedllm
from pagedllm.bench.workloads import Workload
from pagedllm.config import EngineConfig


def test_throughput_bench_with_two_replicas(tiny_llama_tok):
    w = Workload("tiny", seed=0, num_prompts=6, input_len=20, output_len=5)
    config = EngineConfig(model=str(tiny_llama_tok), data_parallel_size=2, num_kv_blocks=64).to_dict()
    result = run_pagedllm(w, config)
    assert result["engine"] == "pagedllm-dp2"
    assert result["output_tokens_per_s"] > 0
