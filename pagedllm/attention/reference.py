"""Slow, obviously correct paged attention: one sequence at a time, explicit softmax in fp32."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache_dtype import KVPool, gather_blocks, pool_slots


def gather_context(cache: KVPool, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence in fp32: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=block_table.device)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    return gather_blocks(pool_slots(cache), slots, torch.float32)


class ReferenceAttention(AttentionBackend):
    name = "reference"

    def forward(
        self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
        softcap: float | None = None,
    ):
        self.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = q.shape[1] // key_cache.shape[2]
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            ki = gather_context(key_cache, meta.block_tables[i], ctx_len).repeat_interleave(group, dim=1)  # [ctx, H, D]
            vi = gather_context(value_cache, meta.block_tables[i], ctx_len).repeat_interleave(group, dim=1)
            # One query row at a time over exactly the keys it sees (row r sits at context
            # position ctx_len - q_len + r): its sums then have the same shape however many rows
            # the step holds, so chunking, cache hits and drafts leave its bits alone (the
            # soft-capped models run this path: docs/determinism.md).
            for r in range(q_len):
                pos = ctx_len - q_len + r
                lo = 0 if window is None else max(0, pos - window + 1)
                scores = torch.einsum("hd,khd->hk", q[start + r].float(), ki[lo : pos + 1]) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                probs = torch.softmax(scores, dim=-1)
                out[start + r] = torch.einsum("hk,khd->hd", probs, vi[lo : pos + 1]).to(q.dtype)
            start += q_len
        return out
