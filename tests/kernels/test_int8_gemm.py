"""The fast mode's GEMM (csrc/int8_gemm.cpp): int8 activations x Q4_0/Q4_1/Q8_0 int8 panels,
against its twin (reference.int8_linear: the same quantized x and dequantized weights, in fp64).

The kernel's block sums are exact integers; what it rounds is the fp32 scaling of each block
(cvt, x dw, fma with dx: ~3 roundings of a block's term) and the running sum over the K/32
blocks. So |kernel - twin| <= (K/32 + 3) * 2^-24 * sum_k |x_k w_k| per output, up to second-order
terms; the tests allow twice that. Every build the CPU can run: native (AVX512-VNNI here),
haswell (AVX2: vpmaddubsw) and x86-64 (scalar).
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedllm.kernels import int8_ops, ops, reference
from pagedllm.kernels.build import build_library
from tests.kernels.test_gguf_kernels import random_gguf

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
ROWS = [1, 2, 7, 20, 64, 300]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())


# build -> (expected kernel ISA names, CPU flags it needs)
BUILDS = {"native": (("avx512vnni", "avx2", "generic"), set()), "haswell": (("avx2",), {"avx2", "fma", "f16c", "bmi2"}),
          "x86-64": (("generic",), set())}  # fmt: skip


@functools.cache
def _library(march: str):
    return build_library(march)


@pytest.fixture(params=list(BUILDS))
def build(request, monkeypatch):
    """Each build of the library the CPU can run, standing in for the engine's."""
    march = request.param
    isas, needs = BUILDS[march]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())} for -march={march}")
    lib = _library(march)
    monkeypatch.setattr(ops, "load_kernels", lambda: lib)
    assert int8_ops.isa() in isas
    return march


def _weight(qtype: str, n: int, k: int, seed: int = 0):
    data = random_gguf(qtype, n, k, seed=seed)
    fields = reference.block_fields(data, qtype, k)
    return data, fields, reference.pack_int8_panels(fields, qtype)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """2 x (K/32 + 3) x 2^-24 x sum_k |x_k w_k| (see the module docstring)."""
    q, d, _ = reference.quantize_activations(x)
    xd = (q.double().reshape(q.shape[0], -1, 32) * d.double()[..., None]).reshape(q.shape)
    return 2 * (x.shape[1] / 32 + 3) * 2.0**-24 * (xd.abs() @ w.abs().T)


def test_the_fields_are_the_gguf_values_and_the_panels_round_trip():
    from pagedllm.kernels import gguf_ops

    for qtype in TYPES:
        data, fields, panels = _weight(qtype, 37, 256)
        want = gguf_ops.dequantize(data, qtype, 256)
        assert torch.equal(reference.dequantize_fields(fields, qtype).float(), want)
        back = reference.int8_panel_fields(panels, qtype, 37, 256)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(fields, back))
        assert panels.shape == (3, 8, reference.INT8_RECORD[qtype])
        if qtype != "Q4_0":  # the grouped layout (the tuned fp32 kernel's) gives the same fields
            grouped = reference.group_blocks(data, qtype, 37, 256)
            g = reference.grouped_fields(grouped, qtype, 37, 256)
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(fields, g))


def test_activation_quantization_is_the_twins(build):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, 256, generator=g) * torch.logspace(-3, 2, 256)  # blocks of very different scales
    x[3, :32] = 0.0  # an all-zero block: scale 0, quants 0
    x[4, 5] = 1e4  # an outlier
    got, want = int8_ops.quantize(x), reference.quantize_activations(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    q, d, s = want
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(s, q.view(33, 8, 32).sum(-1, dtype=torch.int32))
    assert float(d[3, 0]) == 0.0 and not q[3, :32].any()


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_gemm_matches_its_twin(build, qtype):
    n, k = 45, 576  # a partly filled last panel; SmolLM2's hidden size
    _, fields, panels = _weight(qtype, n, k, seed=len(qtype))
    w = reference.dequantize_fields(fields, qtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = int8_ops.linear(x, panels, qtype, n)
        want = reference.int8_linear(x, panels, qtype, n)
        err = (y.double() - want.double()).abs()
        bound = _bound(x, w)
        assert (err <= bound).all(), f"M={m}: error {float(err.max()):.3g} over the bound {float(bound.min()):.3g}"


def test_int8_gemm_writes_a_column_slice(build):
    """A fused layer's segments write their columns of one output (row stride > N)."""
    _, _, panels = _weight("Q4_1", 20, 128)
    x = torch.randn(9, 128)
    y = torch.full((9, 50), 7.0)
    int8_ops.linear(x, panels, "Q4_1", 20, y[:, 10:30])
    torch.testing.assert_close(y[:, 10:30], reference.int8_linear(x, panels, "Q4_1", 20), rtol=1e-5, atol=1e-4)
    assert (y[:, :10] == 7).all() and (y[:, 30:] == 7).all()


def test_int8_mode_stays_close_to_the_exact_product():
    """What the fast mode gives up, bounded: int8 x (1/254 of a block's max per element, half a
    step of 127) moves a dot product by at most sum_k |w_k| * amax_block(x) / 254."""
    _, fields, panels = _weight("Q4_1", 64, 512)
    w = reference.dequantize_fields(fields, "Q4_1")
    x = torch.randn(16, 512)
    exact = x.double() @ w.T
    amax = x.abs().view(16, 16, 32).amax(-1).double()  # [M, blocks]
    bound = amax @ w.abs().view(64, 16, 32).sum(-1).T / 254 + 1e-4
    assert ((reference.int8_linear(x, panels, "Q4_1", 64).double() - exact).abs() <= bound).all()
