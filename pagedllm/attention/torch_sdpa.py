"""Pure-torch paged attention: gather K/V by block table, then ``scaled_dot_product_attention``.

Decode sequences (one query token each) run as one batched SDPA over their gathered,
padded contexts; GQA is folded into the query axis ([B, kv_heads, group, D]) so K/V are
never repeated. Prefill chunks run one SDPA each with a causal mask offset by the
already-cached prefix. A KV cache of another dtype than the model's (fp16, int8, fp8) is
dequantised block by block as it is gathered, so attention runs in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache_dtype import gather_blocks
from pagedllm.attention.reference import ReferenceAttention

_REFERENCE = ReferenceAttention()


class TorchSDPAAttention(AttentionBackend):
    name = "torch_sdpa"

    def forward(
        self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
        softcap: float | None = None,
    ):
        if softcap is not None:  # SDPA has no score soft-capping: the explicit-math path
            return _REFERENCE.forward(q, k, v, key_cache, value_cache, meta, scale, window, softcap)
        self.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            max_len = max(meta.seq_lens_list[:nd])
            nb = -(-max_len // block_size)
            table = meta.block_tables[:nd, :nb]
            # [nd, nb, bs, Hkv, D] -> [nd, Hkv, nb*bs, D]
            kd = gather_blocks(key_cache, table, q.dtype).flatten(1, 2).transpose(1, 2)
            vd = gather_blocks(value_cache, table, q.dtype).flatten(1, 2).transpose(1, 2)
            pos = torch.arange(nb * block_size, device=q.device)[None, :]
            mask = pos < meta.seq_lens[:nd, None]
            if window is not None:  # the query sits at seq_len - 1
                mask &= pos >= meta.seq_lens[:nd, None] - window
            # Slots past a sequence (the padding to max_len, placeholder blocks, stale K/V of
            # freed blocks) are masked, but a masked score is still q.k: a NaN or inf left there
            # by another request would poison the softmax (NaN - inf is NaN). Zero them.
            hidden = ~mask[:, None, :, None]
            kd, vd = kd.masked_fill(hidden, 0), vd.masked_fill(hidden, 0)
            qd = q[:nd].view(nd, num_kv_heads, group, head_dim).to(kd.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask[:, None, None, :], scale=scale)
            out[:nd] = od.reshape(nd, num_heads, head_dim).to(q.dtype)
        start = nd
        for i in range(nd, meta.num_seqs):
            q_len, ctx_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            nb = -(-ctx_len // block_size)
            blocks = meta.block_tables[i, :nb]
            ki = gather_blocks(key_cache, blocks, q.dtype).flatten(0, 1)[:ctx_len].transpose(0, 1)  # [Hkv, ctx, D]
            vi = gather_blocks(value_cache, blocks, q.dtype).flatten(0, 1)[:ctx_len].transpose(0, 1)
            qi = q[start : start + q_len].transpose(0, 1).to(ki.dtype)  # [H, q_len, D]
            # 4-D inputs: with 3-D ones CPU SDPA falls back to its slow "math" kernel (5x).
            if q_len == ctx_len and window is None:
                oi = F.scaled_dot_product_attention(
                    qi[None], ki[None], vi[None], is_causal=True, scale=scale, enable_gqa=group > 1
                )
            else:
                q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
                k_pos = torch.arange(ctx_len, device=q.device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                    unseen = ~mask.any(0)[None, :, None]  # before every query's window: maybe freed blocks
                    ki, vi = ki.masked_fill(unseen, 0), vi.masked_fill(unseen, 0)
                oi = F.scaled_dot_product_attention(
                    qi[None], ki[None], vi[None], attn_mask=mask, scale=scale, enable_gqa=group > 1
                )
            out[start : start + q_len] = oi[0].transpose(0, 1).to(q.dtype)
            start += q_len
        return out
