"""A weight matrix kept in GGUF blocks, and how a model holds it.

``QuantizedWeight`` is what the loaders hand to the model instead of an fp32 tensor when the
weights stay packed: [out_features, row_bytes] uint8 in one GGML block type. A fused layer
(q/k/v, gate/up) is the row-wise concatenation of its parts; GGUF files often mix types
there (Q4_K_M stores v_proj as Q6_K beside Q4_K q/k), so a layer holds a list of row
segments, each of one type (``cat_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels import gguf_ops


@dataclass
class QuantizedWeight:
    qtype: str  # a GGML type name: Q4_0, Q4_K, F16, ... (gguf_ops.GGUF_TYPES)
    data: torch.Tensor  # [out_features, row_bytes] uint8
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in gguf_ops.GGUF_TYPES:
            raise ValueError(f"unsupported GGUF weight type {self.qtype!r}")
        if self.data.dim() != 2 or self.data.shape[1] != gguf_ops.row_bytes(self.qtype, self.in_features):
            raise ValueError(f"{self.qtype} data of shape {tuple(self.data.shape)} does not hold rows of {self.in_features}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features]: the native kernel's rows (bit-identical to the
        gguf package's, ~10x faster at startup) when it is built, else the package's."""
        rows = torch.arange(self.data.shape[0])
        return gguf_ops.get_rows(self.data, self.qtype, rows, self.in_features)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return gguf_ops.linear(x, self.data, self.qtype, self.out_features, out)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "QuantizedWeight":
        """An fp32 tensor as an "F32" segment (a fused layer whose other parts are packed)."""
        w = weight.detach().to(torch.float32).contiguous()
        return cls("F32", w.view(torch.uint8).reshape(w.shape[0], -1), w.shape[1])


Weight = torch.Tensor | QuantizedWeight | list[QuantizedWeight]


def segments(weight: Weight) -> list[QuantizedWeight]:
    if isinstance(weight, QuantizedWeight):
        return [weight]
    if isinstance(weight, torch.Tensor):
        return [QuantizedWeight.from_dense(weight)]
    return list(weight)


def is_quantized(weight: object) -> bool:
    return isinstance(weight, (QuantizedWeight, list))


def cat_rows(parts: list[Weight], merge: bool = True) -> Weight:
    """Row-wise concatenation: an fp32 tensor when every part is one, else row segments.

    ``merge`` joins consecutive segments of one type into one (a copy: fewer kernel calls per
    step); without it the segments keep their storage - a memory-mapped file's pages."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    out: list[QuantizedWeight] = []
    for seg in (s for p in parts for s in segments(p)):
        if merge and out and out[-1].qtype == seg.qtype and out[-1].in_features == seg.in_features:
            out[-1] = QuantizedWeight(seg.qtype, torch.cat([out[-1].data, seg.data]), seg.in_features)
        else:
            out.append(seg)
    return out[0] if len(out) == 1 else out


def weight_shape(weight: Weight) -> torch.Size:
    segs = segments(weight) if is_quantized(weight) else None
    if segs is None:
        return weight.shape
    return torch.Size((sum(s.out_features for s in segs), segs[0].in_features))


def dequantize(weight: Weight) -> torch.Tensor:
    """The fp32 values of a weight in any form (the gguf package's dequantization)."""
    if isinstance(weight, torch.Tensor):
        return weight
    return torch.cat([s.dequantize() for s in segments(weight)])


class QuantizedEmbedding(nn.Module):
    """A token embedding table kept in GGUF blocks: a lookup dequantizes only its rows."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.qweight = weight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = gguf_ops.get_rows(self.qweight.data, self.qweight.qtype, ids, self.embedding_dim)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qweight.qtype}"
