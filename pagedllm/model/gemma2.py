"""Gemma 2: Gemma 3's layers (model/gemma3.py) without q/k norms, with soft-capped logits.

What differs from Gemma 3, and where it lives:

- no RMSNorm over each head's q and k (``ModelArch.qk_norm`` is off);
- one RoPE base for every layer (no ``rope_local_theta``);
- sliding-window and global layers alternate (``layer_types``);
- attention scores are soft-capped, cap * tanh(s / cap), before the mask and softmax
  (``attn_logit_softcapping``, handed to the attention backend by ``LlamaAttention``);
- the final logits are soft-capped the same way (``final_logit_softcapping``): here.
"""

from __future__ import annotations

import torch

from pagedllm.model.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
