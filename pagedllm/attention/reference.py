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
            qi = q[start : start + q_len].float()  # [q_len, H, D]
            ki = gather_context(key_cache, meta.block_tables[i], ctx_len)
            vi = gather_context(value_cache, meta.block_tables[i], ctx_len)
            # Query row r sits at context position ctx_len - q_len + r.
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            k_pos = torch.arange(ctx_len, device=q.device)[None, :]
            hidden = k_pos > q_pos
            if window is not None:
                hidden |= k_pos <= q_pos - window
                # Positions before every query's window may sit in blocks given back to the pool
                # (their table entries read NULL_BLOCK_ID, a block others write): masked scores
                # of a NaN there would still poison the softmax, so they are zeroed.
                unseen = hidden.all(0)[:, None, None]
                ki, vi = ki.masked_fill(unseen, 0), vi.masked_fill(unseen, 0)
            ki = ki.repeat_interleave(group, dim=1)  # [ctx, H, D]
            vi = vi.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, vi).to(q.dtype)
            start += q_len
        return out
