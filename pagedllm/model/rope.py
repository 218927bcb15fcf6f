"""Rotary position embeddings in the Hugging Face "rotate half" layout."""

from __future__ import annotations

import math

import torch

from pagedllm.kernels import ops
from pagedllm.model.arch import ModelArch


def rope_inv_freq(arch: ModelArch, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with llama3 scaling when configured.

    ``rope_freqs`` is the per-frequency divisor llama.cpp stores in GGUF files of scaled
    models instead of the scaling parameters.
    """
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.float()
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by per-token position (any batch mix)."""

    def __init__(self, arch: ModelArch, max_positions: int, rope_freqs: torch.Tensor | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(arch, rope_freqs)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q: [T, H, D] and k: [T, Hkv, D] in place."""
        ops.rope_(q, k, positions, self.cos, self.sin)
