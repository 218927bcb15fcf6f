"""Medusa heads: k small residual blocks that guess the tokens 2..k+1 steps ahead from the
target's last hidden state, read out through the target's own LM head.

Head i maps the final (normed) hidden state h_t at position t to h + SiLU(W_i h + b_i); the
target's LM head turns that into logits for token t + 2 + i (the target's own head predicts
t + 1, the token just sampled). The draft is the chain of each head's argmax (no tree), a
point-mass proposal as ``rejection.py`` expects. Sharing the LM head keeps a head file small
(one hidden x hidden matrix per head: 1.3 MB each for SmolLM2-135M) and costs one LM-head
pass over k rows per drafting request.

Heads are trained with ``pagedllm train-draft-head --method medusa`` (entrypoints/
train_draft_head.py) and saved as ``config.json`` + ``heads.safetensors``; the ones for the
default model ship in ``spec_decode/heads/``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.spec_decode.head_files import read_head

HEADS_DIR = Path(__file__).parent / "heads"
# The heads shipped for the default model (SmolLM2-135M-Instruct), used when
# speculative_config has no "model".
DEFAULT_MEDUSA = HEADS_DIR / "smollm2-135m-instruct-medusa"


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, draft_vocab_size: int = 0):
        super().__init__()
        self.num_heads, self.hidden_size = num_heads, hidden_size
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        if draft_vocab_size:  # draft id -> the target's token id (a reduced draft vocabulary)
            self.register_buffer("d2t", torch.arange(draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, num_heads, hidden]: each head's input to the LM head."""
        return torch.stack([hidden + F.silu(head(hidden)) for head in self.heads], dim=1)

    def save(self, path: Path, meta: dict) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        config = {"method": "medusa", "num_heads": self.num_heads, "hidden_size": self.hidden_size,
                  "draft_vocab_size": 0 if self.d2t is None else len(self.d2t)} | meta  # fmt: skip
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path / "heads.safetensors"))

    @classmethod
    def load(cls, path: Path, hidden_size: int, vocab_size: int) -> "MedusaHeads":
        """Heads trained for a target of this hidden and vocabulary size (a ValueError otherwise)."""
        config, state = read_head(path, "heads.safetensors", "medusa", "Medusa heads")
        if config["hidden_size"] != hidden_size or config.get("vocab_size", vocab_size) != vocab_size:
            raise ValueError(
                f"speculative_config.model: heads for hidden size {config['hidden_size']} and vocabulary "
                f"{config.get('vocab_size')}; the target has {hidden_size} and {vocab_size}"
            )
        heads = cls(config["num_heads"], hidden_size, config.get("draft_vocab_size", 0))
        heads.load_state_dict(state)
        if heads.d2t is not None and (heads.d2t.min() < 0 or heads.d2t.max() >= vocab_size):
            raise ValueError(f"speculative_config.model: the Medusa heads at {path} map drafts outside the vocabulary")
        return heads.requires_grad_(False).eval()


class MedusaProposer:
    """Drafts from the heads; ``lm_head`` reads a token out of each head's output: the
    target's LM head (fp32 logits), or for heads with a draft vocabulary its rows of it
    (``eagle.draft_lm_head``), whose argmax maps back through the heads' ``d2t``."""

    needs_hidden = True

    def __init__(self, heads: MedusaHeads, k: int, lm_head: Callable[[torch.Tensor], torch.Tensor]):
        if k > heads.num_heads:
            raise ValueError(f"speculative_config.num_speculative_tokens ({k}) exceeds the {heads.num_heads} Medusa heads")
        self.heads, self.k, self.lm_head = heads, k, lm_head

    def forget(self, req_id: str) -> None:  # no per-request state
        pass

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]], limits: list[int], hidden: torch.Tensor) -> list[list[int]]:
        """``hidden`` [len(req_ids), hidden]: each request's last hidden state (the one that
        sampled its newest token)."""
        if hidden.shape[0] == 0:
            return []
        k = min(self.k, max(limits))
        if k <= 0:
            return [[] for _ in req_ids]
        x = self.heads(hidden.float())[:, :k]  # [n, k, hidden]
        best = self.lm_head(x.reshape(-1, x.shape[-1])).argmax(dim=-1)
        if self.heads.d2t is not None:
            best = self.heads.d2t[best]
        tokens = best.view(len(req_ids), k).tolist()
        return [t[: max(0, limit)] for t, limit in zip(tokens, limits)]
