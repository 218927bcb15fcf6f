"""ServerMetrics fed directly (step stats and request outputs, with a fake clock): what each
Prometheus series counts, pinned where a mutation audit changed it and no test failed - the
intervals behind TTFT / ITL / e2e / TPOT, finish-reason labels, counters fed from the wrong
field, idle steps in the step-size histogram, per-position spec labels, and per-request state
that outlived its request."""

from __future__ import annotations

import types

import pytest

from pagedllm.engine.stats import SpecDecodeStats, StepStats
from pagedllm.entrypoints.openai import metrics as metrics_mod
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9)


@pytest.fixture()
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0]))
    return now


@pytest.fixture()
def metrics(engine, clock):
    fake = types.SimpleNamespace(engine=engine, num_running=lambda: 0, num_waiting=lambda: 0, kv_cache_usage=lambda: 0.0,
                                 data_parallel_size=1, add_stat_logger=lambda s: None, output_hooks=[], request_hooks=[])  # fmt: skip
    return metrics_mod.ServerMetrics(fake, "m")


def _value(metrics, name: str, **labels) -> float:
    v = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if v is None else v


def _out(rid, tokens, finished=False, reason=None, metrics=None, index=0, rejected=False) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(index, "", tokens, finish_reason=reason)], finished,
                         metrics=metrics, rejected=rejected)  # fmt: skip


def _step(**kw) -> StepStats:
    base = dict(num_prompt_tokens=0, num_generation_tokens=0, num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0)
    return StepStats(**{**base, **kw})


def test_step_counters_take_their_own_fields_and_idle_steps_are_not_step_sizes(metrics):
    """The engine reports its state while idle (num_scheduled_tokens 0) about once a second:
    those reports must not fill iteration_tokens_total's lowest bucket."""
    metrics.record(_step(num_prompt_tokens=10, num_generation_tokens=3, num_scheduled_tokens=7, num_preemptions=2,
                         num_prefix_queries=16, num_prefix_hits=8, num_uncacheable_tokens=5))  # fmt: skip
    for _ in range(3):
        metrics.record(_step())  # idle state reports
    assert _value(metrics, "pagedllm:prompt_tokens_total") == 10
    assert _value(metrics, "pagedllm:generation_tokens_total") == 3
    assert _value(metrics, "pagedllm:num_preemptions_total") == 2
    assert _value(metrics, "pagedllm:prefix_cache_queries_total") == 16
    assert _value(metrics, "pagedllm:prefix_cache_hits_total") == 8
    assert _value(metrics, "pagedllm:prefix_cache_uncacheable_tokens_total") == 5
    assert _value(metrics, "pagedllm:iteration_tokens_total_count") == 1
    assert _value(metrics, "pagedllm:iteration_tokens_total_sum") == 7


