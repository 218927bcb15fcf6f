"""The fast modes' GEMM (csrc/int8_gemm.cpp): int8 or wide (int16, as two int8 halves)
activations x Q4_0/Q4_1/Q8_0 int8 panels, against its twin (reference.int8_linear: the same quantized x and dequantized weights, in fp64).

The kernel's block sums are exact integers; what it rounds is the fp32 scaling of each block
(cvt, x dw, fma with dx: ~3 roundings of a block's term) and the running sum over the K/32
blocks. So |kernel - twin| <= (K/32 + 3) * 2^-24 * sum_k |x_k w_k| per output, up to second-order
terms; the tests allow twice that. Every build the CPU can run: native (AMX or AVX512-VNNI
where the CPU has them), haswell (AVX2: vpmaddubsw) and x86-64 (scalar). The AMX path also runs
on an AVX512-VNNI CPU over a scalar model of its tile instructions (PAGEDLLM_AMX_EMULATE), and
must give the VNNI tiles' bits; on an AMX CPU the real instructions are held to the same.
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
BUILDS = {"native": (("amx-int8", "avx512vnni", "avx2", "generic"), set()), "haswell": (("avx2",), {"avx2", "fma", "f16c", "bmi2"}),
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


def _bound(x: torch.Tensor, w: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """2 x (K/32 + 3) x 2^-24 x sum_k |x_k w_k| (see the module docstring)."""
    q, d, _ = reference.quantize_activations(x, bits)
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


@pytest.mark.parametrize("bits", [8, 16])
def test_activation_quantization_is_the_twins(build, bits):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, 256, generator=g) * torch.logspace(-3, 2, 256)  # blocks of very different scales
    x[3, :32] = 0.0  # an all-zero block: scale 0, quants 0
    x[4, 5] = 1e4  # an outlier
    got, want = int8_ops.quantize(x, bits), reference.quantize_activations(x, bits)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    q, d, s = want
    top = reference.ACTIVATION_LEVELS[bits]
    assert int(q.abs().max()) == top and int(q.min()) >= -top
    assert torch.equal(s, q.view(33, 8, 32).sum(-1, dtype=torch.int32))
    assert float(d[3, 0]) == 0.0 and not q[3, :32].any()


def test_wide_quants_split_into_two_int8_halves():
    q = torch.arange(-32258, 32259, dtype=torch.int32).to(torch.int16)  # every wide quant
    q1, q2 = reference.split_wide(q)
    assert torch.equal(254 * q1.to(torch.int32) + q2.to(torch.int32), q.to(torch.int32))
    assert int(q1.min()) == -127 and int(q1.max()) == 127 and int(q2.min()) == -127 and int(q2.max()) == 126


def test_the_kernels_wide_halves_are_the_twins_split_for_every_quant(build):
    """Every wide quant Q in [-32258, 32258] (blocks whose largest |x| is 32258, so Q = x) comes
    out of the kernel as split_wide's halves, whichever division the build's path uses."""
    values = torch.arange(-32258, 32259, dtype=torch.float32)
    per_block = reference.QK - 1
    blocks = -(-values.numel() // per_block)
    rows = -(-blocks // 8)
    x = torch.zeros(rows * 8, reference.QK)
    x[:, 0] = 32258.0
    body = torch.zeros(rows * 8 * per_block)
    body[: values.numel()] = values
    x[:, 1:] = body.view(rows * 8, per_block)
    x = x.view(rows, 8 * reference.QK)
    m, k = x.shape
    q1, q2 = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k, dtype=torch.int8)
    d, s = torch.empty(m, k // reference.QK), torch.empty(m, k // reference.QK, dtype=torch.int32)
    ops.load_kernels().int8_quantize_rows(q1.data_ptr(), q2.data_ptr(), d.data_ptr(), s.data_ptr(), x.data_ptr(), k,
                                          m, k, 16, 2)  # fmt: skip
    want_q, _, _ = reference.quantize_activations(x, 16)
    assert torch.equal(want_q.to(torch.float32), x)  # the blocks hold the quants themselves
    want1, want2 = reference.split_wide(want_q)
    assert torch.equal(q1, want1) and torch.equal(q2, want2)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("qtype", TYPES)
def test_int8_gemm_matches_its_twin(build, qtype, bits):
    n, k = 45, 576  # a partly filled last panel; SmolLM2's hidden size
    _, fields, panels = _weight(qtype, n, k, seed=len(qtype))
    w = reference.dequantize_fields(fields, qtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        x[0, :32] *= 1e3  # a block of large values: the Q8_0 wide block sums pass 2^24
        y = int8_ops.linear(x, panels, qtype, n, bits=bits)
        want = reference.int8_linear(x, panels, qtype, n, bits)
        err = (y.double() - want.double()).abs()
        bound = _bound(x, w, bits)
        assert (err <= bound).all(), f"M={m}: error {float(err.max()):.3g} over the bound {float(bound.min()):.3g}"


@pytest.mark.parametrize("bits", [8, 16])
def test_int8_gemm_writes_a_column_slice(build, bits):
    """A fused layer's segments write their columns of one output (row stride > N)."""
    _, _, panels = _weight("Q4_1", 20, 128)
    x = torch.randn(9, 128)
    y = torch.full((9, 50), 7.0)
    int8_ops.linear(x, panels, "Q4_1", 20, y[:, 10:30], bits)
    torch.testing.assert_close(y[:, 10:30], reference.int8_linear(x, panels, "Q4_1", 20, bits), rtol=1e-5, atol=1e-4)
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


