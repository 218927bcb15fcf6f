"""Each native kernel against its pure-torch twin (pagedllm/kernels/reference.py) and the gguf
package, on shapes that hit the tails (rows not a multiple of the tile, 1..9 tokens)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

from pagedllm.kernels import kv_ops, ops, reference
from pagedllm.kernels.build import load_kernels
from pagedllm.model.linear import PACKED_MAX_ROWS, Linear
from tests.sampler.test_sampler import (
    check_native_argmax,
    check_native_draws_follow_the_torch_rule,
    check_native_penalties_match_the_torch_code,
)
from tests.spec_decode.test_proposer_and_rejection import check_native_verification_follows_the_torch_rule


def random_blocks(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """GGUF blocks of a random [n, k] matrix, quantized by the gguf package, and its dequantization."""
    import gguf
    from gguf.quants import dequantize, quantize

    t = getattr(gguf.GGMLQuantizationType, qtype)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    q = quantize(w, t)
    return torch.from_numpy(q.copy()), dequantize(q, t)


def test_library_builds_and_uses_the_requested_threads():
    lib = load_kernels()
    assert lib is not None, "the native kernels did not build (is g++ installed?)"
    assert lib.pagedllm_team_size(2) == 2


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_dequantize_twin_matches_the_gguf_package(qtype):
    packed, dense = random_blocks(qtype, 37, 96, seed=1)
    torch.testing.assert_close(reference.dequantize(packed, qtype, 37, 96), torch.from_numpy(dense), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [1, 6, 37])
def test_grouping_keeps_every_weight(qtype, n):
    packed, dense = random_blocks(qtype, n, 64, seed=n)
    grouped = reference.group_blocks(packed, qtype, n, 64)
    assert grouped.shape == (-(-n // 16), 2, 320 if qtype == "Q4_1" else 544)
    torch.testing.assert_close(reference.dequantize_grouped(grouped, qtype, n, 64), torch.from_numpy(dense), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(37, 96), (64, 32), (130, 576)])
def test_grouped_gemm_matches_dense_matmul(qtype, m, n, k):
    packed, dense = random_blocks(qtype, n, k, seed=m + n)
    grouped = reference.group_blocks(packed, qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = ops.grouped_linear(x, grouped, qtype, n)
    want = x.double() @ torch.from_numpy(dense).double().t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    with ops.torch_only():
        torch.testing.assert_close(ops.grouped_linear(x, grouped, qtype, n), got, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(37, 96), (64, 32), (130, 576)])
def test_grouped_gemm_rows_are_bit_identical_to_the_dense_gemm_at_every_batch_size(qtype, n, k):
    """The batch-invariance contract: the small-step kernel (blocks) and the big-step kernel
    (fp32 panels of the same weights) sum each output in the same order, so a row's result is
    the same bits whether it runs alone, with a few rows (blocks) or with many (panels)."""
    packed, dense = random_blocks(qtype, n, k, seed=n + k)
    grouped = reference.group_blocks(packed, qtype, n, k)
    panels = reference.pack_panels(torch.from_numpy(dense))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k))
    full = ops.panel_linear(x, panels, n)
    for m in range(1, PACKED_MAX_ROWS + 3):
        assert torch.equal(ops.grouped_linear(x[:m], grouped, qtype, n), full[:m]), f"{m} rows"
        assert torch.equal(ops.panel_linear(x[:m], panels, n), full[:m]), f"{m} rows (panels)"


def test_linear_gives_the_same_rows_from_blocks_and_from_dense_weights():
    packed, dense = random_blocks("Q4_1", 96, 64, seed=3)
    lin = Linear(64, 96, bias=True)
    lin.weight.data = torch.from_numpy(dense)
    lin.bias.data = torch.randn(96)
    lin.set_packed(packed, "Q4_1")
    x = torch.randn(PACKED_MAX_ROWS + 4, 64)
    dense_rows = lin(x)  # more rows than PACKED_MAX_ROWS: the dense matmul
    for m in (1, 3, PACKED_MAX_ROWS):
        torch.testing.assert_close(lin(x[:m]), dense_rows[:m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 97, 200])
@pytest.mark.parametrize("n,k", [(1, 8), (16, 96), (37, 577), (100, 64)])
def test_panel_gemm_matches_matmul(m, n, k):
    """Tiles of 6 rows x 16 columns and chunks of 96 rows: every tail, K not a multiple of 8."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    panels = reference.pack_panels(w)
    assert panels.shape == (-(-n // 16), k, 16)
    torch.testing.assert_close(reference.unpack_panels(panels, n), w, rtol=0, atol=0)
    want = x.double() @ w.double().t() + bias.double()
    got = ops.panel_linear(x, panels, n, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    with ops.torch_only():
        torch.testing.assert_close(ops.panel_linear(x, panels, n, bias), got, rtol=1e-5, atol=1e-4)
    got_bf16 = ops.panel_linear(x.bfloat16(), panels, n)  # widened in, rounded out
    assert got_bf16.dtype == torch.bfloat16
    want_bf16 = x.bfloat16().double() @ w.double().t()
    torch.testing.assert_close(got_bf16.double(), want_bf16, rtol=2**-7, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("n,k", [(1, 8), (16, 96), (33, 577), (48, 64), (100, 576)])
def test_wide_fma_tiles_give_the_same_bits(n, k):
    """The AVX-512 tile shapes for full-width 512-bit FMAs (on for Intel CPUs: two panels per
    dense GEMM tile, the zmm tile for one- and two-row Q4_1 steps) sum every output in the same
    k order as the others: torch.equal for every row tail (tiles of 12 and 8 rows, chunks of 96)
    and an odd number of panels/groups (the last runs alone). Elsewhere the switch is a no-op."""
    lib = load_kernels()
    g = torch.Generator().manual_seed(n * 7 + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(200, k, generator=g)
    panels = reference.pack_panels(w)
    quantized = []
    if k % 32 == 0:
        for qtype in ("Q4_1", "Q8_0"):
            packed, _ = random_blocks(qtype, n, k, seed=n + k)
            quantized.append((qtype, reference.group_blocks(packed, qtype, n, k)))
    was = lib.pagedllm_wide_fma()
    try:
        outs = {}
        for on in (0, 1):
            lib.pagedllm_set_wide_fma(on)
            is_avx512 = lib.pagedllm_kernels_isa() == b"avx512"
            assert lib.pagedllm_wide_fma() == (on if is_avx512 else 0)
            outs[on] = [ops.panel_linear(x[:m], panels, n) for m in (1, 7, 8, 11, 12, 13, 25, 96, 97, 200)]
            outs[on] += [ops.grouped_linear(x[:m], grouped, qtype, n) for qtype, grouped in quantized for m in (1, 2, 3)]
    finally:
        lib.pagedllm_set_wide_fma(was)
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b), f"{n}x{k}, {a.shape[0]} rows: the tile shapes differ"
    want = x.double() @ w.double().t()
    torch.testing.assert_close(outs[1][9].double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,head_dim,block_size,window",
    [((9, 3), 64, 16, None), ((8, 2), 128, 16, None), ((6, 1), 64, 5, None), ((4, 4), 64, 16, 40), ((9, 3), 64, 12, 100)],
)
def test_wide_fma_attention_pairs_rows_without_changing_bits(heads, head_dim, block_size, window, cache_dtype):
    """With full-width 512-bit FMAs, attention runs two query rows that read the same KV head
    in one zmm (the second may be the next token of a prefill tile, which sees one key more):
    every row must keep the bits of the ymm path, for decodes, prefill chunks after a cached
    prefix, an 8-token verification step, odd row counts, blocks not a multiple of 8 and a
    sliding window. Elsewhere the switch is a no-op."""
    lib = load_kernels()
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(head_dim + block_size)
    seqs = [(36, 1), (0, 23), (50, 8), (129, 3), (7, 1), (200, 1), (16, 16), (3, 5)]  # (cached prefix, new tokens)
    nb = sum(-(-(p + c) // block_size) for p, c in seqs) + 5
    kc = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    vc = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    perm = torch.randperm(nb, generator=g)
    width = max(-(-(p + c) // block_size) for p, c in seqs)
    tables, used = torch.zeros(len(seqs), width, dtype=torch.int64), 0
    for i, (p, c) in enumerate(seqs):
        k = -(-(p + c) // block_size)
        tables[i, :k], used = perm[used : used + k], used + k
    q = torch.randn(sum(c for _, c in seqs), num_heads, head_dim, generator=g)
    args = (tables, torch.tensor([p + c for p, c in seqs]), torch.tensor([0, *torch.tensor([c for _, c in seqs]).cumsum(0).tolist()]),
            head_dim**-0.5, window)  # fmt: skip

    def run():
        if cache_dtype == torch.float16:
            return kv_ops.paged_attention_kv(q, kc, vc, None, None, *args)
        return ops.paged_attention(q, kc, vc, *args)

    was = lib.pagedllm_wide_fma()
    try:
        lib.pagedllm_set_wide_fma(0)
        narrow = run()
        lib.pagedllm_set_wide_fma(1)
        wide = run()
    finally:
        lib.pagedllm_set_wide_fma(was)
    assert torch.equal(narrow, wide)
    twin = reference.paged_attention(q, kc.float(), vc.float(), *args)
    torch.testing.assert_close(wide, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("scale", [0.05, 144**-0.5])
def test_attention_uses_the_scale_it_is_given(head_dim, scale):
    """Models whose query scale is not head_dim**-0.5 (Gemma's query_pre_attn_scalar, e.g. 144
    for head_dim 128): every test passed head_dim**-0.5, so the vectorised head sizes could have
    ignored the argument unseen (found by a mutation audit)."""
    g = torch.Generator().manual_seed(head_dim)
    bs, nb = 16, 12
    kc, vc = (torch.randn(nb, bs, 2, head_dim, generator=g) for _ in range(2))
    tables = torch.randperm(nb, generator=g)[:10].view(2, 5)
    seq_lens, starts = torch.tensor([70, 33]), torch.tensor([0, 1, 6])  # a decode, a 5-token chunk
    q = torch.randn(6, 4, head_dim, generator=g) * 3
    got = ops.paged_attention(q, kc, vc, tables, seq_lens, starts, scale, None)
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, starts, scale, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_moves_its_weight_into_panels_unless_shared():
    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 40, bias=True)
    lin.weight.data, lin.bias.data = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    x = torch.randn(30, 64, generator=g)
    before = lin(x)
    assert lin.pack_dense() and lin.weight is None and lin.compute_dtype == torch.float32
    torch.testing.assert_close(lin(x), before, rtol=1e-5, atol=1e-5)
    assert not lin.pack_dense()  # once
    tied = Linear(64, 40)
    assert tied.pack_dense(keep_weight=True) and tied.weight is not None


@pytest.mark.parametrize("t", [1, 5, 33])
def test_rms_norm_with_and_without_residual(t):
    g = torch.Generator().manual_seed(t)
    x, w, res = torch.randn(t, 96, generator=g), torch.randn(96, generator=g), torch.randn(t, 96, generator=g)
    res_native, res_torch = res.clone(), res.clone()
    out = ops.rms_norm(x, w, 1e-5, res_native)
    with ops.torch_only():
        want = ops.rms_norm(x, w, 1e-5, res_torch)
        want_plain = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res_native, res + x)
    torch.testing.assert_close(res_torch, res + x)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want_plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 4, 17])
def test_rope_on_views_of_the_fused_qkv_rows(t):
    g = torch.Generator().manual_seed(t)
    heads, kv_heads, d = 6, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(50, d, generator=g), torch.randn(50, d, generator=g)
    positions = torch.randint(0, 50, (t,), generator=g)

    def run():
        data = qkv.clone()
        q, k, v = data.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        ops.rope_(q.view(t, heads, d), k.view(t, kv_heads, d), positions, cos, sin)
        return data

    native = run()
    with ops.torch_only():
        want = run()
    torch.testing.assert_close(native, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(native[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])  # v untouched


def test_write_kv_and_silu_and_mul_match_torch():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(5, 2 * 2 * 8, generator=g)
    k, v = kv.split(16, dim=-1)
    k, v = k.view(5, 2, 8), v.view(5, 2, 8)
    slots = torch.tensor([7, 0, 12, 3, 9])
    caches = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
    ops.write_kv(k, v, caches[0], caches[1], slots)
    with ops.torch_only():
        ops.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0].view(-1, 2, 8)[slots], k)
    gate_up = torch.randn(6, 2 * 40, generator=g)
    native = ops.silu_and_mul(gate_up)
    torch.testing.assert_close(native, torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:])


def check_half_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 / bf16 caches: the native write stores the bytes of torch's .to() (round to nearest
    even), for rounding ties, overflow to infinity, subnormals and underflow, from strided rows."""
    assert ops.load_kernels() is not None
    g = torch.Generator().manual_seed(1)
    T, Hkv, D = 6, 2, 20  # 40 values per row: the vector loop plus a scalar tail
    qkv = torch.randn(T, 3 * Hkv * D, generator=g) * 4
    k, v = qkv[:, Hkv * D : 2 * Hkv * D].view(T, Hkv, D), qkv[:, 2 * Hkv * D :].view(T, Hkv, D)
    half_ulp = 2.0**-11
    k[0, 0, :16] = torch.tensor([1 + half_ulp, 1 + 3 * half_ulp, -(1 + half_ulp), 65504.0, 65519.0, 65520.0, 1e6,
                                 -1e6, float("inf"), float("-inf"), 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 3 * 2.0**-25,
                                 2.0**-15 * 1.3, 0.0])  # fmt: skip
    v[1, 1, :8] = torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.4e38, 1e-40, -0.0, 2.0**-126, 7.0])
    slots = torch.tensor([9, 0, 15, 4, 2, 11])
    for dtype in (torch.float16, torch.bfloat16):
        caches = [torch.zeros(4, 4, Hkv, D, dtype=dtype) for _ in range(4)]
        with monkeypatch.context() as m:  # the native kernel, not the twin
            m.setattr(reference, "write_kv", None)
            ops.write_kv(k, v, caches[0], caches[1], slots)
        with ops.torch_only():
            ops.write_kv(k, v, caches[2], caches[3], slots)
        for a, b in ((0, 2), (1, 3)):
            assert torch.equal(caches[a].view(torch.int16), caches[b].view(torch.int16)), dtype
        assert torch.equal(caches[0].view(-1, Hkv, D)[slots].view(torch.int16), k.to(dtype).view(torch.int16))


def test_native_half_cache_writes_match_torch(monkeypatch):
    check_half_writes(monkeypatch)


def check_against_the_twins(lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GEMM, attention and glue kernel of `lib` against its pure-torch twin (and the small-step
    GEMM against the panels of the same library, bit for bit: batch invariance on this path)."""
    from tests.attention.test_backends import get_attention_backend, make_batch

    monkeypatch.setattr(ops, "load_kernels", lambda: lib)
    for qtype in ("Q4_1", "Q8_0"):
        packed, dense = random_blocks(qtype, 37, 96, seed=5)
        grouped = reference.group_blocks(packed, qtype, 37, 96)
        for m in (1, 2, 5, 11):
            x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
            want = x @ torch.from_numpy(dense).t()
            got = ops.grouped_linear(x, grouped, qtype, 37)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            # batch invariance holds on this path too: the same bits as the dense GEMM
            assert torch.equal(got, ops.panel_linear(x, reference.pack_panels(torch.from_numpy(dense)), 37))
    w = torch.randn(37, 50)
    for m in (1, 8, 100):
        x = torch.randn(m, 50)
        torch.testing.assert_close(ops.panel_linear(x, reference.pack_panels(w), 37), x @ w.t(), rtol=1e-5, atol=1e-4)
    for head_dim in (32, 64, 128):  # 64 and 128: the vectorised attention; 32: the generic one
        q, k, v, kc, vc, meta, _ = make_batch(2, 16, 9, 3, torch.float32, head_dim)
        scale = head_dim**-0.5
        ref = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
        kc2, vc2 = kc.clone(), vc.clone()
        ops.write_kv(k, v, kc2, vc2, meta.slot_mapping)
        got = ops.paged_attention(q, kc2, vc2, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for window in (1, 5, 16, 21):  # the kernel's window against the torch twin's
            args = (q, kc2, vc2, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window)
            torch.testing.assert_close(ops.paged_attention(*args), reference.paged_attention(*args), rtol=1e-5, atol=1e-5)
    x, w, res = torch.randn(9, 96), torch.randn(96), torch.randn(9, 96)
    want = res + x
    want = w * (want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, res), want, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(9, 80)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:])
    check_half_writes(monkeypatch)
    check_native_draws_follow_the_torch_rule(vocab=5000)
    check_native_penalties_match_the_torch_code(vocab=5000)
    check_native_argmax()
    check_native_verification_follows_the_torch_rule(vocab=5000)


def test_portable_build_matches_the_torch_twins(monkeypatch):
    """The non-AVX2 code paths (what a CPU without AVX2 runs), built with -march=x86-64."""
    from pagedllm.kernels.build import build_library

    lib = build_library(march="x86-64")
    assert lib.pagedllm_kernels_isa() == b"generic"
    check_against_the_twins(lib, monkeypatch)


# -march -> (what pagedllm_kernels_isa() reports, the /proc/cpuinfo flags a CPU needs to run it)
SIMD_BUILDS = {
    "haswell": ("avx2", {"avx2", "fma", "f16c"}),
    "skylake-avx512": ("avx512", {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}),
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty when /proc/cpuinfo cannot tell: every SIMD test then skips)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("march", list(SIMD_BUILDS))
def test_each_simd_build_this_cpu_runs_matches_the_twins_and_the_native_bits(march, monkeypatch):
    """The AVX2 and the AVX-512 code paths, each where this CPU can run it: against the torch
    twins, and their GEMMs against the native build's (whichever ISA that is) with torch.equal
    - every path sums each output in the same k order with the same FMAs, so a model gives the
    same bits on an AVX2 and an AVX-512 machine."""
    from pagedllm.kernels.build import build_library

    isa, needs = SIMD_BUILDS[march]
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} for the {isa} path (test_simd_builds_compile checks it compiles)")
    lib = build_library(march=march)
    assert lib.pagedllm_kernels_isa() == isa.encode()
    native = load_kernels()
    for qtype in ("Q4_1", "Q8_0"):
        for n, k in [(37, 96), (130, 576)]:
            packed, dense = random_blocks(qtype, n, k, seed=n + k)
            grouped = reference.group_blocks(packed, qtype, n, k)
            panels = reference.pack_panels(torch.from_numpy(dense))
            x = torch.randn(200, k, generator=torch.Generator().manual_seed(k))
            outs = []
            for which in (native, lib):
                monkeypatch.setattr(ops, "load_kernels", lambda which=which: which)
                outs.append([ops.grouped_linear(x[:m], grouped, qtype, n) for m in range(1, PACKED_MAX_ROWS + 3)]
                            + [ops.panel_linear(x[:m], panels, n) for m in (1, 7, 13, 97, 200)])
            for a, b in zip(*outs):
                assert torch.equal(a, b), f"{qtype} {n}x{k}, {a.shape[0]} rows: {march} differs from native"
    check_against_the_twins(lib, monkeypatch)


@pytest.mark.parametrize("march", list(SIMD_BUILDS))
def test_simd_builds_compile(march):
    """Each SIMD path compiles and exports the whole C API, also on a CPU that cannot run it
    (an AVX2-only CI still compiles the AVX-512 code): the library is inspected, never loaded."""
    import subprocess

    from pagedllm.kernels.build import full_c_api, library_path

    isa, _ = SIMD_BUILDS[march]
    path = library_path(march=march)
    exported = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    symbols = {line.split()[-1] for line in exported.stdout.splitlines()}
    assert set(full_c_api()) <= symbols and "pagedllm_kernels_isa" in symbols
    # pagedllm_kernels_isa() returns this literal only when that path's code was compiled in
    assert isa.encode() + b"\0" in path.read_bytes()


# --------------------------------------------------------------------------- the kernel ABI
def test_loading_the_kernels_leaves_denormals_alone():
    """-ffast-math would link crtfastmath.o: flush-to-zero for the whole process, torch included."""
    assert ops.native_available()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0
    assert np.float32(1e-39) * np.float32(1.0) != 0.0


def test_the_c_api_is_declared_in_one_place():
    """Every exported symbol is one of the prototypes build.py reads, and every prototype is
    exported with the ctypes signature read from it."""
    import subprocess

    from pagedllm.kernels.build import full_c_api, load_kernels

    api = full_c_api()
    lib = load_kernels()
    for name, (restype, argtypes) in api.items():
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes and fn.restype == restype, name
    exported = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True, check=True)
    ours = {line.split()[-1] for line in exported.stdout.splitlines() if " T " in line}
    ours = {n for n in ours if not n.startswith("_")}  # C++ (mangled) symbols start with _Z
    assert ours == set(api), ours ^ set(api)
    assert api["paged_attention_f32"][1][13] is ctypes.c_int64  # num_blocks, passed since it exists


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 128), ((32, 1), 64), ((4, 4), 64)])
def test_attention_of_a_token_does_not_depend_on_the_rest_of_the_step(heads, head_dim, cache_dtype):
    """Steps with many tokens take all KV heads of a token in one work item (contiguous block
    reads), small steps one KV head per item, groups over 16 query heads in rounds: a token's
    output must be the same bits either way (batch invariance), and equal the torch twin."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(3)
    block_size, nb = 16, 200
    kc = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    vc = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
    lens = [1, 37, 200, 16, 90, 333, 5, 64, 129, 250, 17, 48]
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(lens), 21, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // block_size)
        tables[i, :k] = perm[used : used + k]
        used += k
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    scale = head_dim**-0.5

    def run(rows):
        args = (tables[rows], torch.tensor([lens[r] for r in rows]), torch.arange(len(rows) + 1), scale)
        if cache_dtype == torch.float16:  # the fp16 cache runs the same kernel, widening in registers
            return kv_ops.paged_attention_kv(q[rows], kc, vc, None, None, *args)
        return ops.paged_attention(q[rows], kc, vc, *args)

    full = run(list(range(len(lens))))
    for r in (0, 2, 5):
        assert torch.equal(run([r]), full[r : r + 1])
    twin = reference.paged_attention(q, kc.float(), vc.float(), tables, torch.tensor(lens), torch.arange(len(lens) + 1), scale)
    torch.testing.assert_close(full, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 128), ((4, 4), 64), ((32, 1), 64)])
def test_prefill_tiles_give_each_token_its_decode_bits(heads, head_dim):
    """A prefill chunk is attended in tiles of several tokens per KV head: every token must get
    the bits it gets attended alone (as a decode of the same context), cold prefix or not."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(5)
    block_size, nb = 16, 64
    kc = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(nb, block_size, num_kv_heads, head_dim, generator=g)
    # (cached prefix, chunk): a chunk from 0, one after a prefix, a short one mid-block
    seqs = [(0, 37), (50, 70), (129, 3)]
    tables = torch.stack([torch.randperm(nb, generator=g)[:16] for _ in seqs])
    q = torch.randn(sum(c for _, c in seqs), num_heads, head_dim, generator=g)
    qsl = torch.tensor([0, *torch.tensor([c for _, c in seqs]).cumsum(0).tolist()])
    seq_lens = torch.tensor([p + c for p, c in seqs])
    scale = head_dim**-0.5
    chunked = ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale)
    t = 0
    for s, (p, c) in enumerate(seqs):
        for i in range(c):  # the same token as a one-token step of its own
            alone = ops.paged_attention(q[t : t + 1], kc, vc, tables[s : s + 1], torch.tensor([p + i + 1]),
                                        torch.tensor([0, 1]), scale)  # fmt: skip
            assert torch.equal(alone[0], chunked[t]), (s, i)
            t += 1
    twin = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale)
    torch.testing.assert_close(chunked, twin, rtol=1e-5, atol=1e-5)


