"""The slot table: ``max_loras`` preallocated slots of every adaptable linear's A and B, and
the step's row mapping that decides which rows get which slot's delta.

The model fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj``. A slot
holds, per fused linear, the adapter's A matrices of all its parts side by side and its B
matrices as one block-diagonal matrix, scaling folded in::

    a[slot]  [in, W]:   [ A_q.T | A_k.T | A_v.T | 0 ]          (W = parts x max_lora_rank)
    b[slot]  [W, out]:  [ s*B_q.T    0        0   ]   rows 0..r
                        [   0     s*B_k.T     0   ]   rows r..2r
                        [   0        0     s*B_v.T]   rows 2r..3r

so one step adds ``(x @ a[slot][:, :w]) @ b[slot][:w]`` to the fused output: two GEMMs per
adapter and linear, whatever the number of parts, over only the ``w`` columns the adapter
fills (``width[slot]``). Rows of a step are grouped by adapter (the runner orders the
batch so), so each adapter's rows are one or two contiguous runs: ``StepMapping.runs``.

Measured against a gather-BMM (each row gathering its slot's A and B, one ``bmm`` for all
rows) on SmolLM2-135M's shapes: see docs/lora.md; the segmented GEMMs won at every batch
size that matters (the gather copies each row's whole B, up to 3072 x W floats).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels import ops
from pagedllm.kernels.reference import pack_panels
from pagedllm.lora.adapter import LoRAAdapter, TargetShapes

# Our linears, and the Hugging Face modules (with their column range) each one fuses.
_QKV, _O, _GATE_UP, _DOWN = "qkv_proj", "o_proj", "gate_up_proj", "down_proj"


@dataclass
class StepMapping:
    """This step's rows with an adapter: ``runs`` of (slot, first row, end row), contiguous
    row ranges of one slot each; rows in no run get no delta."""

    runs: list[tuple[int, int, int]]


class LoRAContext:
    """One per model (so per engine): the runner sets ``mapping`` for a step and clears it
    after; every adapted linear reads it. None (no adapter rows) costs a linear one test."""

    def __init__(self) -> None:
        self.mapping: StepMapping | None = None


class LinearSlots:
    """One linear's slots: a [max_loras, in, W], b [max_loras, W, out] (zeros when empty),
    and per slot how many of the W columns the loaded adapter fills."""

    def __init__(self, context: LoRAContext, parts: dict[str, tuple[int, int]], in_features: int,
                 out_features: int, max_loras: int, max_rank: int):  # fmt: skip
        self.context = context
        self.parts = parts  # Hugging Face module -> its output columns (start, end)
        capacity = max_rank * max(1, sum(1 for m in parts if m not in (_QKV, _GATE_UP)))
        self.a = torch.zeros(max_loras, in_features, capacity)
        self.b = torch.zeros(max_loras, capacity, out_features)
        self.width = [0] * max_loras
        # Per slot, its A and B packed for the native dense GEMM (made at first use).
        self._panels: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras

    def load(self, slot: int, adapter: LoRAAdapter, layer: int) -> None:
        """Copy the adapter's matrices for this linear into ``slot`` (emptying it first)."""
        w = self.width[slot]
        if w:
            self.a[slot, :, :w].zero_()
            self.b[slot, :w].zero_()
        off = 0
        for module, (c0, c1) in self.parts.items():
            ab = adapter.weights.get((layer, module))
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            self.a[slot, :, off : off + r] = a.t()
            self.b[slot, off : off + r, c0:c1] = b.t() * adapter.scaling
            off += r
        self.width[slot] = off
        self._panels[slot] = None

    def clear(self, slot: int) -> None:
        w = self.width[slot]
        if w:
            self.a[slot, :, :w].zero_()
            self.b[slot, :w].zero_()
            self.width[slot] = 0
        self._panels[slot] = None

    def _slot_panels(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        panels = self._panels[slot]
        if panels is None:
            w = self.width[slot]
            panels = self._panels[slot] = (pack_panels(self.a[slot, :, :w].t()), pack_panels(self.b[slot, :w].t()))
        return panels

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of each run] += x[rows] @ a[slot] @ b[slot], in place (y is the base output).

        Each row's sums in one fixed order, whatever the number of rows: ``torch.mm`` sums a
        row in another order once a run has 4 or more rows, so a request's logits depended on
        how many rows of its adapter shared the step (a verifying step of drafts always has
        several; docs/determinism.md). The native dense GEMM (k sequential per column) where it
        runs, else a batch of one-row products."""
        mapping = self.context.mapping
        if mapping is None:
            return
        native = ops.native_available() and x.is_cpu
        for slot, start, end in mapping.runs:
            w = self.width[slot]
            if not w:
                continue
            xs = x[start:end]
            if xs.dtype is not torch.float32:
                xs = xs.float()
            ys = y[start:end]
            if native:
                pa, pb = self._slot_panels(slot)
                delta = ops.panel_linear(ops.panel_linear(xs, pa, w), pb, ys.shape[1])
            else:
                n = end - start
                a, b = self.a[slot, :, :w], self.b[slot, :w]
                xa = torch.bmm(xs.unsqueeze(1), a.expand(n, *a.shape))  # [n, 1, w]
                delta = torch.bmm(xa, b.expand(n, *b.shape)).squeeze(1)
            # (a bf16 model: the delta in fp32, rounded once when added)
            ys.add_(delta if ys.dtype is torch.float32 else delta.to(ys.dtype))


class SlotTable:
    """Every adaptable linear of a model with its ``LinearSlots``; what an adapter may target
    (``target_shapes``); loading an adapter into a slot."""

    def __init__(self, model, max_loras: int, max_rank: int):
        self.context = LoRAContext()
        self.max_loras, self.max_rank = max_loras, max_rank
        self.layers: list[dict[str, LinearSlots]] = []
        shapes: dict[str, tuple[int, int]] = {}
        missing: dict[str, str] = {}
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            hidden = attn.qkv_proj.in_features
            linears = {
                _QKV: (attn.qkv_proj, {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
                                      "qkv_proj": (0, q + 2 * kv)}),
                _O: (attn.o_proj, {"o_proj": (0, hidden)}),
            }  # fmt: skip
            if hasattr(mlp, "gate_up_proj"):
                inter = mlp.intermediate_size
                linears[_GATE_UP] = (mlp.gate_up_proj, {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter),
                                                        "gate_up_proj": (0, 2 * inter)})  # fmt: skip
                linears[_DOWN] = (mlp.down_proj, {"down_proj": (0, hidden)})
            else:  # a mixture of experts: its experts run on row subsets, outside the step mapping
                for m in ("gate_proj", "up_proj", "gate_up_proj", "down_proj"):
                    missing[m] = "the base model's MLPs are mixtures of experts, which LoRA does not adapt here"
            slots = {}
            for name, (linear, parts) in linears.items():
                slots[name] = LinearSlots(self.context, parts, linear.in_features, linear.out_features, max_loras, max_rank)
                for module, (c0, c1) in parts.items():
                    shape = (linear.in_features, c1 - c0)
                    if shapes.setdefault(module, shape) != shape:
                        missing[module] = "its shape differs between layers"
                linear.lora = slots[name]
            self.layers.append(slots)
        for m in missing:
            shapes.pop(m, None)
        self.targets = TargetShapes(len(self.layers), shapes, missing)

    @property
    def nbytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for layer in self.layers for s in layer.values())

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for i, layer in enumerate(self.layers):
            for s in layer.values():
                s.load(slot, adapter, i)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for s in layer.values():
                s.clear(slot)
