"""``activation_dtype="int8"`` / ``"int16"``: the opt-in fast modes - integer activations x GGUF
integer weights.

The default (``float32``) multiplies fp32 activations by the exact dequantized weights: greedy
parity with transformers and batch invariance hold. This mode trades that for speed, the way
llama.cpp computes: before each linear whose weights are Q4_0 / Q4_1 / Q8_0 blocks, every row of
x is quantized in 32-wide blocks to int8 with an fp32 scale (and the block's sum, for Q4_1's
minimum), and the dot products run on integer instructions (``csrc/int8_gemm.cpp``: AVX512-VNNI,
else AVX2, else scalar) with exact int32 block sums, scaled in fp32. A row's result depends only
on that row (its own scales), so batching still does not change answers; the quantization of x
does (docs/quantization.md, "Fast mode", has the measured agreement and speed).

``int16`` quantizes each block to 16 bits instead (levels +-32258, 256 times finer) and runs the
same kernel twice per block, on the two int8 halves of each quant: about twice int8's dot
products, still integer instructions, and close enough to fp32 that the greedy outputs of the
parity prompts do not change.

Everything happens here, once, after the model is loaded (``convert_model``): each eligible
``Linear`` gets an ``Int8Weight`` (``Linear.set_int8``), its weight repacked into the kernel's
int8 panels (0.625 bytes per weight for Q4_x, 1.125 for Q8_0, their fp16 scales included); the layer's exact
forms (fp32 copy/panels, grouped blocks) are then released. Layers of other types, and those in
``keep_exact``, stay on the fp32 path, and the startup log says which.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import int8_ops, reference

logger = logging.getLogger("pagedllm.quantization")

# Linears that stay exact in int8 mode, by name (a suffix of the module name, e.g. "lm_head" or
# "mlp.down_proj"). Measured on SmolLM2-135M Q4_1 (docs/quantization.md): none needs it.
DEFAULT_KEEP_EXACT: tuple[str, ...] = ()


@dataclass
class Int8Segment:
    """Consecutive output rows of one block type, as int8 panels (``reference.pack_int8_panels``)."""

    qtype: str
    panels: torch.Tensor  # [ceil(rows/16), in_features/32, record] uint8
    out_features: int
    in_features: int


class Int8Weight:
    """A linear's weight for the int8 kernel: row segments (a fused layer may mix Q4_0/Q4_1/Q8_0),
    each writing its columns of y."""

    def __init__(self, segments: list[Int8Segment], bits: int = 8):
        self.segments = segments
        self.bits = bits  # the activations' quants: 8 (int8) or 16 (wide)
        self.out_features = sum(s.out_features for s in segments)
        self.in_features = segments[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(s.panels.numel() for s in self.segments)

    @property
    def qtypes(self) -> str:
        return "+".join(dict.fromkeys(s.qtype for s in self.segments))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = quantize(x) @ W^T (+ bias), computed in fp32, returned in x's dtype."""
        x2 = x.reshape(-1, self.in_features)
        if len(self.segments) == 1:
            s = self.segments[0]
            y = int8_ops.linear(x2, s.panels, s.qtype, s.out_features, bits=self.bits)
        else:
            y = torch.empty(x2.shape[0], self.out_features)
            start = 0
            for s in self.segments:
                int8_ops.linear(x2, s.panels, s.qtype, s.out_features, y[:, start : start + s.out_features], self.bits)
                start += s.out_features
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


# A ``model.linear.Linear`` (this package sits below the model's: it sees layers by their fields).
Linear = Any


