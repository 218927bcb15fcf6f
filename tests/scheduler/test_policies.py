"""Chunked prefill composition, prefix-cache admission and the priority policy, at the scheduler."""

from __future__ import annotations

import itertools

from pagedllm.request import Request, RequestStatus
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig

_ids = itertools.count()


def make(prompt_len: int, max_tokens: int = 10, priority: int = 0, first: int = 0) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt=None,
        prompt_token_ids=list(range(first, first + prompt_len)),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
    )


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = [[7] if s.samples else [] for s in out.scheduled]
    finished = sched.update_from_output(out, sampled)
    return out, finished


def test_decodes_get_a_token_every_step_while_a_long_prompt_prefills():
    kv = KVCacheManager(num_blocks=400, block_size=16)
    sched = Scheduler(SchedulerConfig(16, 256, 8192), kv)
    decoders = [make(20, max_tokens=100) for _ in range(3)]
    for r in decoders:
        sched.add_request(r)
    step(sched)  # their prefill
    long = make(4000, max_tokens=5)
    sched.add_request(long)
    steps = 0
    while long.num_computed_tokens < 4000:
        before = [len(r.output_token_ids) for r in decoders]
        out, _ = step(sched)
        steps += 1
        per_request = {s.req_id: s.num_new_tokens for s in out.scheduled}
        assert all(per_request[r.request_id] == 1 for r in decoders)
        assert [len(r.output_token_ids) for r in decoders] == [b + 1 for b in before]
        assert per_request[long.request_id] <= 256 - 3
    assert steps == -(-4000 // 253)  # the prompt took budget minus the decodes each step


def test_long_prefill_threshold_lets_two_prompts_progress_together():
    kv = KVCacheManager(num_blocks=400, block_size=16)
    sched = Scheduler(SchedulerConfig(16, 512, 8192, long_prefill_token_threshold=200), kv)
    a, b = make(1000), make(1000, first=5000)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert [(s.req_id, s.num_new_tokens) for s in out.scheduled] == [(a.request_id, 200), (b.request_id, 200)]


def test_prefix_hits_skip_computation_and_are_counted():
    kv = KVCacheManager(num_blocks=100, block_size=16, enable_caching=True)
    sched = Scheduler(SchedulerConfig(16, 4096, 8192), kv)
    system = list(range(100, 100 + 320))  # 20 full blocks
    a = make(0)
    a.prompt_token_ids[:] = system + [1, 2, 3]
    a.all_token_ids[:] = a.prompt_token_ids
    sched.add_request(a)
    out, _ = step(sched)
    assert out.num_prefix_hits == 0 and out.num_prefix_queries == 323
    b = make(0)
    b.prompt_token_ids[:] = system + [9, 9]
    b.all_token_ids[:] = b.prompt_token_ids
    sched.add_request(b)
    out, _ = step(sched)
    sb = next(s for s in out.scheduled if s.req_id == b.request_id)
    assert sb.num_computed_tokens == 320 and sb.num_new_tokens == 2
    assert b.num_cached_tokens == 320 and out.num_prefix_hits == 320
    assert out.num_uncacheable_tokens == 2


def test_prefix_stats_count_only_requests_that_looked_up_the_cache():
    """Caching off, or a request that wants prompt logprobs (every position computed): the
    cache is not read, so no lookup is counted (vLLM records none either)."""
    for caching in (False, True):
        kv = KVCacheManager(num_blocks=100, block_size=16, enable_caching=caching)
        sched = Scheduler(SchedulerConfig(16, 4096, 8192), kv)
        a = make(40)
        sched.add_request(a)
        out, _ = step(sched)
        assert (out.num_prefix_queries, out.num_uncacheable_tokens) == ((40, 8) if caching else (0, 0))
        b = make(40)
        b.sampling_params = SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=0)
        sched.add_request(b)
        out, _ = step(sched)
        assert b.num_cached_tokens == 0
        assert (out.num_prefix_queries, out.num_prefix_hits, out.num_uncacheable_tokens) == (0, 0, 0)


def test_priority_request_preempts_lower_priority_and_finishes_first():
    kv = KVCacheManager(num_blocks=12, block_size=16)
    sched = Scheduler(SchedulerConfig(8, 4096, 8192, scheduling_policy="priority"), kv)
    low = [make(60, max_tokens=40, priority=5, first=1000 * i) for i in range(3)]  # 4 blocks each at most
    for r in low:
        sched.add_request(r)
    step(sched)
    assert len(sched.running) == 3 and kv.num_free_blocks == 0
    high = make(30, max_tokens=5, priority=0, first=90000)
    sched.add_request(high)
    order = []
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        _, finished = step(sched)
        order += finished
    assert order[0] is high
    assert high.num_preemptions == 0 and sum(r.num_preemptions for r in low) >= 1
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in low)
    assert kv.num_free_blocks == 12


def test_fcfs_does_not_let_a_late_request_jump_the_queue():
    kv = KVCacheManager(num_blocks=12, block_size=16)
    sched = Scheduler(SchedulerConfig(8, 4096, 8192), kv)
    low = [make(60, max_tokens=40, priority=5, first=1000 * i) for i in range(3)]
    for r in low:
        sched.add_request(r)
    step(sched)
    late = make(30, max_tokens=5, priority=0, first=90000)
    sched.add_request(late)
    order = []
    while sched.has_unfinished_requests():
        order += step(sched)[1]
    assert order.index(late) > 0
