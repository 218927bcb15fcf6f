"""``--quantization int8|int4``: a Hugging Face checkpoint's linear weights quantized at load.

The weights become GGUF blocks and run on the same kernels as a GGUF file's (so the same
exactness rule holds: the quantized values are the model):
- int8: Q8_0, 32 weights per group, one fp16 scale each (symmetric);
- int4: Q4_1, 32 weights per group, an fp16 scale and minimum each (asymmetric).
The quantization is the ``gguf`` package's (llama.cpp's reference rounding). Embeddings, the
LM head and norms stay in the checkpoint's precision: they set the logits directly and are a
small share of a big model's bytes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from pagedllm.quantization.weights import QuantizedWeight

QUANTIZATION_TYPES = {"int8": "Q8_0", "int4": "Q4_1"}
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(experts\.\d+\.)?(gate|up|down|gate_up)_proj)\.weight")


def quantize_weight(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = weight.detach().to(torch.float32).contiguous().numpy()
    with np.errstate(over="ignore"):  # (an overflow is found below, and named)
        blocks = quantize(w, GGMLQuantizationType[qtype])
    # Each block starts with its fp16 scale (Q4_1: then its fp16 minimum): weights beyond
    # fp16's range (65,504) overflow them to inf, and the model would emit NaN.
    block_bytes, halves = _HEADER_HALVES[qtype]
    header = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, block_bytes)[:, : 2 * halves]
    if not np.isfinite(header.copy().view(np.float16)).all():
        raise ValueError(f"weights up to {float(np.abs(w).max()):.3g} overflow {qtype}'s fp16 block scales "
                         f"(65504 at most): this checkpoint cannot be quantized to it")  # fmt: skip
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), w.shape[1])


# Bytes per block, and the fp16 values that lead it (scale; scale and minimum).
_HEADER_HALVES = {"Q8_0": (34, 1), "Q4_1": (20, 2)}


def quantize_state(state: dict[str, Any], method: str) -> int:
    """Quantize the decoder's linear weights in place; returns how many."""
    if method not in QUANTIZATION_TYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_TYPES)}, got {method!r}")
    qtype = QUANTIZATION_TYPES[method]
    count = 0
    for name, w in list(state.items()):
        if isinstance(w, torch.Tensor) and w.dim() == 2 and _LINEAR.fullmatch(name):
            if w.shape[1] % 32:
                raise ValueError(f"{name} has {w.shape[1]} inputs, not a multiple of 32: cannot quantize to {method}")
            try:
                state[name] = quantize_weight(w, qtype)
            except ValueError as e:
                raise ValueError(f"quantization={method!r}: {name}: {e}") from None
            count += 1
    return count