def test_wide_mode_is_256_times_closer_to_the_exact_product():
    """Wide quants are half a step of 32258 off: a dot product moves by at most
    sum_k |w_k| * amax_block(x) / 64516, and the measured error is far below int8's."""
    _, fields, panels = _weight("Q4_1", 64, 512)
    w = reference.dequantize_fields(fields, "Q4_1")
    x = torch.randn(16, 512)
    exact = x.double() @ w.T
    amax = x.abs().view(16, 16, 32).amax(-1).double()
    bound = amax @ w.abs().view(64, 16, 32).sum(-1).T / 64516 + 1e-4
    wide = (int8_ops.linear(x, panels, "Q4_1", 64, bits=16).double() - exact).abs()
    narrow = (int8_ops.linear(x, panels, "Q4_1", 64, bits=8).double() - exact).abs()
    assert (wide <= bound).all()
    assert float(wide.mean()) < float(narrow.mean()) / 50


AMX_NEEDS = {"avx512f", "avx512bw", "avx512_vnni"}  # the emulated AMX path's own instructions


def _amx_libraries():
    """(name, library) of each AMX path this CPU runs: the emulated one wherever it has
    AVX512-VNNI, and the native build's real tiles where the CPU has AMX."""
    libs = []
    if AMX_NEEDS <= _cpu_flags():
        libs.append(("emulated", build_library("native", ("PAGEDLLM_AMX_EMULATE",))))
    if {"amx_tile", "amx_int8"} <= _cpu_flags():
        libs.append(("native", _library("native")))
    return libs


@pytest.mark.parametrize("which", ["emulated", "native"])
def test_amx_tiles_give_the_vnni_tiles_bits(which, monkeypatch):
    """Rows in whole 16-row tiles go through AMX, the rest through the VNNI tiles; a row's
    outputs must be bit for bit what the VNNI tiles give it alone (batch invariance)."""
    libs = dict(_amx_libraries())
    if which not in libs:
        need = AMX_NEEDS if which == "emulated" else {"amx_tile", "amx_int8"}
        pytest.skip(f"this CPU lacks {sorted(need - _cpu_flags())} for the {which} AMX path")
    monkeypatch.setattr(ops, "load_kernels", lambda: libs[which])
    try:
        granted = int8_ops.use_amx(True)
        if which == "native" and not granted:
            pytest.skip("this CPU has AMX, but Linux did not grant the process the tile state (arch_prctl)")
        assert granted
        assert int8_ops.isa() == ("amx-int8-emulated" if which == "emulated" else "amx-int8")
        for qtype in TYPES:
            for n, k in [(45, 576), (32, 1536)]:  # panel pairs and a single last panel; two K
                _, _, panels = _weight(qtype, n, k, seed=n + k)
                x = torch.randn(300, k, generator=torch.Generator().manual_seed(k))
                x[0, :32] *= 1e3
                for bits in (8, 16):
                    for m in (16, 20, 33, 64, 300):  # 300: chunks of 128, 128 and 44 rows
                        int8_ops.use_amx(True)
                        tiles = int8_ops.linear(x[:m], panels, qtype, n, bits=bits)
                        int8_ops.use_amx(False)
                        vnni = int8_ops.linear(x[:m], panels, qtype, n, bits=bits)
                        alone = int8_ops.linear(x[m - 1 : m], panels, qtype, n, bits=bits)
                        assert torch.equal(tiles, vnni), f"{qtype} {n}x{k} bits={bits} M={m}: AMX differs from VNNI"
                        assert torch.equal(tiles[m - 1 :], alone)
    finally:
        int8_ops.use_amx(True)


def test_amx_build_compiles():
    """The real AMX path compiles and uses the tile instructions (-march=sapphirerapids), on any
    CPU: the library is inspected, never loaded."""
    import subprocess

    from pagedllm.kernels.build import library_path

    path = library_path(march="sapphirerapids")
    code = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    for instr in ("ldtilecfg", "tileloadd", "tdpbsud", "tdpbssd", "tilestored", "tilerelease"):
        assert instr in code, instr
    exported = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    assert "int8_gemm_use_amx" in exported.stdout
    assert b"amx-int8\0" in path.read_bytes()