def test_spec_decode_counters_and_their_position_labels(metrics):
    """Position j counts drafts whose j-th token was accepted (0-based, as vLLM's)."""
    metrics.record(_step(num_generation_tokens=6, spec=SpecDecodeStats(2, 6, 3, [2, 1])))
    assert _value(metrics, "pagedllm:spec_decode_num_drafts_total") == 2
    assert _value(metrics, "pagedllm:spec_decode_num_draft_tokens_total") == 6
    assert _value(metrics, "pagedllm:spec_decode_num_accepted_tokens_total") == 3
    assert _value(metrics, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    assert _value(metrics, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert _value(metrics, "pagedllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 0


def test_latency_histograms_measure_their_own_intervals(metrics, clock):
    """Arrival 100, first scheduled 101, first token 103, then 3 tokens at once (drafts) at
    106 and a last token at 107 (finish): TTFT 3 (from arrival, not from scheduling), the 3
    tokens are 3 gaps of 1 s (not 3 of 3 s), e2e 7, TPOT (107 - 103) / (5 - 1)."""
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=101.0)
    clock[0] = 103.0
    m.first_token_time = 103.0
    metrics.on_output(_out("r", [5], metrics=m))
    clock[0] = 106.0
    metrics.on_output(_out("r", [6, 7, 8], metrics=m))
    clock[0] = 107.0
    m.finished_time = 107.0
    metrics.on_output(_out("r", [9], finished=True, reason="length", metrics=m))
    assert _value(metrics, "pagedllm:time_to_first_token_seconds_sum") == pytest.approx(3.0)
    assert _value(metrics, "pagedllm:inter_token_latency_seconds_count") == 4
    assert _value(metrics, "pagedllm:inter_token_latency_seconds_sum") == pytest.approx(4.0)
    assert _value(metrics, "pagedllm:inter_token_latency_seconds_bucket", le="1.0") == 4
    assert _value(metrics, "pagedllm:e2e_request_latency_seconds_sum") == pytest.approx(7.0)
    assert _value(metrics, "pagedllm:request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert _value(metrics, "pagedllm:request_time_per_output_token_seconds_sum") == pytest.approx(1.0)


def test_an_output_held_to_the_end_spreads_its_gaps_up_to_its_finish_not_the_hook(metrics, clock):
    """best_of / beam search: every token arrives in one final output. Its gaps run from the
    first token to the engine's finish time, not to whenever the hook happens to run."""
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0, first_token_time=101.0, finished_time=105.0)
    clock[0] = 150.0  # (the hook runs late)
    metrics.on_output(_out("b", [5, 6, 7, 8, 9], finished=True, reason="length", metrics=m))
    assert _value(metrics, "pagedllm:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert _value(metrics, "pagedllm:inter_token_latency_seconds_count") == 4
    assert _value(metrics, "pagedllm:inter_token_latency_seconds_sum") == pytest.approx(4.0)


def test_request_success_is_labelled_by_finish_reason(metrics, clock):
    """stop and length apart; a finished output with no reason (an abort before any token)
    counts as abort; every reason's series exists from the start."""
    for reason in ("stop", "length", "abort", "error"):
        assert metrics.registry.get_sample_value("pagedllm:request_success_total", {"model_name": "m", "finished_reason": reason}) == 0
    for rid, reason in (("a", "stop"), ("b", "stop"), ("c", "length"), ("d", "error")):
        metrics.on_output(_out(rid, [5], finished=True, reason=reason, metrics=RequestMetrics(arrival_time=99.0)))
    metrics.on_output(_out("e", [], finished=True, metrics=RequestMetrics(arrival_time=99.0)))
    got = {r: _value(metrics, "pagedllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")}
    assert got == {"stop": 2, "length": 1, "abort": 1, "error": 1}


def test_a_request_id_used_again_after_its_finish_starts_afresh(metrics, clock):
    """A client may reuse its own request id once the first request finished: the second's
    first token is a time to first token (not an inter-token gap from the first request's last
    token), and its token counts start from 0. Nothing of a finished request stays behind."""
    metrics.on_request("x", types.SimpleNamespace(sampling_params=SamplingParams(n=1, max_tokens=2)))
    m1 = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0, first_token_time=101.0)
    clock[0] = 101.0
    metrics.on_output(_out("x", [5], metrics=m1))
    clock[0] = 102.0
    m1.finished_time = 102.0
    metrics.on_output(_out("x", [6], finished=True, reason="length", metrics=m1))
    clock[0] = 110.0
    m2 = RequestMetrics(arrival_time=109.0, first_scheduled_time=109.0, first_token_time=110.0, finished_time=110.0)
    metrics.on_output(_out("x", [7], finished=True, reason="length", metrics=m2))
    assert _value(metrics, "pagedllm:time_to_first_token_seconds_count") == 2
    assert _value(metrics, "pagedllm:inter_token_latency_seconds_count") == 1
    assert _value(metrics, "pagedllm:request_generation_tokens_sum") == 3  # 2 + 1
    assert _value(metrics, "pagedllm:request_max_num_generation_tokens_sum") == 3
    assert metrics._last_token_time == {} and metrics._output_tokens == {} and metrics._params == {}


def test_a_request_rejected_after_admission_moves_no_metric(metrics, clock):
    """A constraint that admits no output: the client got a 400, so (as for a request refused
    before the engine) it is no finished request, latency or parameter observation."""
    metrics.on_request("z", types.SimpleNamespace(sampling_params=SamplingParams(n=1, max_tokens=4)))
    m = RequestMetrics(arrival_time=99.0, first_scheduled_time=99.5)
    metrics.on_output(_out("z", [], finished=True, reason="error", metrics=m, rejected=True))
    assert sum(_value(metrics, "pagedllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")) == 0
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_params_n", "request_prompt_tokens"):
        assert _value(metrics, f"pagedllm:{name}_count") == 0, name
    assert metrics._params == {}