def test_attention_with_an_empty_context_gives_zeros_not_a_crash():
    kc = torch.randn(4, 16, 2, 64)
    vc = torch.randn(4, 16, 2, 64)
    q = torch.randn(2, 4, 64)
    tables = torch.tensor([[0, 1], [2, 3]])
    seq_lens = torch.tensor([0, 5])  # the first sequence has nothing to attend to
    qsl = torch.tensor([0, 1, 2])
    out = ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125)
    assert torch.equal(out[0], torch.zeros(4, 64)) and torch.isfinite(out).all()


def test_debug_build_checks_every_index(tmp_path):
    """PAGEDLLM_KERNEL_DEBUG=1 builds with the checks: a block id outside the pool aborts with
    its name instead of reading stray memory."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import torch
        from pagedllm.kernels import build, ops
        assert build.load_kernels().pagedllm_debug_checks() == 1
        kc, vc = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
        tables = torch.tensor([[0, 99]])  # 99: outside the pool of 4 blocks
        ops.paged_attention(torch.randn(1, 4, 64), kc, vc, tables, torch.tensor([20]), torch.tensor([0, 1]), 0.1)
        print("not caught")
    ''')
    env = {**os.environ, "PAGEDLLM_KERNEL_DEBUG": "1", "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "not caught" not in res.stdout, res.stdout + res.stderr
    assert "block 1 = 99 outside [0, 4)" in res.stderr, res.stderr[-2000:]


def test_decoder_stack_refuses_an_unknown_block_type():
    from pagedllm.kernels.build import load_kernels

    qtypes = torch.tensor([[0, 1, 7, 0]], dtype=torch.int32)  # 7: no such type
    args = [0] * 29
    args[3] = qtypes.data_ptr()
    args[4] = 1  # one layer
    args[6] = 1e-5
    args[-4] = 0.1  # scale; then the KV dtype (0: fp32), the activation bits and the threads
    args[-2] = 8
    args[-1] = 1
    assert load_kernels().decoder_stack_f32(*args) == 1  # refused before touching any pointer
    qtypes[0, 2] = 5  # int8 panels of Q8_0: known, but an unknown KV dtype is refused too
    args[-3] = 3
    assert load_kernels().decoder_stack_f32(*args) == 1


def test_apply_token_bitmask_matches_its_twin_and_the_bit_order():
    """Structured outputs' mask: native kernel == torch twin, on a subset of rows and a vocab
    that does not fill its last word; bit t % 32 of word t // 32 allows token t."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = 100, torch.tensor([3, 0, 5])
    words = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    words[1, 0] = -1  # a whole word allowed
    words[2, 1] = 0  # a whole word banned
    logits = torch.randn(6, vocab, generator=g)
    native, twin = logits.clone(), logits.clone()
    ops.apply_token_bitmask(native, rows, words)
    with ops.torch_only():
        ops.apply_token_bitmask(twin, rows, words)
    assert torch.equal(native, twin)
    for r, row in enumerate(rows.tolist()):
        for t in range(vocab):
            allowed = (int(words[r, t // 32]) >> (t % 32)) & 1
            assert (native[row, t] == logits[row, t]) if allowed else native[row, t] == float("-inf")
    untouched = [i for i in range(6) if i not in rows.tolist()]
    assert torch.equal(native[untouched], logits[untouched])
