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

from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kv_cache_dtype import KVCacheSpec
from pagedllm.spec_decode.draft_cache import DraftKVCache


class DraftModelProposer:
    """``model``: a causal LM with the engine's model interface (``forward(ids, positions,
    kv_caches, backend, meta)`` -> hidden, ``compute_logits``) and no sliding-window layers."""

    needs_hidden = False
    needs_features = False

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
        self.model, self.k, self.max_model_len, self.backend, self.device = model, k, max_model_len, backend, device
        self.cache = DraftKVCache(arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim, kv_spec, device)
        self._num_cached: dict[str, int] = {}  # known tokens whose K/V the draft cache holds

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    def forget(self, req_id: str) -> None:
        """The request ended or was preempted: its draft blocks go back to the pool."""
        self.cache.free(req_id)
        self._num_cached.pop(req_id, None)

    def propose(self, req_ids: list[str], token_ids: list[list[int]], limits: list[int], hidden=None) -> list[list[int]]:
        """Greedy drafts of up to k (and ``limits[i]``) tokens for each request (prompt + output
        ``token_ids``)."""
        drafts: list[list[int]] = [[] for _ in req_ids]
        jobs = []  # (index, number of draft tokens)
        for i, (req_id, ids, limit) in enumerate(zip(req_ids, token_ids, limits)):
            k = min(self.k, limit, self.max_model_len - len(ids))
            if k > 0 and self.cache.reserve(req_id, len(ids) + k - 1):
                jobs.append((i, k))
        if not jobs:
            return drafts
        cached = [self._num_cached.get(req_ids[i], 0) for i, _ in jobs]
        # Decode-shaped rows (one uncached token) first, as the attention metadata wants.
        order = sorted(range(len(jobs)), key=lambda j: len(token_ids[jobs[j][0]]) - cached[j] != 1)
        jobs, cached = [jobs[j] for j in order], [cached[j] for j in order]
        tokens = [t for (i, _), c in zip(jobs, cached) for t in token_ids[i][c:]]
        q_lens = np.array([len(token_ids[i]) - c for (i, _), c in zip(jobs, cached)], dtype=np.int64)
        last = self._step([req_ids[i] for i, _ in jobs], tokens, np.array(cached, dtype=np.int64), q_lens)
        for (i, _), t in zip(jobs, last):
            drafts[i].append(t)
            self._num_cached[req_ids[i]] = len(token_ids[i])
        for step in range(1, max(k for _, k in jobs)):
            live = [i for i, k in jobs if k > step]
            starts = np.array([len(token_ids[i]) + step - 1 for i in live], dtype=np.int64)
            last = self._step([req_ids[i] for i in live], [drafts[i][-1] for i in live], starts,
                              np.ones(len(live), dtype=np.int64))  # fmt: skip
            for i, t in zip(live, last):
                drafts[i].append(t)
        return drafts

    def _step(self, req_ids: list[str], tokens: list[int], starts: np.ndarray, q_lens: np.ndarray) -> list[int]:
        """One draft forward; the argmax token after each sequence's last position."""
        meta, positions = self.cache.metadata(req_ids, starts, q_lens)
        hidden = self.model(
            torch.tensor(tokens, dtype=torch.int64, device=self.device),
            torch.from_numpy(positions).to(self.device),
            self.cache.layers,
            self.backend,
            meta,
        )
        last_rows = torch.from_numpy(np.cumsum(q_lens) - 1).to(self.device)
        return self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
