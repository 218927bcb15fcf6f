"""A linear layer that can also keep its weights in their GGUF blocks.

Three forms of the same weight, any of which a layer may hold: ``weight`` (dense, torch's
GEMM), ``panels`` (dense fp32 for the native GEMM), GGUF blocks - ``packed`` (Q4_1/Q8_0
regrouped for the tuned small-batch kernel) and ``quant`` (row segments in the file's own
blocks, any GGUF type, for ``kernels/gguf_ops.py`` at every batch size). A model too big for
an fp32 copy holds only ``quant``: resident weight memory stays the file's size.

A step of few tokens makes a matmul a pass over the weights: memory bound. Those run from
the packed blocks with the native kernel, which reads 0.6 (Q4_1) or 1.1 (Q8_0) bytes per
weight instead of 4. Bigger batches are compute bound and run a dense fp32 GEMM: the native
one on the weight repacked into 16-row panels (``pack_dense``; 1.2-2x MKL's sgemm here at 64
rows), else torch's. All compute in fp32 on the same weight values, so the choice changes
speed, not answers: the packed and panel kernels sum each output in the same order, so a row's
result has the same bits at any batch size (batch invariance).

The dense weight may be wider than the activations (bf16 values held in fp32 on CPUs without
bf16 arithmetic, see ``config.matmul_dtype``): the input is widened and the output rounded
back, so the layer still speaks the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import gguf_ops, ops, reference
from pagedllm.quantization.weights import QuantizedWeight

# Up to this many rows (tokens) the packed kernel beats the dense GEMM on this machine class;
# above it the dense path wins. All 121 linears of SmolLM2-135M, fp32, 2 cores (AMD EPYC Zen 3),
# packed blocks vs native dense panels: 8 rows 24.1 vs 45.9 ms, 16 rows 37.0 vs 44.3, 20 rows
# 45.5 vs 51.4, 24 rows 53.8 vs 50.3 ms. Both kernels give the same bits for a row (see
# kernels/csrc/grouped_gemm.cpp), so this threshold moves speed only, never a logit.
PACKED_MAX_ROWS = 20

# Bumped whenever any Linear's packed blocks or panels are set or replaced: code that captured their
# pointers (the one-call decoder stack) compares it instead of re-reading every pointer.
_packed_generation = 0


def packed_generation() -> int:
    return _packed_generation


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # GGUF blocks regrouped for the kernel (pagedllm/kernels/reference.py: group_blocks)
        self.packed: torch.Tensor | None = None
        self.qtype: str | None = None
        self._gemm = None  # the native kernel for self.packed, when the library is built
        # The dense weight as 16-row panels for the native GEMM (pagedllm/kernels/reference.py:
        # pack_panels), set by pack_dense.
        self.panels: torch.Tensor | None = None
        # Row segments in GGUF blocks (set_quant): each covers consecutive output rows.
        self.quant: list[QuantizedWeight] | None = None
        # activation_dtype="int8"/"int16": the weight as int8 panels (quantization/int8_activations.py).
        # When set, it is the layer's only form and every step runs on it.
        self.int8 = None
        # LoRA (pagedllm/lora/slots.py: LinearSlots): adds each adapter row's delta to the base
        # output, in place. Set only on engines with LoRA enabled.
        self.lora = None

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("packed", "panels", "int8"):  # the native decoder stack captured their pointers
            global _packed_generation
            _packed_generation += 1
        super().__setattr__(name, value)

    def set_packed(self, packed: torch.Tensor, qtype: str) -> None:
        """Keep GGUF blocks ([out_features, row_bytes] uint8) of this layer's weight."""
        if packed.shape[0] != self.out_features:
            raise ValueError(f"packed weight has {packed.shape[0]} rows, expected {self.out_features}")
        self.packed = reference.group_blocks(packed, qtype, self.out_features, self.in_features)
        self.qtype = qtype
        self._gemm = ops.grouped_gemm_fn(qtype, self.in_features)

    def set_quant(self, segments: list[QuantizedWeight], drop_dense: bool = False) -> None:
        """Keep the weight as GGUF row segments; ``drop_dense`` frees the dense forms."""
        rows = sum(s.out_features for s in segments)
        if rows != self.out_features or any(s.in_features != self.in_features for s in segments):
            raise ValueError(f"quantized weight of {rows} rows does not fit a {self.out_features}x{self.in_features} layer")
        self.quant = list(segments)
        if drop_dense:
            self.weight = None
            self.panels = None

    def set_int8(self, weight) -> None:
        """Run on int8 activations from now on (an ``int8_activations.Int8Weight``); the exact
        forms are released."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"int8 weight {weight.out_features}x{weight.in_features} does not fit a {self.out_features}x{self.in_features} layer")
        self.int8 = weight
        self.weight = self.panels = self.packed = self.quant = None
        self.qtype, self._gemm = None, None

    def _quant_forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        if len(self.quant) == 1:
            y = self.quant[0].linear(x32)
        else:  # each segment writes its columns of y
            y = torch.empty(x32.shape[0], self.out_features)
            start = 0
            for s in self.quant:
                s.linear(x32, y[:, start : start + s.out_features])
                start += s.out_features
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def pack_dense(self, keep_weight: bool = False) -> bool:
        """Move an fp32 dense weight on CPU into panels for the native GEMM. True if done.

        ``keep_weight`` for a weight that is also used elsewhere (an LM head tied to the
        embedding table); otherwise the panels replace it, holding the same values.
        """
        w = self.weight
        if self.panels is not None or w is None or w.dtype != torch.float32 or not w.is_cpu:
            return False
        if not ops.native_available():
            return False
        self.panels = reference.pack_panels(w)
        if not keep_weight:
            self.weight = None
        return True

    def step_nbytes(self) -> int:
        """Bytes of weight a one-row step reads: the form small steps run on (GGUF blocks, int8
        panels, row segments), else the dense weight (speculative decoding prices drafts by it)."""
        if self.packed is not None:
            return self.packed.numel()
        if self.int8 is not None:
            return self.in_features * self.out_features
        if self.quant is not None:
            return sum(s.nbytes for s in self.quant)
        dense = self.weight if self.weight is not None else self.panels
        return 0 if dense is None else dense.numel() * dense.element_size()

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.weight.dtype if self.panels is None and self.weight is not None else torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.base_forward(x)
        y = self.base_forward(x)
        self.lora.add_delta(x, y)
        return y

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's own output, from whichever form of the weight serves this many rows
        (always a new tensor, which LoRA adds to in place)."""
        if self.int8 is not None:  # the opt-in fast mode
            return self.int8.forward(x, self.bias)
        if self.packed is not None and x.shape[0] <= PACKED_MAX_ROWS:
            if self._gemm is not None and ops.enabled() and x.dtype is torch.float32 and x.is_cpu and x.is_contiguous():
                # The hot path of single-stream decoding: no checks or copies beyond these.
                y = torch.empty(x.shape[0], self.out_features)
                self._gemm(y.data_ptr(), x.data_ptr(), self.packed.data_ptr(), x.shape[0],
                           self.out_features, self.in_features, torch.get_num_threads())
            else:
                y = ops.grouped_linear(x, self.packed, self.qtype, self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.quant is not None and (x.shape[0] <= gguf_ops.SMALL_ROWS or (self.panels is None and self.weight is None)):
            return self._quant_forward(x)
        if self.panels is not None:
            return ops.panel_linear(x, self.panels, self.out_features, self.bias)
        if x.dtype is not self.weight.dtype:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        packed = f", packed={self.qtype}" if self.packed is not None else ""
        if self.int8 is not None:
            packed += ", int8=" + self.int8.qtypes
        if self.quant is not None:
            packed += ", quant=" + "+".join(s.qtype for s in self.quant)
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{packed}"
