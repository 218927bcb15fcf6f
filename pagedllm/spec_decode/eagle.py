"""EAGLE drafting: one small decoder layer that runs ahead on the target's own features.

The target's final hidden state f_t at position t (the feature its LM head reads) says more
about the next token than the token ids do. The head takes, at each position t, the pair
(embedding of token t + 1, f_t), fuses it with ``fc`` and runs one decoder layer (attention
over its own paged KV cache, then a gated MLP) to guess g_{t+1} ~ f_{t+1}; the target's LM
head reads a token from g. Drafting k tokens after the newest token x (sampled from f_{L-2}):

    pairs (x_{t+1}, f_t) not yet in the head's cache  -> g_{L-1} -> d_1 = argmax LM(g_{L-1})
    (d_1, g_{L-1}) -> g_L -> d_2,   (d_2, g_L) -> g_{L+1} -> d_3, ...

so later drafts run on the head's own guesses of the features. The runner hands over the
features of every verified position each step (``observe``); a request's head context starts
at the first feature seen (a prefix-cache hit's positions never had one) and RoPE uses
positions relative to it, which attention cannot tell from absolute ones. Drafts are argmax
(a point mass), as ``rejection.py`` assumes.

The same layer has two attention paths: ``forward_paged`` (inference, through the engine's
attention backend and paged K/V) and ``forward_train`` (whole sequences, differentiable; its
passes 2..n replay drafting steps 2..n on the head's own guesses); tests check they agree.

A head may draft from a reduced vocabulary (EAGLE-3's ``d2t``: the most frequent tokens of its
training answers), so each drafted token reads those rows of the target's LM head only. At
drafting time the head's linears and those rows run as Q8_0 blocks (``packed_linear.py``):
drafts need speed, not exactness, as the target verifies them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.kv_cache_dtype import KVCacheSpec
from pagedllm.spec_decode.draft_cache import DraftKVCache
from pagedllm.spec_decode.head_files import read_head
from pagedllm.spec_decode.packed_linear import draft_lm_head, pack_linears

HEADS_DIR = Path(__file__).parent / "heads"
DEFAULT_EAGLE = HEADS_DIR / "smollm2-135m-instruct-eagle"


@dataclass
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    draft_vocab_size: int = 0  # drafts come from this many frequent tokens (``d2t``); 0: the whole vocabulary


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig):
        super().__init__()
        c = self.config = config
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.qkv_proj = nn.Linear(h, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.post_attention_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if c.draft_vocab_size:  # draft id -> the target's token id
            self.register_buffer("d2t", torch.arange(c.draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of x [..., T, heads, D] at ``positions`` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()

    def _qkv(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor):
        """[..., T, hidden] pairs -> z (the fused input, the residual) and roped q, k and v [..., T, heads, D]."""
        c = self.config
        z = self.fc(torch.cat([embeds, features], dim=-1))
        q, k, v = self.qkv_proj(z).split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                          c.num_kv_heads * c.head_dim], dim=-1)  # fmt: skip
        lead = z.shape[:-1]
        q = self._rope(q.reshape(*lead, c.num_heads, c.head_dim), positions)
        k = self._rope(k.reshape(*lead, c.num_kv_heads, c.head_dim), positions)
        return z, q, k, v.reshape(*lead, c.num_kv_heads, c.head_dim)

    def _rest(self, z: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer after attention: residual, norm, gated MLP."""
        c = self.config
        h = z + self.o_proj(attn.reshape(*z.shape[:-1], -1))
        m = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * self.post_attention_norm
        gate, up = self.gate_up_proj(m).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def forward_train(self, embeds: torch.Tensor, features: torch.Tensor, passes: int = 1) -> list[torch.Tensor]:
        """Whole sequences [B, T, hidden] (pair p = (embedding of token p + 1, feature f_p),
        positions 0..T-1): the guesses g_i [B, T, hidden] of ``passes`` drafting steps, all of
        which estimate f_{p+1} at index p (differentiable).

        Pass 1 is teacher-forced: causal attention over the true pairs. Pass i > 1 replays
        drafting step i for every start at once (EAGLE-3's training-time test): index p takes
        (token p + 1, g_{i-1} at p - 1), the head's own guess, and attends, as at drafting
        time, to the true pairs up to p - i + 1 and to its own chain's earlier guesses."""
        c = self.config
        B, T, _ = embeds.shape
        rep = c.num_heads // c.num_kv_heads
        positions = torch.arange(T, device=embeds.device)
        guesses: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i in range(1, passes + 1):
            inp = features if i == 1 else F.pad(guesses[-1][:, :-1], (0, 0, 1, 0))  # g_{i-1}[p - 1]
            z, q, k, v = self._qkv(embeds, inp, positions)
            keys.append(k)
            values.append(v)
            kk = torch.cat(keys, 1).repeat_interleave(rep, dim=2).transpose(1, 2)
            vv = torch.cat(values, 1).repeat_interleave(rep, dim=2).transpose(1, 2)
            mask = None if i == 1 else _chain_mask(T, i, embeds.device)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask, is_causal=i == 1)
            guesses.append(self._rest(z, attn.transpose(1, 2)))
        return guesses

    def forward_dense(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One sequence [T, hidden], positions 0..T-1, causal: the teacher-forced pass."""
        return self.forward_train(embeds[None], features[None])[0][0]

    def forward_paged(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      kv_cache: tuple[Any, Any], backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """A flattened step over the head's paged cache (the backend writes this step's K/V)."""
        z, q, k, v = self._qkv(embeds, features, positions)
        attn = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache[0], kv_cache[1], meta,
                               self.config.head_dim**-0.5)  # fmt: skip
        return self._rest(z, attn)

    def save(self, path: Path, meta: dict) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"method": "eagle"} | asdict(self.config) | meta, indent=2) + "\n")
        # bf16 on disk halves the file; the head computes in fp32.
        state = {k: v.detach().contiguous() if k == "d2t" else v.detach().to(torch.bfloat16).contiguous()
                 for k, v in self.state_dict().items()}  # fmt: skip
        save_file(state, str(path / "head.safetensors"))

    @classmethod
    def load(cls, path: Path, hidden_size: int, vocab_size: int) -> "EagleHead":
        raw, state = read_head(path, "head.safetensors", "eagle", "EAGLE head")
        config = EagleConfig(**{k: raw[k] for k in EagleConfig.__dataclass_fields__ if k in raw})
        if (config.hidden_size, config.vocab_size) != (hidden_size, vocab_size):
            raise ValueError(
                f"speculative_config.model: an EAGLE head for hidden size {config.hidden_size} and vocabulary "
                f"{config.vocab_size}; the target has {hidden_size} and {vocab_size}"
            )
        head = cls(config)
        head.load_state_dict({k: v if k == "d2t" else v.float() for k, v in state.items()})
        if head.d2t is not None and (head.d2t.min() < 0 or head.d2t.max() >= vocab_size):
            raise ValueError(f"speculative_config.model: the EAGLE head at {path} maps drafts outside the vocabulary")
        return head.requires_grad_(False).eval()


def _chain_mask(T: int, i: int, device: torch.device) -> torch.Tensor:
    """What drafting step i's query at index p sees ([T, i * T], keys of passes 1..i side by
    side): the true pairs up to its chain's start t = p - i + 1, then the chain's own pairs
    of passes 2..i, at indices t + 1 .. p."""
    p = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return torch.cat([j <= p - i + 1] + [j == p - (i - n) for n in range(2, i + 1)], dim=1)


@dataclass
class _Context:
    offset: int  # absolute position of the first feature: the head's relative position 0
    num_cached: int = 0  # pairs in the head's cache (relative positions 0..num_cached-1)
    pending: list[torch.Tensor] = field(default_factory=list)  # features after those, in order
    num_pending: int = 0

    @property
    def next_position(self) -> int:
        return self.offset + self.num_cached + self.num_pending


class EagleProposer:
    """``target``: the engine's model (its ``embed_tokens`` and ``compute_logits`` are shared)."""

    needs_hidden = False
    needs_features = True

    def __init__(self, head: EagleHead, target: Any, k: int, num_blocks: int, block_size: int, max_model_len: int,
                 kv_spec: KVCacheSpec, backend: AttentionBackend, device: torch.device):  # fmt: skip
        c = head.config
        self.head, self.target, self.k, self.max_model_len = head, target, k, max_model_len
        self.backend, self.device = backend, device
        self.cache = DraftKVCache(1, num_blocks, block_size, c.num_kv_heads, c.head_dim, kv_spec, device)
        self._contexts: dict[str, _Context] = {}
        # Drafting reads the head's weights once per drafted token: as Q8_0 blocks, not fp32.
        pack_linears(head)
        # A reduced draft vocabulary reads only its rows of the target's LM head.
        self.lm_head = None if head.d2t is None else draft_lm_head(target.lm_head, head.d2t)

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    def forget(self, req_id: str) -> None:
        self.cache.free(req_id)
        self._contexts.pop(req_id, None)

    def observe(self, req_id: str, position: int, features: torch.Tensor) -> None:
        """The target's features of the request's verified positions ``position`` .. of this step."""
        if features.shape[0] == 0:
            return
        ctx = self._contexts.get(req_id)
        if ctx is None or ctx.next_position != position:  # new, or a gap (e.g. steps not observed): start over
            self.forget(req_id)
            ctx = self._contexts[req_id] = _Context(offset=position)
        ctx.pending.append(features.to(torch.float32, copy=True))  # the step's buffers may be reused
        ctx.num_pending += features.shape[0]

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]], limits: list[int], hidden=None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in req_ids]
        jobs = []  # (index, context, k)
        for i, (req_id, ids, limit) in enumerate(zip(req_ids, token_ids, limits)):
            ctx = self._contexts.get(req_id)
            k = min(self.k, limit, self.max_model_len - len(ids))
            # The newest token was sampled from the feature at len - 2: it must be the last seen.
            if ctx is None or k <= 0 or ctx.num_pending == 0 or ctx.next_position != len(ids) - 1:
                continue
            if self.cache.reserve(req_id, len(ids) - 1 - ctx.offset + k - 1):
                jobs.append((i, ctx, k))
        if not jobs:
            return drafts
        # Catch up: pairs (token t + 1, feature t) for the pending features, one query each.
        jobs.sort(key=lambda j: j[1].num_pending != 1)
        feats = torch.cat([f for _, ctx, _ in jobs for f in ctx.pending])
        next_tokens = [t for i, ctx, _ in jobs for t in token_ids[i][ctx.offset + ctx.num_cached + 1 :]]
        starts = np.array([ctx.num_cached for _, ctx, _ in jobs], dtype=np.int64)
        q_lens = np.array([ctx.num_pending for _, ctx, _ in jobs], dtype=np.int64)
        g = self._step([req_ids[i] for i, _, _ in jobs], next_tokens, feats, starts, q_lens)
        last = g[torch.from_numpy(np.cumsum(q_lens) - 1)]
        for _, ctx, _ in jobs:
            ctx.num_cached += ctx.num_pending
            ctx.pending, ctx.num_pending = [], 0
        tokens = self._argmax(last)
        for (i, _, _), t in zip(jobs, tokens):
            drafts[i].append(t)
        for step in range(1, max(k for _, _, k in jobs)):
            live = [j for j, (_, _, k) in enumerate(jobs) if k > step]
            starts = np.array([jobs[j][1].num_cached + step - 1 for j in live], dtype=np.int64)
            rows = torch.tensor(live)
            g = self._step([req_ids[jobs[j][0]] for j in live], [drafts[jobs[j][0]][-1] for j in live],
                           last[rows], starts, np.ones(len(live), dtype=np.int64))  # fmt: skip
            last = last.index_copy(0, rows, g)  # each job's newest guessed feature
            tokens = self._argmax(g)
            for j, t in zip(live, tokens):
                drafts[jobs[j][0]].append(t)
        return drafts

    def _argmax(self, g: torch.Tensor) -> list[int]:
        """Each guessed feature's draft token: the target LM head's argmax (over the draft vocabulary)."""
        if self.lm_head is None:
            return self.target.compute_logits(g).argmax(dim=-1).tolist()
        return self.head.d2t[self.lm_head(g).argmax(dim=-1)].tolist()

    def _step(self, req_ids: list[str], tokens: list[int], features: torch.Tensor, starts: np.ndarray,
              q_lens: np.ndarray) -> torch.Tensor:  # fmt: skip
        meta, positions = self.cache.metadata(req_ids, starts, q_lens)
        embeds = self.target.embed_tokens(torch.tensor(tokens, dtype=torch.int64, device=self.device)).float()
        return self.head.forward_paged(embeds, features, torch.from_numpy(positions).to(self.device),
                                       self.cache.layers[0], self.backend, meta)  # fmt: skip

