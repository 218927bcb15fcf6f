"""Pure-torch twins of the native kernels: slow, obviously correct, and the fallback.

GGUF block layouts (32 weights per block, along the input dimension):
  Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of nibbles; weight j = d * q_j + m, where byte i
        holds q_i in its low nibble and q_{i+16} in its high nibble.
  Q8_0: fp16 scale d, 32 int8; weight j = d * q_j.
"""

from __future__ import annotations

import torch

QK = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def dequantize(packed: torch.Tensor, qtype: str, out_features: int, in_features: int) -> torch.Tensor:
    """[out_features, in_features] fp32 weights from [out_features, row_bytes] uint8 blocks."""
    nb = in_features // QK
    blocks = packed.reshape(out_features, nb, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    if qtype == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        qs = blocks[..., 4:20].to(torch.int16)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [N, nb, 32]
        w = d * q + m
    elif qtype == "Q8_0":
        q = blocks[..., 2:34].contiguous().view(torch.int8).float()
        w = d * q
    else:
        raise ValueError(f"unsupported GGUF block type {qtype!r}")
    return w.reshape(out_features, in_features)


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor:
    """x @ dequantize(W)^T in fp32."""
    w = dequantize(packed, qtype, out_features, x.shape[-1])
    return x.float() @ w.t()


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the Hugging Face layout: pairs are (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
