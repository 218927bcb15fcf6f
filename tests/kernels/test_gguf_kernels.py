"""The GGUF-block GEMM (csrc/gguf_gemm.cpp) against its twin: the gguf package's dequantize.

Random blocks of every type (scales drawn as finite fp16, quants as random bytes), every
batch-size class of the kernel: the small path (M <= 6, one pass over the blocks), the panel
path (M > 6) and more rows than one panel chunk (192). Block values must be bit-identical to
gguf's (embedding lookups return them as they are); products equal up to summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.kernels import gguf_ops, ops
from pagedllm.kernels.gguf_ops import GGUF_TYPES

# Byte offsets of the fp16 scale fields inside one block, per type (gguf-py's layouts).
_SCALE_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_gguf(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """[rows, row_bytes] uint8: random quants, finite random scales."""
    rng = np.random.default_rng(seed)
    if qtype in ("F32", "F16", "BF16"):
        dense = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32))
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return dense.to(dtype).view(torch.uint8).reshape(rows, -1).contiguous()
    _, block, size = GGUF_TYPES[qtype]
    n = rows * cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[qtype]:
        data[:, off : off + 2] = (rng.standard_normal((n, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return torch.from_numpy(data.reshape(rows, -1))


@pytest.mark.parametrize("qtype", list(GGUF_TYPES))
def test_gguf_gemm_matches_gguf_dequantize(qtype):
    assert ops.native_available()
    n, k = 37, 512  # an odd number of rows: a partly filled panel
    data = random_gguf(qtype, n, k, seed=len(qtype))
    dense = gguf_ops.dequantize(data, qtype, k)
    assert torch.isfinite(dense).all()
    for m in (1, 2, 5, 6, 7, 40, 200):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = gguf_ops.linear(x, data, qtype, n)
        want = (x.double() @ dense.double().T).float()
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        with ops.torch_only():  # the twin itself
            torch.testing.assert_close(gguf_ops.linear(x, data, qtype, n), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    ids = torch.tensor([[3, 0], [36, 3]])
    rows = gguf_ops.get_rows(data, qtype, ids, k)
    assert rows.shape == (2, 2, k) and torch.equal(rows, dense[ids])


def test_plain_types_with_k_not_a_multiple_of_32():
    """F16/BF16/F32 rows may have any length: the buffered path takes them."""
    for qtype in ("F16", "BF16", "F32"):
        data = random_gguf(qtype, 9, 50)
        dense = gguf_ops.dequantize(data, qtype, 50)
        for m in (1, 8):
            x = torch.randn(m, 50)
            torch.testing.assert_close(gguf_ops.linear(x, data, qtype, 9), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_gguf_get_rows_rejects_out_of_range_ids():
    data = random_gguf("Q4_0", 4, 64)
    with pytest.raises(IndexError):
        gguf_ops.get_rows(data, "Q4_0", torch.tensor([4]), 64)


def test_gguf_gemm_portable_build(monkeypatch):
    """The non-AVX2 code (scalar dequantization, buffered small path) built with -march=x86-64."""
    from pagedllm.kernels.build import build_library

    lib = build_library(march="x86-64")
    assert lib.pagedllm_kernels_isa() == b"generic"
    monkeypatch.setattr(ops, "load_kernels", lambda: lib)
    for qtype in GGUF_TYPES:  # every type: each has its own scalar dequantization (Q5_K's fifth bit was untested)
        data = random_gguf(qtype, 21, 256, seed=3)
        dense = gguf_ops.dequantize(data, qtype, 256)
        for m in (1, 9):
            x = torch.randn(m, 256)
            want = x @ dense.T
            torch.testing.assert_close(gguf_ops.linear(x, data, qtype, 21), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        assert torch.equal(gguf_ops.get_rows(data, qtype, torch.tensor([20, 1]), 256), dense[[20, 1]])
