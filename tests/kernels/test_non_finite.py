"""A NaN or an inf that reaches a kernel comes out not finite, as from its torch twin, in every
build this CPU runs; it never turns into plausible numbers, and never reaches another row.

Found by an adversarial review: the int8 activation quantiser and the int8 / fp8 KV-cache
writer took the absolute maximum with ``max``, which drops a NaN, and then stored finite quants
(a NaN converts to INT_MIN, saturated to -128); the vectorised attention's exp clamped a NaN
score to -87.3 (weight ~0). Also here: inputs the native paths used to read wrongly without a
word (a GGUF row width that is not the data's, cache views of another layout).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels import gguf_ops, int8_ops, kv_ops, ops, reference
from pagedllm.kernels.build import build_library, load_kernels
from tests.kernels.test_gguf_kernels import random_gguf
from tests.kernels.test_kernels import cpu_flags

NAN, INF = float("nan"), float("inf")
BUILDS = {"native": set(), "haswell": {"avx2", "fma", "f16c", "bmi2"}, "x86-64": set()}


@pytest.fixture(params=list(BUILDS))
def lib(request, monkeypatch):
    """Each build of the library this CPU runs, standing in for the engine's."""
    missing = BUILDS[request.param] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} for -march={request.param}")
    built = load_kernels() if request.param == "native" else build_library(march=request.param)
    monkeypatch.setattr(ops, "load_kernels", lambda: built)
    monkeypatch.setattr(kv_ops, "load_kernels", lambda: built)
    return built


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN (torch.equal calls NaN unequal to itself)."""
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# Positions in the first 32-wide block: the first and last vector lane, and one between.
POISONS = [(0, NAN), (13, NAN), (31, NAN), (5, INF), (30, -INF)]


@pytest.mark.parametrize("bits", [8, 16])
def test_an_activation_block_holding_a_nan_or_inf_quantises_as_the_twin(lib, bits):
    for pos, bad in POISONS:
        x = torch.randn(3, 96, generator=torch.Generator().manual_seed(pos))
        x[1, pos] = bad
        q, d, s = int8_ops.quantize(x, bits)
        tq, td, ts = reference.quantize_activations(x, bits)
        assert torch.equal(q, tq) and torch.equal(s, ts) and _same(d, td), f"{bad} at {pos}"
        assert not math.isfinite(float(d[1, 0])) and not q[1, :32].any() and int(s[1, 0]) == 0
        assert torch.isfinite(d[[0, 2]]).all() and torch.isfinite(d[1, 1:]).all()  # the other blocks as before


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_int8_gemm_keeps_a_poisoned_row_not_finite_and_the_others_as_they_were(lib, qtype, bits):
    n, k = 20, 96
    fields = reference.block_fields(random_gguf(qtype, n, k, seed=3), qtype, k)
    panels = reference.pack_int8_panels(fields, qtype)
    clean = torch.randn(4, k, generator=torch.Generator().manual_seed(7))
    before = int8_ops.linear(clean, panels, qtype, n, bits=bits)
    for pos, bad in POISONS:
        x = clean.clone()
        x[2, pos] = bad
        y = int8_ops.linear(x, panels, qtype, n, bits=bits)
        assert not torch.isfinite(y[2]).any(), f"{bad} at {pos} gave {y[2, :4].tolist()}"
        assert not torch.isfinite(reference.int8_linear(x, panels, qtype, n, bits)[2]).any()
        assert torch.equal(y[[0, 1, 3]], before[[0, 1, 3]])


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_a_kv_row_holding_a_nan_or_inf_is_stored_as_the_twin_stores_it(lib, dtype):
    for pos, bad in POISONS:
        k = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(pos))
        v = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(pos + 100))
        k[1, 0, pos] = bad
        v[2, 1, 63 - pos] = bad
        slots = torch.tensor([5, 0, 9])
        a = [torch.zeros(2, 8, 2, 64, dtype=dtype) for _ in range(2)] + [torch.zeros(2, 8, 2) for _ in range(2)]
        b = [t.clone() for t in a]
        kv_ops.write_kv_quantized(k, v, *a, slots)
        kv_ops.write_kv_quantized_reference(k, v, *b, slots)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[:2], b[:2])), f"{bad} at {pos}"
        assert _same(a[2], b[2]) and _same(a[3], b[3])
        keys = kv_ops.dequantize(a[0], a[2]).flatten(0, 1)
        values = kv_ops.dequantize(a[1], a[3]).flatten(0, 1)
        assert not torch.isfinite(keys[0, 0]).any() and not torch.isfinite(values[9, 1]).any()
        assert torch.isfinite(keys[[5, 9]]).all() and torch.isfinite(keys[0, 1]).all()


def _poisoned_cache(dtype: torch.dtype, head_dim: int, bad: float):
    """Two sequences over separate blocks; a key of the first one holds ``bad``."""
    g = torch.Generator().manual_seed(head_dim)
    kc, vc = torch.randn(4, 16, 1, head_dim, generator=g), torch.randn(4, 16, 1, head_dim, generator=g)
    kc[0, 3, 0, 5] = bad
    q = torch.randn(2, 2, head_dim, generator=g)
    meta = (torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 25]), torch.tensor([0, 1, 2]))
    if dtype == torch.float32:
        return q, kc, vc, None, None, meta
    if dtype == torch.float16:
        return q, kc.half(), vc.half(), None, None, meta
    kd, ks = kv_ops.quantize(kc, dtype)
    vd, vs = kv_ops.quantize(vc, dtype)
    return q, kd, vd, ks, vs, meta


@pytest.mark.parametrize("head_dim", [64, 80])  # 64: the vectorised attention; 80: the generic one
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8], ids=str)
def test_attention_over_a_non_finite_key_is_not_finite_and_other_sequences_are_untouched(lib, head_dim, dtype):
    scale = head_dim**-0.5
    for bad in (NAN, INF, -INF):
        q, kc, vc, ks, vs, meta = _poisoned_cache(dtype, head_dim, bad)
        if dtype == torch.float32:
            got = ops.paged_attention(q, kc, vc, *meta, scale)
            want = reference.paged_attention(q, kc, vc, *meta, scale)
        else:
            got = kv_ops.paged_attention_kv(q, kc, vc, ks, vs, *meta, scale)
            want = kv_ops.paged_attention_kv_reference(q, kc, vc, ks, vs, *meta, scale)
        assert not torch.isfinite(want[0]).all(), "the twin's own answer"
        assert torch.equal(torch.isfinite(got[0]), torch.isfinite(want[0])), f"{bad}: {got[0, :, :3].tolist()}"
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=3e-2 if dtype == torch.int8 else 1e-5)


def test_native_attention_reads_a_cache_view_of_another_layout_as_the_twin():
    """K and V as views of one [blocks, 2, ...] pool: strides the kernels do not assume."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(4, 2, 16, 2, 64, generator=g)
    kc, vc = pool[:, 0], pool[:, 1]
    q = torch.randn(3, 4, 64, generator=g)
    meta = (torch.tensor([[0, 2], [3, 1]]), torch.tensor([20, 30]), torch.tensor([0, 1, 3]))
    want = reference.paged_attention(q, kc.contiguous(), vc.contiguous(), *meta, 0.125)
    torch.testing.assert_close(ops.paged_attention(q, kc, vc, *meta, 0.125), want, rtol=1e-5, atol=1e-5)
    for dtype in (torch.float16, torch.int8):
        if dtype == torch.float16:
            halves, scales = pool.half(), (None, None)
        else:
            halves, s = kv_ops.quantize(pool, dtype)
            scales = (s[:, 0], s[:, 1])
        kd, vd = halves[:, 0], halves[:, 1]
        got = kv_ops.paged_attention_kv(q, kd, vd, *scales, *meta, 0.125)
        dense = [t if t is None else t.contiguous() for t in (kd, vd, *scales)]
        torch.testing.assert_close(got, kv_ops.paged_attention_kv_reference(q, *dense, *meta, 0.125), rtol=1e-5, atol=1e-5)
    # The quantising write into views: the same bytes as into dense caches.
    k, v = torch.randn(2, 2, 64, generator=g), torch.randn(2, 2, 64, generator=g)
    pool8, scales8 = torch.zeros(4, 2, 16, 2, 64, dtype=torch.int8), torch.zeros(4, 2, 16, 2)
    kv_ops.write_kv_quantized(k, v, pool8[:, 0], pool8[:, 1], scales8[:, 0], scales8[:, 1], torch.tensor([7, 40]))
    dense8 = [torch.zeros(4, 16, 2, 64, dtype=torch.int8) for _ in range(2)] + [torch.zeros(4, 16, 2) for _ in range(2)]
    kv_ops.write_kv_quantized_reference(k, v, *dense8, torch.tensor([7, 40]))
    assert torch.equal(pool8[:, 0], dense8[0]) and torch.equal(pool8[:, 1], dense8[1])
    assert torch.equal(scales8[:, 0], dense8[2]) and torch.equal(scales8[:, 1], dense8[3])