def _fields(linear: Linear) -> list[tuple[str, reference.Fields]] | str:
    """The layer's weight as (type, fields) row segments, or why it has no integer kernel."""
    if linear.packed is not None:  # grouped Q4_1 / Q8_0 (the tuned small-batch kernel's layout)
        fields = reference.grouped_fields(linear.packed, linear.qtype, linear.out_features, linear.in_features)
        return [(linear.qtype, fields)]
    if linear.quant is None:
        return "no GGUF blocks"
    others = sorted({s.qtype for s in linear.quant} - reference.INT8_TYPES.keys())
    if others:
        return f"{'/'.join(others)} has no integer kernel"
    return [(s.qtype, reference.block_fields(s.data, s.qtype, s.in_features)) for s in linear.quant]


def int8_weight(linear: Linear, bits: int = 8) -> Int8Weight | str:
    """The layer's ``Int8Weight`` (for ``bits``-bit activations), or why it cannot have one."""
    if linear.in_features % reference.QK:
        return f"{linear.in_features} inputs are not whole blocks of 32"
    found = _fields(linear)
    if isinstance(found, str):
        return found
    segments = [Int8Segment(qtype, reference.pack_int8_panels(f, qtype), f[0].shape[0], linear.in_features)
                for qtype, f in found]  # fmt: skip
    return Int8Weight(segments, bits)


@dataclass
class Int8Report:
    """What ``convert_model`` did, for the startup log and the benchmarks."""

    converted: dict[str, str] = field(default_factory=dict)  # layer name -> block types
    kept: dict[str, str] = field(default_factory=dict)  # layer name -> why it stays fp32
    int8_bytes: int = 0  # the int8 panels
    released_bytes: int = 0  # the converted layers' exact forms, dropped
    isa: str | None = None  # the kernel's instructions (None: the torch twin runs)
    bits: int = 8  # the activations' quants


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.is_meta else t.numel() * t.element_size()


def convert_model(model: nn.Module, keep_exact: tuple[str, ...] = DEFAULT_KEEP_EXACT, bits: int = 8) -> Int8Report:
    """Give every linear with Q4_0 / Q4_1 / Q8_0 blocks (and not named in ``keep_exact``) its int8
    weight for ``bits``-bit activations (8, or 16: wide), releasing its exact forms. Idempotent."""
    report = Int8Report(isa=int8_ops.isa(), bits=bits)
    for name, module in model.named_modules():
        if not hasattr(module, "set_int8"):  # not a Linear
            continue
        if module.int8 is not None:
            module.int8.bits = bits
            report.converted[name] = module.int8.qtypes
            report.int8_bytes += module.int8.nbytes
            continue
        if any(name == k or name.endswith("." + k) for k in keep_exact):
            report.kept[name] = "kept exact (keep_exact)"
            continue
        weight = int8_weight(module, bits)
        if isinstance(weight, str):
            report.kept[name] = weight
            continue
        # Only the layer's own copies are released (a tied LM head's table stays with the embedding).
        report.released_bytes += _nbytes(module.panels) + _nbytes(module.packed)
        if module.weight is not None and module.weight is not getattr(getattr(model, "embed_tokens", None), "weight", None):
            report.released_bytes += _nbytes(module.weight)
        module.set_int8(weight)
        report.converted[name] = weight.qtypes
        report.int8_bytes += weight.nbytes
    return report


def log_report(report: Int8Report) -> None:
    types = sorted({t for v in report.converted.values() for t in v.split("+")})
    kernel = f"integer kernel: {report.isa}" if report.isa else "no native kernel: the torch twin runs (slow)"
    mode = f"int{report.bits}"
    logger.info("activation_dtype=%s: %d linear layers (%s) take %s activations (%s); int8 panels %.1f MiB, "
                "their exact forms released (%.1f MiB)", mode, len(report.converted), "/".join(types) or "-", mode,
                kernel, report.int8_bytes / 2**20, report.released_bytes / 2**20)  # fmt: skip
    if report.kept:
        reasons: dict[str, list[str]] = {}
        for name, why in report.kept.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            logger.info("activation_dtype=int%d: %d linear layer(s) stay on the fp32 path (%s): %s", report.bits,
                        len(names), why, shown)  # fmt: skip
