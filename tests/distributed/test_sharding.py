"""Which weights a rank holds: heads by KV group (uneven when the groups do not divide), GGUF
blocks cut at block boundaries, per-rank threads and pinning."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.sharding import HeadShard, head_shards, shard_state, split_even
from pagedllm.executor.multiproc import rank_threads
from pagedllm.model.loader import load_weights, resolve_model
from pagedllm.quantization.weights import QuantizedWeight, dequantize
from tests.conftest import save_tiny_model


def test_head_split_follows_kv_groups():
    # SmolLM2-135M: 9 query heads, 3 KV heads (groups of 3).
    assert head_shards(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 9, 2, 3)]
    assert head_shards(9, 3, 3) == [HeadShard(0, 3, 0, 1), HeadShard(3, 6, 1, 2), HeadShard(6, 9, 2, 3)]
    # Fewer KV heads than ranks: each KV head replicated, its query heads split.
    assert head_shards(4, 1, 2) == [HeadShard(0, 2, 0, 1), HeadShard(2, 4, 0, 1)]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        head_shards(9, 3, 4)
    assert split_even(1536, 2, 32) == [(0, 768), (768, 1536)]


def test_dense_shards_are_slices(tmp_path):
    path = save_tiny_model(tmp_path / "gqa", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                           intermediate_size=160)  # fmt: skip
    arch, state = load_weights(resolve_model(str(path)))
    local0, s0 = shard_state(arch, dict(state), 0, 2, 0, 1)
    local1, s1 = shard_state(arch, dict(state), 1, 2, 0, 1)
    assert (local0.num_heads, local0.num_kv_heads, local1.num_heads, local1.num_kv_heads) == (4, 2, 2, 1)
    assert local0.intermediate_size + local1.intermediate_size == arch.intermediate_size
    assert local0.vocab_size + local1.vocab_size == arch.vocab_size
    for name, dim in (("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        key = f"model.layers.0.{name}.weight"
        assert torch.equal(torch.cat([s0[key], s1[key]], dim=dim), state[key]), name
    # Pipeline stage 1 of 2: the second layer, renumbered from 0.
    stage, s = shard_state(arch, dict(state), 0, 1, 1, 2)
    assert stage.num_layers == 1 and torch.equal(s["model.layers.0.mlp.down_proj.weight"], state["model.layers.1.mlp.down_proj.weight"])


def test_gguf_row_parallel_cuts_whole_blocks():
    """SmolLM2's Q4_1 o_proj (576 inputs) is cut at 384 = 12 blocks, down_proj (1536) at 768:
    each rank keeps its blocks, not a dequantized copy, and they hold the same values."""
    arch, state = load_weights(resolve_model(None))
    shards = [shard_state(arch, dict(state), r, 2, 0, 1)[1] for r in range(2)]
    for name, cut in (("self_attn.o_proj", 384), ("mlp.down_proj", 768)):
        key = f"model.layers.3.{name}.weight"
        full = dequantize(state[key])
        parts = [s[key] for s in shards]
        assert all(isinstance(p, QuantizedWeight) for p in parts), name
        assert [p.in_features for p in parts] == [cut, full.shape[1] - cut]
        assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=1), full), name
    q = "model.layers.3.self_attn.q_proj.weight"
    assert [s[q].out_features for s in shards] == [6 * 64, 3 * 64]


def test_rank_threads_share_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("PAGEDLLM_NUM_THREADS", raising=False)
    monkeypatch.delenv("PAGEDLLM_PIN_THREADS", raising=False)
    assert rank_threads(2, 1) == (2, None)
    monkeypatch.setenv("PAGEDLLM_PIN_THREADS", "1")
    assert rank_threads(2, 0) == (2, [0, 1]) and rank_threads(2, 1) == (2, [2, 3])
    monkeypatch.setenv("PAGEDLLM_NUM_THREADS", "1")  # per rank
    assert rank_threads(4, 3) == (1, [3])


def test_fused_decoder_stack_refuses_tensor_parallel():
    from types import SimpleNamespace

    from pagedllm.model.fused_stack import why_not

    assert "tensor parallel" in why_not(SimpleNamespace(tp_size=2, arch=None), [])
