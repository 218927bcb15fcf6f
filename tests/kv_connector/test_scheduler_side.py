"""The scheduler side of the KV connector on its own: what a lookup finds and where its
payloads go (the engine tests run it end to end)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np

from pagedllm.config import KVTransferConfig
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.kv_connector.base import StatsBox
from pagedllm.kv_connector.disk_store import DiskKVStore
from pagedllm.kv_connector.scheduler_side import SchedulerConnector
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS, BLOCK_BYTES = 4, 64
FP = b"\x07" * 32


def setup(tmp_path, num_tokens: int = 19, stored: bool = True):
    store = DiskKVStore(tmp_path, FP, FP.hex()[:8], 1 << 20, StatsBox())
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    req = Request("r", None, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=4))
    hashes = kv.block_hashes("r", req.all_token_ids, extra_keys=req.cache_keys)
    for i, h in enumerate(hashes if stored else []):  # every full block of the prompt, block i filled with i
        store.put(h, memoryview(np.full(BLOCK_BYTES, i, dtype=np.uint8)))
    config = KVTransferConfig(kv_connector="disk", kv_role="kv_both", path=str(tmp_path))
    return SchedulerConnector(store, config, BS, BLOCK_BYTES, StatsBox()), kv, req


def test_a_lookup_after_the_local_hit_grew_is_read_again_from_there(tmp_path):
    """A lookup kept for a request that was not admitted is only good for the same start: once
    a local prefix hit covers block 0, the store supplies blocks 1..3, and they go to the
    request's blocks 1..3 (the first lookup's payloads at start 0 would land one block early)."""
    conn, kv, req = setup(tmp_path)
    assert conn.lookup(req, 0, kv) == 4 * BS  # blocks 0..3 (the last token is always computed)
    assert conn.lookup(req, BS, kv) == 3 * BS
    conn.on_allocated("r", [11, 12, 13, 14, 15])
    (load,) = conn._loads
    assert load.block_ids == [12, 13, 14] and [bytes(p)[0] for p in load.payloads] == [1, 2, 3]


def test_the_lookup_of_a_request_that_is_gone_is_dropped(tmp_path):
    """A request looked up but aborted before admission leaves nothing behind: its payload
    buffers go back to the store at the next step (a later request reusing the id must read
    its own blocks)."""
    conn, kv, req = setup(tmp_path)
    assert conn.lookup(req, 0, kv) == 4 * BS and "r" in conn._pending
    assert conn.build_meta(SimpleNamespace(scheduled=[]), {}, kv) is None
    assert not conn._pending


def test_a_request_preempted_and_recomputed_saves_its_blocks_again(tmp_path):
    """After a recompute preemption a request computes its blocks again from 0; blocks the
    store lost in between must be saved again (the ranges started where the last save ended)."""
    conn, kv, req = setup(tmp_path, stored=False)
    step = SimpleNamespace(req_id="r", num_computed_tokens=0, num_new_tokens=12, spec_token_ids=[], block_ids=[3, 4, 5])
    first = conn.build_meta(SimpleNamespace(scheduled=[step]), {"r": req}, kv)
    assert [s.block_id for s in first.saves] == [3, 4, 5]
    for s in first.saves:  # what the saver writes
        conn.store.put(s.block_hash, memoryview(np.zeros(BLOCK_BYTES, dtype=np.uint8)))
    shutil.rmtree(conn.store.dir)  # the store loses them (evicted, deleted) ...
    conn.store.dir.mkdir()
    again = SimpleNamespace(req_id="r", num_computed_tokens=0, num_new_tokens=12, spec_token_ids=[], block_ids=[7, 8, 9])
    second = conn.build_meta(SimpleNamespace(scheduled=[again]), {"r": req}, kv)  # ... and the request starts over
    assert [s.block_id for s in second.saves] == [7, 8, 9]
