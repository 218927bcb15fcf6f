"""Which weights a rank holds: heads by KV group (uneven when the groups do not divide), GGUF
blocks cut at block boundaries, per-rank threads and pinning."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedllm.distributed.sharding import HeadShard, check_supported, head_shards, shard_state, split_even
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


def test_phi3_fused_weights_cut_part_by_part(tmp_path):
    """Uneven heads (rank 0: KV heads {0, 1} = query heads 0-3, rank 1: KV head 2 = query heads
    4-5): each rank's qkv_proj is [its q rows; its k rows; its v rows], its gate_up_proj
    [its gate rows; its up rows]."""
    path = save_tiny_model(tmp_path / "phi3", "phi3", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                           intermediate_size=160, pad_token_id=0)  # fmt: skip
    arch, state = load_weights(resolve_model(str(path)))
    qkv, gate_up = state["model.layers.0.self_attn.qkv_proj.weight"], state["model.layers.0.mlp.gate_up_proj.weight"]
    hd, inter = arch.head_dim, arch.intermediate_size
    q, k, v = qkv.split([6 * hd, 3 * hd, 3 * hd])
    gate, up = gate_up.split(inter)
    for rank, (heads, kvs, cut) in enumerate((((0, 4), (0, 2), (0, 80)), ((4, 6), (2, 3), (80, 160)))):
        local, s = shard_state(arch, dict(state), rank, 2, 0, 1)
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (heads[1] - heads[0], kvs[1] - kvs[0], 80)
        h, g, c = slice(heads[0] * hd, heads[1] * hd), slice(kvs[0] * hd, kvs[1] * hd), slice(*cut)
        assert torch.equal(s["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q[h], k[g], v[g]]))
        assert torch.equal(s["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate[c], up[c]]))
        assert torch.equal(s["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"][:, c])


def test_phi3_gguf_fused_rows_stay_blocks(tmp_path):
    """A Q8_0 Phi-3 file: the rank's [q; k; v] and [gate; up] rows are one block tensor again
    (what the fp32 copy and the small-step kernels take), holding the sliced values."""
    from tests.model.test_gguf_archs import write_gguf

    hf_dir = save_tiny_model(tmp_path / "hf", "phi3", seed=5, sliding_window=40, pad_token_id=0)
    (tmp_path / "gguf").mkdir()
    arch, state = load_weights(resolve_model(str(write_gguf(hf_dir, tmp_path / "gguf" / "phi3.gguf", "phi3", "Q8_0"))))
    hd, inter = arch.head_dim, arch.intermediate_size
    q, k, v = dequantize(state["model.layers.1.self_attn.qkv_proj.weight"]).split([4 * hd, 2 * hd, 2 * hd])
    gate, up = dequantize(state["model.layers.1.mlp.gate_up_proj.weight"]).split(inter)
    for rank in range(2):
        _, s = shard_state(arch, dict(state), rank, 2, 0, 1)
        qkv, gate_up = s["model.layers.1.self_attn.qkv_proj.weight"], s["model.layers.1.mlp.gate_up_proj.weight"]
        assert isinstance(qkv, QuantizedWeight) and isinstance(gate_up, QuantizedWeight)
        h, g, c = (slice(r * n // 2, (r + 1) * n // 2) for r, n in ((rank, 4 * hd), (rank, 2 * hd), (rank, inter)))
        assert torch.equal(qkv.dequantize(), torch.cat([q[h], k[g], v[g]]))
        assert torch.equal(gate_up.dequantize(), torch.cat([gate[c], up[c]]))


def test_moe_experts_cut_by_width(tmp_path):
    """Every expert's gate/up rows and down columns of the rank's half of the expert width, the
    router whole; transformers 5's stacked 3-D experts are cut the same way."""
    path = save_tiny_model(tmp_path / "moe", "qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, mlp_only_layers=[1])  # fmt: skip
    arch, state = load_weights(resolve_model(str(path)))
    p = "model.layers.0.mlp."
    stacked = dict(state)
    gate_up = torch.stack([torch.cat([stacked.pop(f"{p}experts.{e}.gate_proj.weight"),
                                      stacked.pop(f"{p}experts.{e}.up_proj.weight")]) for e in range(4)])  # fmt: skip
    stacked[f"{p}experts.gate_up_proj"] = gate_up
    stacked[f"{p}experts.down_proj"] = torch.stack([stacked.pop(f"{p}experts.{e}.down_proj.weight") for e in range(4)])
    for rank, c in enumerate((slice(0, 16), slice(16, 32))):
        local, s = shard_state(arch, dict(state), rank, 2, 0, 1)
        assert (local.moe_intermediate_size, local.intermediate_size) == (16, arch.intermediate_size // 2)
        assert torch.equal(s[f"{p}gate.weight"], state[f"{p}gate.weight"])  # the router is replicated
        for e in range(4):
            for name in ("gate_proj", "up_proj"):
                assert torch.equal(s[f"{p}experts.{e}.{name}.weight"], state[f"{p}experts.{e}.{name}.weight"][c])
            assert torch.equal(s[f"{p}experts.{e}.down_proj.weight"], state[f"{p}experts.{e}.down_proj.weight"][:, c])
        _, t = shard_state(arch, dict(stacked), rank, 2, 0, 1)
        want_gate_up = torch.stack([torch.cat([s[f"{p}experts.{e}.gate_proj.weight"], s[f"{p}experts.{e}.up_proj.weight"]])
                                    for e in range(4)])  # fmt: skip
        assert torch.equal(t[f"{p}experts.gate_up_proj"], want_gate_up)
        assert torch.equal(t[f"{p}experts.down_proj"], torch.stack([s[f"{p}experts.{e}.down_proj.weight"] for e in range(4)]))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 supports the qwen3_moe"):
        check_supported(replace(arch, architecture="llama"), 2, 1)  # experts of another family
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        check_supported(arch, 1, 2)


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
