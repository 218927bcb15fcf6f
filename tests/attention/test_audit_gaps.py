"""Gaps a mutation audit of the attention backends found (each test names what it pins down)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.attention.test_backends import WINDOW_SHAPES, get_attention_backend, make_batch
from tests.attention.test_kv_cache_dtype import _clone, _store, one_thread  # noqa: F401 (autouse fixture)
from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype


@pytest.mark.parametrize("backend", ["torch_sdpa", "reference"])
def test_windowed_prefill_chunk_never_reads_nan_left_before_its_window(backend):
    """A prefill chunk after a cached prefix gathers its whole context, but the blocks wholly
    before its first query's window may be freed and reused, holding NaN: masking them is not
    enough (a masked score is still q.k), they must be zeroed. test_sliding_window_skips_the_
    blocks_before_it hands the torch backends only finite garbage there."""
    block_size, window = 12, 5
    shapes = [s for s in WINDOW_SHAPES if s[1] > 1]  # prefill chunks only: (40, 40), (70, 7), (97, 33)
    q, k, v, kc, vc, meta, _ = make_batch(3, block_size, 6, 2, torch.float32, 32, shapes)
    scale = 1 / math.sqrt(32)
    want = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale, window)
    poisoned = 0
    for s, (ctx, q_len) in enumerate(shapes):
        for j in range(max(0, ctx - q_len - window + 1) // block_size):
            b = int(meta.block_tables[s, j])
            kc[b], vc[b] = float("nan"), float("nan")
            poisoned += 1
    assert poisoned > 0
    got = get_attention_backend(backend).forward(q, k, v, kc, vc, meta, scale, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["cpu_native", "torch_sdpa"])
def test_a_bf16_model_gets_bf16_attention_from_every_kv_dtype(kv_dtype, backend):
    """The kernels over fp16 / int8 / fp8 caches compute in fp32; the backend hands the model
    its own dtype back (the next projection's weights are bf16)."""
    spec = resolve_kv_cache_dtype(kv_dtype, torch.bfloat16)
    q, k, v, kc, vc, meta, _ = make_batch(2, 16, 9, 3, torch.bfloat16, 64)
    kp, vp = _store(spec, kc.float()), _store(spec, vc.float())
    scale = 1 / math.sqrt(64)
    ref = get_attention_backend("reference").forward(q.float(), k.float(), v.float(), _clone(kp), _clone(vp), meta, scale)
    out = get_attention_backend(backend, torch.bfloat16).forward(q, k, v, _clone(kp), _clone(vp), meta, scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
