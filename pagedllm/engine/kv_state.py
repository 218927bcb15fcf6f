"""A live view of the KV cache: who holds which block, the queues, recent throughput.

``kv_cache_state(engine, recent)`` assembles plain data from the engine core's own snapshots
(``KVCacheManager.snapshot()``, ``Scheduler.snapshot()``) and ``RecentStats``, a stat logger
that keeps per-second counts of the last minutes. It reads the engine's structures, so it
runs on the thread that steps the engine, between two steps (``AsyncLLM.call_in_engine``):
the picture is consistent and nothing needs a lock. One call is a pass over the blocks and
the block tables (~1 ms for 6k blocks), paid only when someone looks.

The JSON shape is documented in docs/dashboard.md (``GET /v1/kv_cache/state``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from pagedllm.engine.stats import StepStats

# Block states in ``blocks`` (one character per block).
FREE, CACHED, USED = "f", "c", "u"


class RecentStats:
    """Per-second sums of what each step did, over the last ``window`` seconds.

    Thread-safe: steps are recorded on the thread that receives them (the engine thread, or
    with data parallelism the thread reading the replicas) while the server reads it."""

    def __init__(self, window: float = 300.0, clock=time.monotonic):
        self.window = window
        self.clock = clock
        self._lock = threading.Lock()
        # [second, prompt tokens, generated tokens, prefix queries, prefix hits, preemptions]
        self._buckets: deque[list[int]] = deque()
        self.num_preemptions_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0

    def record(self, stats: StepStats) -> None:
        with self._lock:
            self._record(stats)

    def _record(self, stats: StepStats) -> None:
        now = int(self.clock())
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append([now, 0, 0, 0, 0, 0])
            while self._buckets and self._buckets[0][0] <= now - self.window:
                self._buckets.popleft()
        b = self._buckets[-1]
        b[1] += stats.num_prompt_tokens
        b[2] += stats.num_generation_tokens
        b[3] += stats.num_prefix_queries
        b[4] += stats.num_prefix_hits
        b[5] += stats.num_preemptions
        self.num_preemptions_total += stats.num_preemptions
        self.prefix_queries_total += stats.num_prefix_queries
        self.prefix_hits_total += stats.num_prefix_hits

    def series(self, bucket: int = 5) -> list[dict[str, float]]:
        """The window in ``bucket``-second slices, oldest first (empty slices included, so a
        plot's x axis is time): tokens/s, prefix-cache hit rate, preemptions."""
        now = int(self.clock())
        start = now - int(self.window) + 1
        n = -(-int(self.window) // bucket)
        sums = [[0] * 5 for _ in range(n)]
        with self._lock:
            buckets = [list(b) for b in self._buckets]
        for second, *counts in buckets:
            i = (second - start) // bucket
            if 0 <= i < n:
                for k, c in enumerate(counts):
                    sums[i][k] += c
        return [
            {
                "t": start + i * bucket - now,  # seconds relative to now (<= 0)
                "prompt_tps": s[0] / bucket,
                "generation_tps": s[1] / bucket,
                "prefix_hit_rate": s[3] / s[2] if s[2] else None,
                "preemptions": s[4],
            }
            for i, s in enumerate(sums)
        ]


def kv_cache_state(engine: Any, recent: RecentStats | None = None) -> dict[str, Any]:
    """The dashboard's JSON: the block pool, the queues and recent stats (engine thread only)."""
    kv = engine.kv_cache_manager
    pool = kv.snapshot()
    requests = engine.scheduler.snapshot(engine.held_requests())
    between = set(engine.beams.between_steps())  # a running search's beams, queued again between its steps
    for row in requests:
        if row["request_id"] in between:
            row["queue"] = "running"
    index: dict = {r["request_id"]: i for i, r in enumerate(requests)}
    # Beams that reported hold their blocks under a table of their own until their siblings do.
    for holder, prompt, output, most in engine.beams.holder_rows():
        index[holder] = len(requests)
        requests.append({
            "request_id": holder[1], "queue": "beam", "status": "holding", "num_computed_tokens": prompt + output,
            "num_tokens": prompt + output, "num_prompt_tokens": prompt, "num_output_tokens": output,
            "max_tokens": most, "num_preemptions": 0, "num_blocks": kv.num_held_blocks(holder),
        })  # fmt: skip
    owner = [-1] * pool.num_blocks  # the first owning request's index in ``requests``
    shared = []
    for block_id, holders in pool.owners.items():
        owner[block_id] = next((index[h] for h in holders if h in index), -1)
        if len(holders) > 1:
            shared.append(block_id)
    codes = bytes.maketrans(b"\x00\x01\x02", (FREE + CACHED + USED).encode())
    return {
        "time": time.time(),
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "num_used_blocks": pool.num_used,
        "num_cached_free_blocks": pool.num_cached_free,
        "num_free_blocks": pool.num_blocks - pool.num_used,
        "num_cached_blocks": pool.num_cached_blocks,
        "blocks": pool.states.translate(codes).decode(),
        "owner": owner,
        "shared": sorted(shared),
        "requests": requests,
        "num_running": sum(r["queue"] == "running" for r in requests),
        "num_waiting": sum(r["queue"] == "waiting" for r in requests),
        "num_preemptions_total": engine.scheduler.num_preemptions_total,
        "recent": recent_summary(recent),
    }


def recent_summary(recent: RecentStats | None) -> dict[str, Any]:
    """The state's ``recent`` part (it can be filled in apart from the engine: with data
    parallelism the snapshot comes from a replica process, the recent stats from the server's)."""
    if recent is None:
        return {}
    with recent._lock:
        queries, hits, preemptions = recent.prefix_queries_total, recent.prefix_hits_total, recent.num_preemptions_total
    return {
        "window_seconds": recent.window,
        "series": recent.series(),
        "prefix_hit_rate_total": hits / queries if queries else None,
        "num_preemptions_total": preemptions,
    }
