"""Paged attention with the native CPU kernel: K/V are read in place from the blocks.

The pure-torch backends first gather every sequence's context into a contiguous copy (at
64 sequences that copy was a quarter of a decode step); the kernel walks the block table
instead. Any KV cache dtype on CPU, computing in fp32: fp32 and bf16 caches through
``ops.paged_attention``; fp16, int8 and fp8 e4m3 caches (``--kv-cache-dtype``) through
``kv_ops.paged_attention_kv``. Both take sliding windows and read only the window's blocks (the
ones before it may already be freed, see kv_cache/groups.py). Soft-capped scores (Gemma 2) take
the reference backend's explicit math. ``get_attention_backend("auto")`` picks this backend
when it can run.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache_dtype import QuantizedKV, write_kv
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.kernels import kv_ops, ops

_REFERENCE = ReferenceAttention()
_FULL_WIDTH = (torch.float32, torch.bfloat16)  # the caches ops.paged_attention reads


class NativeCPUAttention(AttentionBackend):
    name = "cpu_native"
    fused_decoder_stack = True

    @staticmethod
    def write_kv(k, v, key_cache, value_cache, slot_mapping) -> None:
        write_kv(k, v, key_cache, value_cache, slot_mapping, native=True)

    def forward(
        self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
        softcap: float | None = None,
    ):
        if softcap is not None:  # the kernels have no score soft-capping: the explicit-math path
            return _REFERENCE.forward(q, k, v, key_cache, value_cache, meta, scale, window, softcap)
        if isinstance(key_cache, QuantizedKV) or key_cache.dtype not in _FULL_WIDTH:
            self.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
            quantized = isinstance(key_cache, QuantizedKV)
            out = kv_ops.paged_attention_kv(
                q, key_cache.data if quantized else key_cache, value_cache.data if quantized else value_cache,
                key_cache.scale if quantized else None, value_cache.scale if quantized else None,
                meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window, meta.backend_cache,
            )  # fmt: skip
            return out.to(q.dtype)
        ops.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = ops.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window,
            meta.backend_cache,
        )
        return out.to(q.dtype)
