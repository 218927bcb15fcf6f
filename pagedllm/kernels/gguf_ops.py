"""Matmuls and row lookups on weights kept in their GGUF blocks (``csrc/gguf_gemm.cpp``).

Types are the GGML ones (``gguf.GGMLQuantizationType``): F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. The pure-torch twins dequantize with the ``gguf``
package itself - the oracle: the native kernel's block values are bit-identical to it.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.kernels import ops

# GGML type name -> (type number, weights per block, bytes per block); gguf-py's constants.
GGUF_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}  # fmt: skip


# Up to this many rows the kernel makes one pass over the blocks (memory bound; csrc SMALL_M);
# above it, it builds fp32 panels on the fly, slower than panels kept in memory when those exist.
SMALL_ROWS = 6


def row_bytes(qtype: str, in_features: int) -> int:
    _, block, size = GGUF_TYPES[qtype]
    if in_features % block:
        raise ValueError(f"{qtype} rows hold whole blocks of {block} weights; {in_features} is not a multiple")
    return in_features // block * size


def dequantize(data: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """[rows, in_features] fp32 from [rows, row_bytes] uint8 blocks, by the gguf package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = data.shape[0]
    array = gguf_dequantize(data.numpy().reshape(rows, -1), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(rows, in_features))


def _check_rows(data: torch.Tensor, qtype: str, in_features: int) -> None:
    """The native kernels trust ``data``'s row width: a wrong one would read another layout."""
    if data.dim() != 2 or data.shape[1] != row_bytes(qtype, in_features):
        raise ValueError(f"{qtype} rows of {in_features} weights take {row_bytes(qtype, in_features)} bytes; "
                         f"the blocks are shaped {tuple(data.shape)}")  # fmt: skip


def _native_type(qtype: str) -> int | None:
    lib = ops.load_kernels() if ops.native_available() else None  # (tests swap ops.load_kernels)
    if lib is None or qtype not in GGUF_TYPES:
        return None
    type_id = GGUF_TYPES[qtype][0]
    return type_id if lib.gguf_type_supported(type_id) else None


def linear(
    x: torch.Tensor, data: torch.Tensor, qtype: str, out_features: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ W^T in fp32 for x [M, K], W = ``data`` ([out_features, row_bytes] GGUF blocks).

    ``out``: an fp32 [M, out_features] view to write into (rows may be strided: a column slice
    of a fused layer's output)."""
    K = x.shape[-1]
    type_id = _native_type(qtype) if x.is_cpu else None
    if type_id is None:
        y = x.float() @ dequantize(data, qtype, K).to(x.device).T
        return y if out is None else out.copy_(y)
    _check_rows(data, qtype, K)
    x32 = x.to(torch.float32).contiguous()
    y = torch.empty(x32.shape[0], out_features, dtype=torch.float32) if out is None else out
    assert y.dtype == torch.float32 and y.shape == (x32.shape[0], out_features) and y.stride(1) == 1
    status = ops.load_kernels().gguf_gemm_f32(
        y.data_ptr(), y.stride(0), x32.data_ptr(), K, data.data_ptr(), type_id, x32.shape[0], out_features, K,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"gguf_gemm_f32 refused a {qtype} weight with {K} inputs")
    return y


def get_rows(data: torch.Tensor, qtype: str, ids: torch.Tensor, in_features: int) -> torch.Tensor:
    """fp32 rows ``ids`` ([n] int64) of a GGUF tensor: an embedding lookup."""
    type_id = _native_type(qtype)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    # Both paths refuse the same ids (the twin would otherwise count negative ones from the end).
    if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= data.shape[0]):
        raise IndexError(f"row ids outside [0, {data.shape[0]})")
    if type_id is None:
        return dequantize(data[flat.cpu()], qtype, in_features).reshape(*ids.shape, in_features)
    _check_rows(data, qtype, in_features)
    out = torch.empty(len(flat), in_features, dtype=torch.float32)
    status = ops.load_kernels().gguf_get_rows_f32(
        out.data_ptr(), data.data_ptr(), type_id, flat.data_ptr(), len(flat), in_features, torch.get_num_threads()
    )
    if status != 0:
        raise ValueError(f"gguf_get_rows_f32 refused a {qtype} tensor with {in_features} weights per row")
    return out.reshape(*ids.shape, in_features)
