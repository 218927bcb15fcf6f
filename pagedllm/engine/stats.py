"""Engine statistics: counted by the engine after each step, read by loggers (and metrics).

Nothing here runs inside the scheduler; the engine hands over plain numbers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("pagedllm.engine")


@dataclass
class StepStats:
    num_prompt_tokens: int  # prompt tokens run for the first time this step
    num_generation_tokens: int  # tokens sampled this step
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # this step
    num_scheduled_tokens: int = 0  # all tokens run this step
    # Prefix cache, in tokens, over requests admitted for the first time this step.
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_uncacheable_tokens: int = 0


class StatsLogger:
    """Every ``interval`` seconds, one line like vLLM's with throughput since the last line."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self._reset(time.monotonic())
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0

    def _reset(self, now: float) -> None:
        self._last_log = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    def record(self, stats: StepStats) -> None:
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        self.prompt_tokens_total += stats.num_prompt_tokens
        self.generation_tokens_total += stats.num_generation_tokens
        self.num_preemptions_total += stats.num_preemptions
        self._prefix_queries += stats.num_prefix_queries
        self._prefix_hits += stats.num_prefix_hits
        self.prefix_queries_total += stats.num_prefix_queries
        self.prefix_hits_total += stats.num_prefix_hits
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed >= self.interval:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                "Preemptions: %d",
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                stats.num_running,
                stats.num_waiting,
                100 * stats.kv_cache_usage,
                100 * self._prefix_hits / max(1, self._prefix_queries),
                self.num_preemptions_total,
            )
            self._reset(now)
