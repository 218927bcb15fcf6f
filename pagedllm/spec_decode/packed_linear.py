"""Drafting weights as Q8_0 blocks on the tuned small-batch kernel.

A drafting head runs once per drafted token, one row per drafting request, so its speed is
the time to read its weights: Q8_0 blocks are 1.06 bytes per weight instead of fp32's 4. The
rounding (one fp16 scale per 32 weights) changes a draft now and then, never an answer: the
target verifies every drafted token.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.kernels import ops, reference
from pagedllm.quantization.weight_only import quantize_weight

QTYPE = "Q8_0"


class PackedLinear(nn.Module):
    """y = x @ W^T (+ b) (fp32) from W's Q8_0 blocks in the grouped kernel's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        blocks = quantize_weight(weight, QTYPE).data
        self.grouped = reference.group_blocks(blocks, QTYPE, self.out_features, self.in_features)
        self.bias = None if bias is None else bias.detach().float().clone()

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether the native kernel takes this weight (whole blocks of 32 inputs, library built)."""
        return weight.dim() == 2 and weight.shape[1] % reference.QK == 0 and ops.native_available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.grouped_linear(x, self.grouped, QTYPE, self.out_features)
        return y if self.bias is None else y + self.bias

    def step_nbytes(self) -> int:
        """Bytes one drafting step reads (``draft_length.step_nbytes`` prices drafts by it)."""
        return self.grouped.numel()


def pack_linears(module: nn.Module) -> int:
    """Replace each ``nn.Linear`` inside ``module`` that fits with a ``PackedLinear`` of its
    weight (and bias); returns how many."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and PackedLinear.fits(child.weight):
                setattr(parent, name, PackedLinear(child.weight.detach().float(), child.bias))
                count += 1
    return count


def draft_lm_head(lm_head: nn.Module, d2t: torch.Tensor) -> nn.Module:
    """The rows ``d2t`` of the target's LM head (a ``model.linear.Linear``, whatever form it
    holds them in: read back through its own forward, 64 inputs at a time), as Q8_0 blocks
    when the kernel takes them, else an fp32 ``nn.Linear``."""
    hidden = lm_head.in_features
    eye = torch.eye(hidden)
    with torch.inference_mode():
        zero = lm_head.base_forward(eye[:1] * 0).float()[:, d2t]  # a bias, if any, is not a weight
        cols = [lm_head.base_forward(eye[i : i + 64]).float()[:, d2t] - zero for i in range(0, hidden, 64)]
    weight = torch.cat(cols).T.contiguous()  # [draft vocab, hidden]
    if PackedLinear.fits(weight):
        return PackedLinear(weight)
    linear = nn.Linear(hidden, weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear.requires_grad_(False)
