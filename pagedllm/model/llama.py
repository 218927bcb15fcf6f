"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flattened token batch.

Every step runs all scheduled tokens of all requests as one [num_tokens, hidden] matrix with
per-token positions; attention goes through the backend, which reads and writes the paged
KV cache. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.model.arch import ModelArch
from pagedllm.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, cast back before the weight (as transformers does)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.view(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` fp32 logits."""

    def __init__(self, arch: ModelArch, max_positions: int, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        with torch.device("cpu"):  # real tables even when the weights are built on "meta"
            self.rope = RotaryEmbedding(arch, max_positions, rope_freqs)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = h + layer.self_attn(layer.input_layernorm(h), positions, self.rope, kv_cache, backend, meta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @classmethod
    def from_hf_state_dict(
        cls, arch: ModelArch, state: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int
    ) -> "LlamaForCausalLM":
        """Build the model from Hugging Face-named weights, fusing q/k/v and gate/up.

        Parameters are created on the meta device and replaced by the loaded tensors, so no
        time goes into random initialisation.
        """
        state = dict(state)
        rope_freqs = state.pop("rope_freqs", None)
        own: dict[str, torch.Tensor] = {}
        try:
            for i in range(arch.num_layers):
                p = f"model.layers.{i}."
                for kind in ("weight", "bias"):
                    names = [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]
                    if all(n in state for n in names):
                        own[f"layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat([state.pop(n) for n in names])
                own[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                    [state.pop(f"{p}mlp.gate_proj.weight"), state.pop(f"{p}mlp.up_proj.weight")]
                )
        except KeyError as e:
            raise ValueError(f"model weights are missing {e.args[0]}") from e
        for name, tensor in state.items():
            if name.startswith("model.") and "rotary_emb" not in name:
                own[name.removeprefix("model.")] = tensor
            elif name == "lm_head.weight" and not arch.tie_word_embeddings:
                own[name] = tensor
        with torch.device("meta"):
            model = cls(arch, max_positions, rope_freqs)
        params = dict(model.named_parameters())
        if "lm_head.weight" not in own:
            own["lm_head.weight"] = own.get("embed_tokens.weight")  # tied embeddings
        missing = sorted(k for k in params if own.get(k) is None)
        if missing:
            raise ValueError(f"model weights are missing {missing[:5]}")
        unexpected = sorted(own.keys() - params.keys())
        if unexpected:
            raise ValueError(f"unexpected model weights {unexpected[:5]}")
        for name, tensor in own.items():
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
        model.load_state_dict({k: v.to(dtype).contiguous() for k, v in own.items()}, strict=False, assign=True)
        if arch.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model
