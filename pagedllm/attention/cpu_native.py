"""Paged attention with the native CPU kernel: K/V are read in place from the blocks.

The pure-torch backends first gather every sequence's context into a contiguous copy (at
64 sequences that copy was a quarter of a decode step); the kernel walks the block table
instead. fp32 or bf16 caches on CPU (computing in fp32 either way):
``get_attention_backend("auto")`` picks it when it can run. Sliding-window layers read only
their window's blocks (the ones before it may already be freed, see kv_cache/groups.py).
"""

from __future__ import annotations

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.kernels import ops

_REFERENCE = ReferenceAttention()


class NativeCPUAttention(AttentionBackend):
    name = "cpu_native"
    fused_decoder_stack = True

    def forward(
        self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
        softcap: float | None = None,
    ):
        if softcap is not None:  # the kernel has no score soft-capping: the explicit-math path
            return _REFERENCE.forward(q, k, v, key_cache, value_cache, meta, scale, window, softcap)
        ops.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = ops.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window,
            meta.backend_cache,
        )
        return out.to(q.dtype)
