"""Engine statistics: counted by the engine after each step, read by loggers (and metrics).

Nothing here runs inside the scheduler; the engine hands over plain numbers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pagedllm.kv_connector.base import KVConnectorStats
from pagedllm.scheduler.output import SchedulerOutput

logger = logging.getLogger("pagedllm.engine")


@dataclass
class SpecDecodeStats:
    """Speculative decoding of one step (or summed): vLLM's spec_decode counters."""

    num_drafts: int = 0  # requests that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts whose position j was accepted

    def add(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(other.accepted_per_pos) > len(self.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for j, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[j] += n


def spec_stats(out: SchedulerOutput, sampled: list[list[int]]) -> SpecDecodeStats | None:
    """What the step's drafts gave: a draft of k tokens with a accepted emits a + 1 tokens."""
    stats = None
    for s, tokens in zip(out.scheduled, sampled):
        accepted = s.num_accepted(tokens)
        if accepted is None:
            continue
        stats = stats or SpecDecodeStats()
        stats.add(SpecDecodeStats(1, len(s.spec_token_ids), accepted, [1] * accepted))
    return stats


@dataclass
class StepStats:
    num_prompt_tokens: int  # prompt tokens reached for the first time this step (cache hits included)
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
    spec: SpecDecodeStats | None = None  # None: no drafts verified this step
    kv_connector: KVConnectorStats | None = None  # None: no connector, or it did nothing
    # LoRA engines: requests per adapter name, (running, waiting), after the step; else None.
    lora: tuple[dict[str, int], dict[str, int]] | None = None


class StatsLogger:
    """Every ``interval`` seconds, one line like vLLM's with throughput since the last line.

    The engine records after each step and, while idle or after an abort, its state alone
    (``LLMEngine.record_state``), so the line that follows the last request says it is over.
    Later idle lines go to DEBUG, as vLLM's do, so an idle server does not fill its log."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self._idle_logged = True  # nothing to report before the first request
        self._reset(time.monotonic())
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.scheduled_tokens_total = 0  # tokens the model ran (prompt chunks not cached or loaded, decodes, drafts)
        self.num_preemptions_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0
        self.spec_total = SpecDecodeStats()

    def _reset(self, now: float) -> None:
        self._last_log = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._spec = SpecDecodeStats()
        self._kv_connector = KVConnectorStats()

    def record(self, stats: StepStats) -> None:
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        self.prompt_tokens_total += stats.num_prompt_tokens
        self.generation_tokens_total += stats.num_generation_tokens
        self.scheduled_tokens_total += stats.num_scheduled_tokens
        self.num_preemptions_total += stats.num_preemptions
        self._prefix_queries += stats.num_prefix_queries
        self._prefix_hits += stats.num_prefix_hits
        self.prefix_queries_total += stats.num_prefix_queries
        self.prefix_hits_total += stats.num_prefix_hits
        if stats.spec is not None:
            self._spec.add(stats.spec)
            self.spec_total.add(stats.spec)
        if stats.kv_connector is not None:
            self._kv_connector.add(stats.kv_connector)
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed >= self.interval:
            idle = not (self._prompt_tokens or self._generation_tokens or stats.num_running or stats.num_waiting)
            logger.log(
                logging.DEBUG if idle and self._idle_logged else logging.INFO,
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
            self._idle_logged = idle
            spec = self._spec
            if spec.num_drafts:
                logger.info(
                    "SpecDecoding metrics: Draft acceptance rate: %.1f%%, Mean acceptance length: %.2f, "
                    "Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: %s",
                    100 * spec.num_accepted_tokens / max(1, spec.num_draft_tokens),
                    1 + spec.num_accepted_tokens / spec.num_drafts,
                    spec.num_accepted_tokens,
                    spec.num_draft_tokens,
                    ", ".join(f"{n / spec.num_drafts:.3f}" for n in spec.accepted_per_pos),
                )
            kv = self._kv_connector
            if kv != KVConnectorStats():
                logger.info(
                    "KV connector: store hit rate %.1f%% of %d blocks, loaded %d blocks (%.1f MiB), saved %d "
                    "blocks (%.1f MiB), rejected %d, dropped %d",
                    100 * kv.hit_rate, kv.num_queried_blocks, kv.num_loaded_blocks, kv.num_loaded_bytes / (1 << 20),
                    kv.num_saved_blocks, kv.num_saved_bytes / (1 << 20), kv.num_rejected_blocks, kv.num_dropped_saves,
                )  # fmt: skip
            self._reset(now)
