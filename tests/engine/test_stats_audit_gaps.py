"""The numbers in the periodic stats line, pinned with a fake clock (a mutation audit changed
each of them and no test failed): throughput per window, KV usage in percent, the prefix-cache
hit rate of the window, the preemptions so far, a waiting-only engine not taken for idle, and
the speculative-decoding line."""

from __future__ import annotations

import logging
import types

import pytest

from pagedllm.engine import stats as stats_mod
from pagedllm.engine.stats import SpecDecodeStats, StatsLogger, StepStats, spec_stats


@pytest.fixture()
def clock(monkeypatch):
    """The stats module's monotonic clock, set by the test."""
    now = [0.0]
    monkeypatch.setattr(stats_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def _step(prompt=0, generated=0, running=0, waiting=0, usage=0.0, preemptions=0, queries=0, hits=0, spec=None) -> StepStats:
    return StepStats(num_prompt_tokens=prompt, num_generation_tokens=generated, num_running=running, num_waiting=waiting,
                     kv_cache_usage=usage, num_preemptions=preemptions, num_prefix_queries=queries, num_prefix_hits=hits,
                     spec=spec)  # fmt: skip


def _lines(caplog, marker: str) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if marker in r.getMessage()]


def test_the_line_gives_each_windows_own_throughput_usage_hit_rate_and_total_preemptions(clock, caplog):
    """Two 2-second windows: the second line's throughput and hit rate are the second window's
    alone (not the totals since the start), usage is in percent, preemptions add up."""
    stats = StatsLogger(interval=2.0)
    with caplog.at_level(logging.DEBUG, logger="pagedllm.engine"):
        clock[0] = 1.0  # (inside the first window: counted, no line yet)
        stats.record(_step(prompt=60, generated=4, running=2, usage=0.125, preemptions=2, queries=80, hits=40))
        clock[0] = 2.0
        stats.record(_step(prompt=40, generated=16, running=2, waiting=1, usage=0.25, queries=20, hits=20))
        clock[0] = 4.0
        stats.record(_step(generated=10, running=1, usage=0.5, preemptions=1, queries=100, hits=0))
    lines = [msg for _, msg in _lines(caplog, "Avg prompt throughput")]
    assert len(lines) == 2, lines
    assert lines[0] == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 2 reqs, "
                        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 60.0%, Preemptions: 2")  # fmt: skip
    assert lines[1] == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 1 reqs, "
                        "Waiting: 0 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 0.0%, Preemptions: 3")  # fmt: skip
    assert (stats.prompt_tokens_total, stats.generation_tokens_total, stats.num_preemptions_total) == (100, 30, 3)
    assert (stats.prefix_queries_total, stats.prefix_hits_total) == (200, 60)


def test_requests_only_waiting_are_not_an_idle_engine(clock, caplog):
    """After idle lines went to DEBUG, a state with requests waiting (none running, no tokens
    yet: e.g. the KV cache is full) must be logged at INFO again."""
    stats = StatsLogger(interval=0)
    with caplog.at_level(logging.DEBUG, logger="pagedllm.engine"):
        for s in (_step(generated=3, running=1), _step(), _step(), _step(waiting=2)):
            clock[0] += 1.0
            stats.record(s)
    levels = [level for level, _ in _lines(caplog, "Avg prompt throughput")]
    assert levels == [logging.INFO, logging.INFO, logging.DEBUG, logging.INFO]


def test_the_spec_decode_line_sums_the_window_per_position(clock, caplog):
    """Two steps' drafts in one window: 3 drafts of 3 tokens, 4 accepted (positions 0: 3,
    1: 1): acceptance 4/9, mean acceptance length 1 + 4/3, per position accepted / drafts."""
    stats = StatsLogger(interval=2.0)
    with caplog.at_level(logging.DEBUG, logger="pagedllm.engine"):
        clock[0] = 1.0
        stats.record(_step(generated=5, running=2, spec=SpecDecodeStats(2, 6, 3, [2, 1])))
        clock[0] = 2.0
        stats.record(_step(generated=2, running=1, spec=SpecDecodeStats(1, 3, 1, [1])))
    (line,) = [msg for _, msg in _lines(caplog, "SpecDecoding metrics")]
    assert line == ("SpecDecoding metrics: Draft acceptance rate: 44.4%, Mean acceptance length: 2.33, Accepted: 4 tokens, "
                    "Drafted: 9 tokens, Per-position acceptance rate: 1.000, 0.333")  # fmt: skip
    assert (stats.spec_total.num_drafts, stats.spec_total.num_accepted_tokens, stats.spec_total.accepted_per_pos) == (3, 4, [3, 1])


def test_spec_stats_counts_only_the_accepted_positions():
    """A draft of 3 tokens with 1 accepted: positions 1 and 2 were rejected and count nothing
    (a self-draft accepts every token, so the engine tests cannot tell)."""
    scheduled = [types.SimpleNamespace(spec_token_ids=[7, 8, 9], num_accepted=lambda tokens: 1),
                 types.SimpleNamespace(spec_token_ids=[], num_accepted=lambda tokens: None),  # no draft this step
                 types.SimpleNamespace(spec_token_ids=[4, 5], num_accepted=lambda tokens: 2)]  # fmt: skip
    s = spec_stats(types.SimpleNamespace(scheduled=scheduled), [[7, 3], [1], [4, 5, 6]])
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (2, 5, 3, [2, 1])
