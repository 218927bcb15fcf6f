"""A drafter's own paged KV cache: a block pool and per-request block lists.

Model-based drafters (a draft model, an EAGLE head) attend over K/V of their own. They keep it
in blocks as the target does, but the scheduler never sees these: a drafter takes blocks as a
request's draft context grows, frees them when the runner hears the request ended or was
preempted, and goes without drafts for a request when the pool runs dry (speed, never answers).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import AttentionMetadata, paged_metadata
from pagedllm.attention.kv_cache_dtype import KVCacheSpec, KVPool, allocate_pool


class DraftKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 kv_spec: KVCacheSpec, device: torch.device):  # fmt: skip
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Memory is committed as blocks are first written (allocate_pool), so a pool as big as
        # the target's costs only what drafting touches.
        self.layers: list[tuple[KVPool, KVPool]] = [
            (allocate_pool(kv_spec, shape, device), allocate_pool(kv_spec, shape, device)) for _ in range(num_layers)
        ]
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_held(self) -> dict[str, list[int]]:
        return self._blocks

    def reserve(self, req_id: str, num_tokens: int) -> bool:
        """Give the request blocks for ``num_tokens`` positions; False (nothing taken) if the
        pool cannot."""
        blocks = self._blocks.setdefault(req_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > len(self._free):
            return False
        for _ in range(need):
            blocks.append(self._free.pop())
        return True

    def free(self, req_id: str) -> None:
        self._free.extend(reversed(self._blocks.pop(req_id, [])))

    def metadata(self, req_ids: list[str], starts: np.ndarray, query_lens: np.ndarray) -> tuple[AttentionMetadata, np.ndarray]:
        """Metadata for a step of these requests (those with one query token first) and the new
        tokens' positions."""
        lists = [self._blocks[r] for r in req_ids]
        tables = np.zeros((len(lists), max(len(b) for b in lists)), dtype=np.int64)
        for row, b in enumerate(lists):
            tables[row, : len(b)] = b
        return paged_metadata(tables, starts, query_lens, self.block_size, self.device)
