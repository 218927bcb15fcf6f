"""Qwen3-MoE: the Qwen3 decoder (q/k norms) with a sparse mixture-of-experts MLP.

Each token's router picks ``num_experts_per_tok`` of ``num_experts`` small gated MLPs and
sums their outputs weighted by the router's probabilities. The experts run grouped by
expert: the (token, expert) assignments are sorted by expert, each expert that has tokens
runs one matmul pair over all of them, and the weighted rows are added back per token. The
Python loop is over experts hit in the step, never over tokens.

Routing follows transformers' Qwen3-MoE: softmax over all experts in fp32, top-k of those
probabilities, renormalised to sum to 1 when ``norm_topk_prob``, then cast to the model's
dtype. Layers listed in ``mlp_only_layers`` (or off the ``decoder_sparse_step`` beat) keep a
dense MLP.

Checkpoints store the experts either per expert (``mlp.experts.N.gate_proj.weight``, what
``save_pretrained`` writes) or fused as 3-D tensors (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I], transformers 5's in-memory layout); both load. GGUF files
(llama.cpp's ``qwen3moe``) stack them per projection: ``gguf_moe_tensors`` renames those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.model.arch import ModelArch
from pagedllm.model.linear import Linear
from pagedllm.quantization.weights import cat_rows
from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """Router (``gate``) plus ``num_experts`` gated MLPs (``experts``), run grouped by expert."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(LlamaMLP(arch, arch.moe_intermediate_size) for _ in range(arch.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the routing weights [n, k] (x's dtype) and the chosen experts [n, k]."""
        probs = torch.softmax(self.gate.forward(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert[experts[t, j]](x[t]) for every token t, grouped by expert."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        tokens = order // k  # the token of each sorted assignment
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x.index_select(0, tokens)
        ys = torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts):
            if count:
                ys[start : start + count] = self.experts[e].forward(xs[start : start + count])
                start += count
        ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, ys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return self.run_experts(x, weights, experts)

    def packed_targets(self, prefix: str) -> list[tuple[Linear, list[str]]]:
        """The router and every expert's linears, under their per-expert Hugging Face names."""
        targets = [(self.gate, [f"{prefix}gate.weight"])]
        for e, expert in enumerate(self.experts):
            targets += expert.packed_targets(f"{prefix}experts.{e}.")
        return targets


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, arch: ModelArch, layer: int = 0):
        super().__init__(arch, layer)
        if arch.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(arch)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """The Llama forward as is: a layer's ``mlp`` is either dense or a ``SparseMoeBlock``."""

    layer_cls = Qwen3MoeDecoderLayer

    @classmethod
    def take_mlp_weights(
        cls, arch: ModelArch, layer: int, state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
    ) -> None:
        if not arch.is_moe_layer(layer):
            return super().take_mlp_weights(arch, layer, state, own)
        p, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
        num, inter, hidden = arch.num_experts, arch.moe_intermediate_size, arch.hidden_size
        if f"{p}gate_up_proj" in state:  # transformers 5's fused 3-D layout
            gate_up, down = state.pop(f"{p}gate_up_proj"), state.pop(f"{p}down_proj")
            expected = {"gate_up_proj": (gate_up, (num, 2 * inter, hidden)), "down_proj": (down, (num, hidden, inter))}
            for name, (t, shape) in expected.items():
                if tuple(t.shape) != shape:
                    raise ValueError(f"weight {p}{name} has shape {tuple(t.shape)}, expected {shape}")
            for e in range(num):
                own[f"{ours}{e}.gate_up_proj.weight"] = gate_up[e]
                own[f"{ours}{e}.down_proj.weight"] = down[e]
            return
        for e in range(num):  # per expert; down_proj keeps its name
            own[f"{ours}{e}.gate_up_proj.weight"] = cat_rows(
                [state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")], merge=False
            )


# llama.cpp's qwen3moe tensors (after "blk.N.") that differ from the dense Qwen3 ones. The
# experts are stacked per projection, shaped (torch order) gate/up [E, I, H], down [E, H, I].
GGUF_MOE_LAYER_TENSORS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router, [E, H]
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


def gguf_moe_tensors(layer: int, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """One dequantized GGUF tensor ``blk.{layer}.{suffix}`` as Hugging Face-named tensors (an
    expert stack becomes one tensor per expert), or None when it is not a MoE tensor."""
    hf = GGUF_MOE_LAYER_TENSORS.get(suffix)
    if hf is None:
        return None
    p = f"model.layers.{layer}."
    if "{e}" not in hf:
        return {p + hf: tensor}
    if tensor.dim() != 3:
        raise ValueError(f"GGUF tensor blk.{layer}.{suffix} has shape {tuple(tensor.shape)}, expected 3-D")
    return {p + hf.format(e=e): tensor[e] for e in range(tensor.shape[0])}


def gguf_moe_arch_fields(meta: Callable[[str, Any], Any]) -> dict[str, Any]:
    """``ModelArch`` fields of a qwen3moe GGUF file; ``meta(key, default)`` reads
    ``qwen3moe.{key}``. llama.cpp always renormalises the top-k weights for this family and
    makes every layer sparse."""
    return dict(
        num_experts=int(meta("expert_count", None)),
        num_experts_per_tok=int(meta("expert_used_count", None)),
        moe_intermediate_size=int(meta("expert_feed_forward_length", None)),
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
    )
