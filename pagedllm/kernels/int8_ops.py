"""The fast mode's matmul: int8 activations x GGUF integer weights (``csrc/int8_gemm.cpp``).

``linear`` quantizes x in 32-wide blocks and multiplies with integer instructions; where the
library is not built it runs the twin (``reference.int8_linear``), which computes the same
function in fp64. Weights are int8 panels (``reference.pack_int8_panels``).
"""

from __future__ import annotations

import torch

from pagedllm.kernels import ops, reference


def _lib():
    return ops.load_kernels() if ops.native_available() else None  # (tests swap ops.load_kernels)


def isa() -> str | None:
    """The integer instructions the kernel uses ("amx-int8" for steps of 16 rows or more, else
    "avx512vnni", "avx2", "generic"), None without it."""
    lib = _lib()
    return None if lib is None else lib.int8_gemm_isa().decode()


def use_amx(enabled: bool) -> bool:
    """Let (or stop) steps of 16 rows or more use the AMX tiles; True when they will. Their
    outputs have the same bits as the VNNI tiles' (tests compare the two in one process)."""
    lib = _lib()
    return lib is not None and bool(lib.int8_gemm_use_amx(int(enabled)))


def quantize(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [M, K], d fp32 [M, K/32], s int32 [M, K/32]) of x [M, K], natively when built: q int8
    (bits 8), or int16 for wide activations (bits 16: the kernel's halves, put together)."""
    lib = _lib()
    if lib is None:
        return reference.quantize_activations(x, bits)
    x32 = x.to(torch.float32).contiguous()
    m, k = x32.shape
    q = torch.empty(m, k, dtype=torch.int8)
    q2 = torch.empty(m, k if bits == 16 else 0, dtype=torch.int8)
    d = torch.empty(m, k // reference.QK, dtype=torch.float32)
    s = torch.empty(m, k // reference.QK, dtype=torch.int32)
    lib.int8_quantize_rows(q.data_ptr(), q2.data_ptr(), d.data_ptr(), s.data_ptr(), x32.data_ptr(), k, m, k, bits,
                           torch.get_num_threads())  # fmt: skip
    if bits == 16:
        return (254 * q.to(torch.int16) + q2.to(torch.int16)), d, s
    return q, d, s


def linear(x: torch.Tensor, panels: torch.Tensor, qtype: str, out_features: int, out: torch.Tensor | None = None,
           bits: int = 8) -> torch.Tensor:  # fmt: skip
    """y = quantize(x, bits) @ W^T in fp32 for x [M, K], W in int8 panels of ``qtype`` (Q4_0 /
    Q4_1 / Q8_0); ``bits`` 8 (int8 activations) or 16 (wide: two int8 halves per quant).

    ``out``: an fp32 [M, out_features] view to write into (rows may be strided)."""
    lib = _lib() if x.is_cpu else None
    if lib is None:
        y = reference.int8_linear(x, panels, qtype, out_features, bits)
        return y if out is None else out.copy_(y)
    x32 = x.to(torch.float32).contiguous()
    m, k = x32.shape
    y = torch.empty(m, out_features, dtype=torch.float32) if out is None else out
    status = lib.int8_gemm_f32(y.data_ptr(), y.stride(0), x32.data_ptr(), k, panels.data_ptr(),
                               reference.INT8_TYPES[qtype], m, out_features, k, bits, torch.get_num_threads())  # fmt: skip
    if status != 0:
        raise ValueError(f"int8_gemm_f32 refused a {qtype} weight with {k} inputs")
    return y
