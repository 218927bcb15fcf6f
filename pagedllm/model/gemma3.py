"""Gemma 3 (text): the Llama layers with Gemma's differences.

- embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype, as transformers does);
- RMSNorm multiplies by (1 + w): the 1 is added to every norm weight at load, so the shared
  norm kernel computes it;
- four norms per layer: the attention and MLP outputs are normalised before they join the
  residual stream, and the MLP input has its own norm;
- GeGLU MLP, q/k norms, attention scale query_pre_attn_scalar ** -0.5;
- sliding-window layers (5 of every 6) with their own RoPE base, global layers with another.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.model.arch import ModelArch
from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm, per_layer


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, arch: ModelArch, layer: int = 0):
        super().__init__(arch, layer)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        residual = embeds * torch.tensor(self.arch.hidden_size**0.5, dtype=embeds.dtype)
        metas = per_layer(meta, len(self.layers))
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer.input_layernorm.forward(residual)
            m = meta if metas is None else metas[i]
            x = layer.self_attn.forward(x, positions, self.layer_ropes[i], kv_cache, backend, m)
            x = layer.post_attention_layernorm.forward(x)
            x = layer.pre_feedforward_layernorm.forward(x, residual)  # residual += x, then norm
            x = layer.mlp.forward(x)
            x = layer.post_feedforward_layernorm.forward(x)
            residual = residual + x
        return self.norm.forward(residual)

    @classmethod
    def from_hf_state_dict(
        cls, arch: ModelArch, state: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int
    ) -> "Gemma3ForCausalLM":
        # Norm weights w -> 1 + w, computed in fp32 as transformers computes (1.0 + w.float()).
        state = {k: (1.0 + v.float()) if k.endswith("norm.weight") else v for k, v in state.items()}
        return super().from_hf_state_dict(arch, state, dtype, max_positions)
