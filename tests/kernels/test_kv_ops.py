"""Reduced-precision KV caches: the quantising write path and the native attention over fp16 /
int8 / fp8 caches, against their torch twins (also in the portable -march=x86-64 build)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels import kv_ops
from pagedllm.kernels.build import load_kernels
from tests.attention.test_backends import make_batch

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
NATIVE_DTYPES = [torch.float16, *QUANTIZED]


@pytest.fixture
def one_thread():
    """Many small torch ops (the twins): with two threads on a busy 2-core machine each op
    waits for the other thread's turn (20x slower). The kernels then run one thread too; the
    tests without this fixture keep the thread team."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pools(kc: torch.Tensor, vc: torch.Tensor, dtype: torch.dtype):
    """(key values, value values, key scales, value scales) of fp32 caches stored as ``dtype``."""
    if dtype == torch.float16:
        return kc.half(), vc.half(), None, None
    kd, ks = kv_ops.quantize(kc, dtype)
    vd, vs = kv_ops.quantize(vc, dtype)
    return kd, vd, ks, vs


def test_int8_round_trip_error_is_at_most_half_a_step():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    data, scale = kv_ops.quantize(x, torch.int8)
    assert data.dtype == torch.int8 and scale.shape == (50, 3)
    assert data.abs().amax(-1).eq(127).all()  # every row uses the full range
    err = (kv_ops.dequantize(data, scale) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-6)).all()


def test_fp8_round_trip_error_is_within_e4m3_rounding():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    data, scale = kv_ops.quantize(x, torch.float8_e4m3fn)
    y = kv_ops.dequantize(data, scale)
    # 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 (subnormals) steps are 2^-9.
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all()
    assert (y.abs().amax(-1) == x.abs().amax(-1)).all() or torch.allclose(y.abs().amax(-1), x.abs().amax(-1))


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_zero_row_stores_zeros_with_a_zero_scale(dtype):
    data, scale = kv_ops.quantize(torch.zeros(2, 1, 8), dtype)
    assert scale.eq(0).all() and data.float().eq(0).all()
    assert kv_ops.dequantize(data, scale).eq(0).all()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_native_write_gives_the_twins_bytes(dtype):
    """Strided K/V rows (views into a fused qkv row, as the model passes them), scattered slots,
    a zero row, and values at e4m3 / int8 rounding ties."""
    g = torch.Generator().manual_seed(0)
    T, Hkv, D = 7, 3, 64
    qkv = torch.randn(T, 9 * D + 2 * Hkv * D, generator=g) * 3
    k = qkv[:, 9 * D : 9 * D + Hkv * D].view(T, Hkv, D)
    v = qkv[:, 9 * D + Hkv * D :].view(T, Hkv, D)
    k[0, 1] = 0.0
    # Row with absmax 448 (fp8 scale exactly 1) holding e4m3 midpoints: ties go to even.
    ties = torch.tensor([448.0, 1.0625, 1.1875, 3 * 2**-10, 5 * 2**-10, -1.0625, 0.5 * 2**-9, 17.0])
    k[1, 0] = ties.repeat(D // len(ties))
    v[2, 2] = torch.arange(D) - 31.5  # int8: absmax 32.5 over 127 levels, with many .5 ties after division
    slots = torch.tensor([5, 0, 33, 17, 2, 40, 9])
    pools = [torch.zeros(6, 8, Hkv, D, dtype=dtype) for _ in range(4)]
    scales = [torch.zeros(6, 8, Hkv) for _ in range(4)]
    kv_ops.write_kv_quantized_reference(k, v, pools[0], pools[1], scales[0], scales[1], slots)
    kv_ops.write_kv_quantized(k, v, pools[2], pools[3], scales[2], scales[3], slots)
    assert load_kernels() is not None
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(pools[a].view(torch.uint8), pools[b].view(torch.uint8))
        assert torch.equal(scales[a], scales[b])
    want, _ = kv_ops.quantize(k, dtype)
    assert torch.equal(pools[0].view(torch.uint8).flatten(0, 1)[slots], want.view(torch.uint8))


def _check_native_against_twin(dtype, block_size, heads, head_dim, window, seed=0, atol=2e-5):
    num_heads, num_kv_heads = heads
    q, _, _, kc, vc, meta, _ = make_batch(seed, block_size, num_heads, num_kv_heads, torch.float32, head_dim)
    kd, vd, ks, vs = _pools(kc, vc, dtype)
    scale = 1 / math.sqrt(head_dim)
    args = (q, kd, vd, ks, vs, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window)
    native = kv_ops.paged_attention_kv(*args)
    twin = kv_ops.paged_attention_kv_reference(*args)
    torch.testing.assert_close(native, twin, atol=atol, rtol=1e-4)


# head_dim 64 / 128 take the AVX2 paths, 32 the portable one; block size 12 is not a multiple
# of 8; windows cut inside blocks (5) or span several (20); decode and prefill tokens together.
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size, window", [(16, None), (12, None), (12, 5), (16, 20)])
def test_native_attention_matches_the_twin(dtype, block_size, head_dim, window, one_thread):
    _check_native_against_twin(dtype, block_size, (9, 3), head_dim, window)


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (18, 2)])  # no GQA, one KV head, groups > 8
def test_native_attention_matches_the_twin_for_other_head_groupings(dtype, heads):  # all threads
    _check_native_against_twin(dtype, 16, heads, 64, None, seed=1)


def test_native_attention_with_an_empty_context_gives_zeros():
    kd, ks = kv_ops.quantize(torch.randn(4, 16, 2, 64), torch.int8)
    q = torch.randn(2, 4, 64)
    out = kv_ops.paged_attention_kv(q, kd, kd, ks, ks, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 5]),
                                    torch.tensor([0, 1, 2]), 0.125)  # fmt: skip
    assert torch.equal(out[0], torch.zeros(4, 64)) and torch.isfinite(out).all()


def test_portable_build_matches_the_twins(monkeypatch, one_thread):
    """The non-AVX2 paths (-march=x86-64): attention over each dtype, and the write path."""
    from pagedllm.kernels.build import build_library

    lib = build_library(march="x86-64")
    assert lib.pagedllm_kernels_isa() == b"generic"
    monkeypatch.setattr(kv_ops, "load_kernels", lambda: lib)
    for dtype in NATIVE_DTYPES:
        for head_dim, window in ((64, None), (32, 7)):
            _check_native_against_twin(dtype, 16, (9, 3), head_dim, window, seed=2)
    for dtype in QUANTIZED:
        k, v = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
        slots = torch.tensor([3, 1, 4, 15, 9])
        a = [torch.zeros(2, 8, 3, 64, dtype=dtype) for _ in range(2)] + [torch.zeros(2, 8, 3) for _ in range(2)]
        b = [t.clone() for t in a]
        kv_ops.write_kv_quantized(k, v, a[0], a[1], a[2], a[3], slots)
        kv_ops.write_kv_quantized_reference(k, v, b[0], b[1], b[2], b[3], slots)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))
