"""The connector's scheduler side: which prompt blocks come from the store, which get saved.

Three calls from the scheduler, in vLLM v1's order:

1. ``lookup(req, num_computed_tokens, kv)`` for a request starting out, after the local
   prefix-cache hit: how many more tokens (whole blocks) the store supplies. The blocks are
   read and verified here, so what the scheduler counts as computed is exactly what will be
   loaded: a torn, corrupt or foreign file is a miss, and its tokens are recomputed::

       tokens:  | local hits | store hits (loaded) | computed this step ... | last token |
                0            num_computed_tokens   + lookup()               num_tokens - 1

   The last token is never supplied (the step must produce its logits).
2. ``on_allocated(req_id, block_ids)`` once its blocks are allocated: the payloads' block ids.
3. ``build_meta(out, requests, kv)`` at the end of the step: this step's loads, and the blocks
   that will be full of known (never draft) tokens after it, to save.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pagedllm.config import KVTransferConfig
from pagedllm.kv_connector.base import BlockSave, KVConnectorMetadata, KVStore, RequestLoad, StatsBox
from pagedllm.request import Request

# Verified payloads of requests looked up but not (yet) admitted, kept for their next try.
MAX_PENDING_LOOKUPS = 4


@dataclass(slots=True)
class _Lookup:
    start: int  # num_computed_tokens the lookup began at (a multiple of the block size)
    num_queried: int  # blocks it could have supplied
    payloads: list
    read_seconds: float


class SchedulerConnector:
    def __init__(self, store: KVStore, config: KVTransferConfig, block_size: int, block_bytes: int, stats: StatsBox,
                 saving: Callable[[bytes], bool] | None = None):  # fmt: skip
        self.store = store
        # Whether a block is queued for saving but not yet written (the saver's is_pending).
        self.saving = saving or (lambda block_hash: False)
        self.config = config
        self.block_size = block_size
        self.block_bytes = block_bytes  # a payload's length: anything else is never loaded
        self.stats = stats
        self._pending: OrderedDict[str, _Lookup] = OrderedDict()
        self._loads: list[RequestLoad] = []
        # Per running request: the full blocks considered for saving so far. A block that
        # accepted draft tokens filled is computed before any step's range starts at it, so
        # ranges start from here (they skipped it, breaking the stored chain).
        self._saved_blocks: dict[str, int] = {}

    def lookup(self, req: Request, num_computed_tokens: int, kv: Any) -> int:
        """Tokens after ``num_computed_tokens`` the store supplies (whole blocks, verified)."""
        if not self.config.loads or num_computed_tokens % self.block_size:
            return 0
        bs = self.block_size
        found = self._pending.get(req.request_id)
        if found is None or found.start != num_computed_tokens:
            hashes = kv.block_hashes(req.request_id, req.all_token_ids, extra_keys=req.cache_keys)
            first, last = num_computed_tokens // bs, min(len(hashes), (req.num_tokens - 1) // bs)
            t0 = time.perf_counter()
            payloads = []
            for h in hashes[first:last]:
                payload = self.store.get(h)
                if payload is not None and len(payload) != self.block_bytes:  # same fingerprint: only if forged
                    self.stats.update(num_rejected_blocks=1)
                    self.store.release(payload)
                    payload = None
                if payload is None:
                    break
                payloads.append(payload)
            found = _Lookup(num_computed_tokens, max(0, last - first), payloads, time.perf_counter() - t0)
            if req.request_id in self._pending:
                self._drop(req.request_id)
            self._pending[req.request_id] = found
            while len(self._pending) > MAX_PENDING_LOOKUPS:
                self._drop(next(iter(self._pending)))
        return len(found.payloads) * bs

    def _drop(self, req_id: str) -> None:
        """Forget a lookup that will not be loaded; its payload buffers go back to the store."""
        for payload in self._pending.pop(req_id).payloads:
            self.store.release(payload)

    def on_allocated(self, req_id: str, block_ids: list[int]) -> None:
        """The request was admitted with its looked-up tokens counted as computed: its
        payloads go to these blocks before this step's forward."""
        found = self._pending.pop(req_id, None)
        if found is None:
            return
        self.stats.update(num_queried_blocks=found.num_queried, num_hit_blocks=len(found.payloads))
        if found.payloads:
            first = found.start // self.block_size
            ids = block_ids[first : first + len(found.payloads)]
            self._loads.append(RequestLoad(req_id, ids, found.payloads, found.read_seconds))

    def build_meta(self, out: Any, requests: Mapping[str, Request], kv: Any) -> KVConnectorMetadata | None:
        """The step's loads (in admission order: a block id reused within the step gets its
        last writer's payload) and saves; None when there is nothing to do."""
        meta = KVConnectorMetadata(loads=self._loads)
        self._loads = []
        for req_id in [r for r in self._pending if r not in requests]:
            self._drop(req_id)
        for req_id in [r for r in self._saved_blocks if r not in requests]:
            del self._saved_blocks[req_id]
        if self.config.saves:
            bs = self.block_size
            queued: set[bytes] = set()
            for s in out.scheduled:
                known_end = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
                end = known_end // bs
                # From block 0 on a request's first step: blocks its prompt found in the local
                # prefix cache are saved too when the store lost them (evicted, deleted). min:
                # after a preemption the request computes its blocks again from 0.
                first = min(self._saved_blocks.get(s.req_id, 0), s.num_computed_tokens // bs)
                if end <= first:
                    continue
                self._saved_blocks[s.req_id] = end
                hashes = kv.block_hashes(s.req_id, requests[s.req_id].all_token_ids, known_end, requests[s.req_id].cache_keys)
                for i in range(first, end):
                    # Not a block the saver has yet to write (another request on the same
                    # cached prefix queued it), nor one queued by this step already.
                    if hashes[i] in queued or self.saving(hashes[i]) or self.store.contains(hashes[i]):
                        continue
                    meta.saves.append(BlockSave(s.req_id, s.block_ids[i], hashes[i]))
                    queued.add(hashes[i])
        return meta or None
