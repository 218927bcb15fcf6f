"""The periodic stats line and the stat loggers between steps: the line after the last request
says it is over, later idle lines go to DEBUG, and an idle engine still reports its state."""

from __future__ import annotations

import logging
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.stats import StatsLogger, StepStats


def _stats(generated: int, running: int) -> StepStats:
    return StepStats(num_prompt_tokens=0, num_generation_tokens=generated, num_running=running, num_waiting=0,
                     kv_cache_usage=0.1 * running, num_preemptions=0)  # fmt: skip


def test_the_line_after_the_work_says_it_is_over_and_idle_lines_after_it_are_debug(caplog):
    stats = StatsLogger(interval=0)
    with caplog.at_level(logging.DEBUG, logger="pagedllm.engine"):
        for s in (_stats(5, 1), _stats(0, 0), _stats(0, 0), _stats(0, 0), _stats(3, 1), _stats(0, 0)):
            stats.record(s)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert [level for level, _ in lines] == [logging.INFO, logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO, logging.INFO]
    assert "Running: 1 reqs" in lines[0][1] and "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in lines[1][1]


def test_an_idle_engine_reports_its_state(tiny_llama):
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9)
    seen: list[StepStats] = []
    try:
        llm.add_stat_logger(type("Seen", (), {"record": staticmethod(seen.append)})())
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        llm.shutdown()
    assert len(seen) >= 2, "no stats while idle: the periodic line and the gauges would stop"
    assert all(s.num_generation_tokens == 0 and s.num_running == 0 and s.num_scheduled_tokens == 0 for s in seen)


def test_the_progress_bar_estimates_speed_from_every_finished_request():
    """One bar for one engine and for data-parallel replicas (whose bar had no speed)."""
    from pagedllm.engine.progress import ProgressBar
    from pagedllm.outputs import CompletionOutput, RequestOutput

    bar = ProgressBar(2, enabled=True)
    try:
        for prompt, outputs in (([1, 2, 3], [[4, 5]]), ([6], [[7], [8, 9, 10]])):
            samples = [CompletionOutput(i, "", tokens, finish_reason="length") for i, tokens in enumerate(outputs)]
            bar.finished(RequestOutput("r", None, prompt, samples, finished=True))
        assert (bar.input_tokens, bar.output_tokens, bar.bar.n) == (4, 6, 2)
        assert "est. speed input:" in bar.bar.postfix and "output:" in bar.bar.postfix
    finally:
        bar.close()