def test_gguf_ops_refuse_a_row_width_that_is_not_the_datas():
    data = random_gguf("Q4_0", 4, 64)  # rows of 64 weights: 2 blocks, 36 bytes
    ids = torch.tensor([0, 3])
    assert torch.equal(gguf_ops.get_rows(data, "Q4_0", ids, 64), gguf_ops.dequantize(data, "Q4_0", 64)[[0, 3]])
    for k in (48, 32, 96):  # not whole blocks; whole blocks but not the rows' width
        with pytest.raises(ValueError, match="Q4_0"):
            gguf_ops.get_rows(data, "Q4_0", ids, k)
        with pytest.raises(ValueError, match="Q4_0"):
            gguf_ops.linear(torch.randn(2, k), data, "Q4_0", 4)


def test_the_int8_twin_takes_an_empty_batch():
    fields = reference.block_fields(random_gguf("Q8_0", 8, 64, seed=1), "Q8_0", 64)
    panels = reference.pack_int8_panels(fields, "Q8_0")
    x = torch.empty(0, 64)
    with ops.torch_only():
        assert int8_ops.linear(x, panels, "Q8_0", 8).shape == (0, 8)
        assert [t.shape[0] for t in int8_ops.quantize(x)] == [0, 0, 0]
    assert int8_ops.linear(x, panels, "Q8_0", 8).shape == (0, 8)
