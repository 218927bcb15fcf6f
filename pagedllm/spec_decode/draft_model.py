"""Drafts from a smaller model sharing the target's vocabulary, with its own paged KV cache.

The draft keeps its own block pool and block tables (the scheduler never sees them): a
request's draft cache holds the K/V of its known tokens (prompt + verified output) only. Each
step, for the requests that want drafts, the draft model

    1. catches up: one flattened forward over each request's known tokens not yet in its cache
       (the whole prompt the first time; afterwards the step's accepted tokens + the new one);
       the last position's logits give draft token 1;
    2. runs k - 1 one-token steps, each feeding the previous draft token.

Drafts are greedy (the draft's argmax), a point-mass proposal, which is what the rejection
rule in ``rejection.py`` assumes. The K/V written for draft tokens lies beyond the known tokens
and is overwritten by the next catch-up, so a rejected draft needs no rollback. A request whose
cache cannot get blocks simply goes without drafts; its blocks are freed when it ends or is
preempted (``forget``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, paged_metadata
from pagedllm.attention.kv_cache_dtype import KVCacheSpec, allocate_pool


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # known tokens whose K/V the draft cache holds


class DraftModelProposer:
    """``model``: a causal LM with the engine's model interface (``forward(ids, positions,
    kv_caches, backend, meta)`` -> hidden, ``compute_logits``) and no sliding-window layers."""

    def __init__(
        self,
        model: Any,
        k: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        kv_spec: KVCacheSpec,
        backend: AttentionBackend,
        device: torch.device,
    ):
        arch = model.arch
        if any(arch.is_sliding(i) for i in range(arch.num_layers)):
            raise ValueError("speculative_config.model: a draft model with sliding-window layers is not supported")
        self.model, self.k, self.block_size = model, k, block_size
        self.max_model_len, self.backend, self.device = max_model_len, backend, device
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [(allocate_pool(kv_spec, shape, device), allocate_pool(kv_spec, shape, device))
                          for _ in range(arch.num_layers)]  # fmt: skip
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self._states: dict[str, _DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def forget(self, req_id: str) -> None:
        """The request ended or was preempted: its draft blocks go back to the pool."""
        state = self._states.pop(req_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def _reserve(self, req_id: str, num_tokens: int) -> _DraftState | None:
        state = self._states.setdefault(req_id, _DraftState())
        need = -(-num_tokens // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return None
        for _ in range(need):
            state.blocks.append(self._free.pop())
        return state

    needs_hidden = False

    def propose(self, req_ids: list[str], token_ids: list[list[int]], limits: list[int], hidden=None) -> list[list[int]]:
        """Greedy drafts of up to k (and ``limits[i]``) tokens for each request (prompt + output
        ``token_ids``)."""
        drafts: list[list[int]] = [[] for _ in req_ids]
        jobs = []  # (index, state, number of draft tokens)
        for i, (req_id, ids, limit) in enumerate(zip(req_ids, token_ids, limits)):
            k = min(self.k, limit, self.max_model_len - len(ids))
            state = self._reserve(req_id, len(ids) + k - 1) if k > 0 else None
            if state is not None:
                jobs.append((i, state, k))
        if not jobs:
            return drafts
        # Decode-shaped rows (one uncached token) first, as the attention metadata wants.
        jobs.sort(key=lambda j: len(token_ids[j[0]]) - j[1].num_cached != 1)
        starts = np.array([s.num_cached for _, s, _ in jobs], dtype=np.int64)
        tokens = [t for i, s, _ in jobs for t in token_ids[i][s.num_cached :]]
        q_lens = np.array([len(token_ids[i]) - s.num_cached for i, s, _ in jobs], dtype=np.int64)
        last = self._step(tokens, starts, q_lens, [s for _, s, _ in jobs])
        for (i, s, _), t in zip(jobs, last):
            drafts[i].append(t)
            s.num_cached = len(token_ids[i])
        for step in range(1, max(k for _, _, k in jobs)):
            live = [(i, s) for i, s, k in jobs if k > step]
            starts = np.array([len(token_ids[i]) + step - 1 for i, _ in live], dtype=np.int64)
            last = self._step([drafts[i][-1] for i, _ in live], starts, np.ones(len(live), dtype=np.int64),
                              [s for _, s in live])  # fmt: skip
            for (i, _), t in zip(live, last):
                drafts[i].append(t)
        return drafts

    def _step(self, tokens: list[int], starts: np.ndarray, q_lens: np.ndarray, states: list[_DraftState]) -> list[int]:
        """One draft forward; the argmax token after each sequence's last position."""
        tables = np.zeros((len(states), max(len(s.blocks) for s in states)), dtype=np.int64)
        for row, s in enumerate(states):
            tables[row, : len(s.blocks)] = s.blocks
        meta, positions = paged_metadata(tables, starts, q_lens, self.block_size, self.device)
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_caches,
            self.backend,
            meta,
        )
        last_rows = torch.from_numpy(np.cumsum(q_lens) - 1).to(self.device)
        return self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
