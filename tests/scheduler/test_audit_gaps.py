"""Scheduler behaviours a mutation audit found unpinned: each test below failed no existing test
when the rule it names was broken (zero-token entries, swap victims scheduled twice, a
withdrawn victim left in the step, fcfs queue jumping, extra samples in a chunked recompute,
an in-flight victim, finished ids reported never or forever, skipped requests reordered)."""

from __future__ import annotations

from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.request import RequestStatus
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import (
    expected_outputs,
    fake_token,
    make_request,
    make_scheduler,
    run_to_completion,
    scheduled_ids,
    step,
)


def _sampled(sched, out):
    """What ``step`` feeds back, for a swap-mode step (``step``'s checks expect recompute)."""
    return [[fake_token(sched.requests[s.req_id])] if s.samples else [] for s in out.scheduled]


def test_a_running_request_left_without_budget_is_not_scheduled_with_zero_tokens():
    """An earlier request's drafts can take the whole token budget: the running requests after
    it sit this step out rather than appear with 0 new tokens (an entry the runner cannot run
    and that would wrongly mark a decode as not sampling)."""
    sched = make_scheduler(max_num_batched_tokens=6)
    a, b = make_request("a", 3, 20), make_request("b", 3, 20)
    for r in (a, b):
        sched.add_request(r)
    step(sched)
    a.spec_token_ids = [7, 8, 9, 10, 11]
    out = sched.schedule()
    assert scheduled_ids(out) == ["a"] and out.num_scheduled_tokens == 6
    assert all(s.num_new_tokens > 0 for s in out.scheduled)
    sched.update_from_output(out, [[fake_token(a)]])
    assert scheduled_ids(sched.schedule()) == ["a", "b"]  # b runs in the next step


def test_a_swapped_out_victim_is_not_scheduled_later_in_the_same_step():
    """Swap preemption: the newest request, swapped out for an older one's block, is in the
    waiting queue for the rest of the step; the running loop must not schedule it (it still
    walks a copy of the running list that holds it)."""
    kv = KVCacheManager(num_blocks=6, block_size=4, num_swap_blocks=8)
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256, max_model_len=1024, preemption_mode="swap")
    sched = Scheduler(config, kv)
    a, b, c = make_request("a", 8, 4), make_request("b", 8, 4), make_request("c", 7, 5)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, _sampled(sched, out))
    assert kv.num_free_blocks == 0
    out = sched.schedule()  # a and b need a third block: c is swapped out
    assert out.preempted_ids == ["c"] and scheduled_ids(out) == ["a", "b"]
    assert c.status is RequestStatus.SWAPPED and list(sched.waiting) == [c]
    assert c.num_computed_tokens == 7 and sched.running == [a, b]
    sched.update_from_output(out, _sampled(sched, out))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not out.is_empty
        sched.update_from_output(out, _sampled(sched, out))
    for r in (a, b, c):
        assert r.output_token_ids == expected_outputs(r, r.max_tokens)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_priority_victim_already_scheduled_this_step_is_withdrawn_and_its_budget_refunded():
    """Priority policy: the victim (largest priority value) can be a running request scheduled
    earlier in the same step; it is taken out of the step (no entry for a request whose blocks
    were freed) and its tokens go back to the budget."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=1024, scheduling_policy="priority")
    sched = Scheduler(config, kv)
    low, high = make_request("low", 5, 3), make_request("high", 4, 4)
    low.priority, high.priority = 5, 0
    sched.add_request(low)
    step(sched)  # low: 2 blocks (room to 8 tokens)
    sched.add_request(high)
    step(sched)  # high: 1 full block; the pool is dry
    assert sched.running == [low, high] and kv.num_free_blocks == 0
    out, _ = step(sched)  # low fits its token; high needs a block: low goes
    assert out.preempted_ids == ["low"] and scheduled_ids(out) == ["high"]
    assert out.num_scheduled_tokens == 1
    assert low.status is RequestStatus.PREEMPTED and kv.get_block_ids("low") == []
    run_to_completion(sched)
    for r in (low, high):
        assert r.output_token_ids == expected_outputs(r, r.max_tokens)


def test_fcfs_head_lacking_blocks_is_not_overtaken_while_requests_run():
    """fcfs: when the waiting queue's head does not fit the free blocks while something runs,
    admission stops there; a smaller request behind it must not slip in (and keep taking the
    blocks the head waits for, starving it)."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    a = make_request("a", 8, 4)  # 2 blocks, 3 at the end
    big = make_request("big", 12, 1)  # 3 blocks
    small = make_request("small", 2, 1)  # 1 block
    for r in (a, big, small):
        sched.add_request(r)
    out, _ = step(sched)
    assert scheduled_ids(out) == ["a"]
    assert list(sched.waiting) == [big, small]
    run_to_completion(sched)
    assert big.first_scheduled_time <= small.first_scheduled_time


def test_a_recompute_in_chunks_samples_only_at_its_last_known_token():
    """A preempted request is recomputed from prompt + generated tokens; when the budget cuts
    that into chunks, a chunk that ends past the prompt but before the last known token must
    not sample (an extra sample would append a wrong token to the output)."""
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 4, 8), make_request("b", 4, 8)
    for r in (a, b):
        sched.add_request(r)
    while b.status is not RequestStatus.PREEMPTED:
        step(sched)
    assert len(b.output_token_ids) == 5  # 9 tokens to recompute
    sched.config.max_num_batched_tokens = 6  # b's recompute now runs in chunks
    chunks = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)  # (check_step: samples exactly when a chunk reaches num_tokens)
        chunks += [(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in out.scheduled if s.req_id == "b"]
    assert any(0 < c + n < 9 and c + n > 4 and not smp for c, n, smp in chunks), chunks  # the case arose
    assert b.output_token_ids == expected_outputs(b, 8)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_an_in_flight_request_is_not_chosen_as_victim_for_an_older_one():
    """The newest running request is the fcfs victim, but not while it is in flight (its
    results are still to come back): the older request that lacks a block waits instead."""
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 8, 4), make_request("b", 8, 4)
    for r in (a, b):
        sched.add_request(r)
    step(sched)
    blocked = sched.schedule(in_flight={"b"})
    assert blocked.is_empty and not blocked.preempted_ids
    assert sched.running == [a, b] and b.status is RequestStatus.RUNNING
    assert len(sched.kv.get_block_ids("b")) == 2


def test_finished_ids_are_reported_once_in_the_next_step():
    """The runner forgets a request's state through ``finished_req_ids``: every request that
    ended (finished or aborted) is reported in the next step's output, and only there."""
    sched = make_scheduler()
    a, b, c = make_request("a", 3, 1), make_request("b", 3, 5), make_request("c", 3, 5)
    for r in (a, b):
        sched.add_request(r)
    out, finished = step(sched)
    assert finished == [a] and out.finished_req_ids == set()
    sched.add_request(c)
    sched.abort("b")
    out, _ = step(sched)
    assert out.finished_req_ids == {"a", "b"}
    out, _ = step(sched)
    assert out.finished_req_ids == set()


def test_requests_skipped_for_their_adapter_keep_their_order():
    """With max_loras adapters running, waiting requests for other adapters are passed over
    this step and put back at the front in their original order (fcfs), so they start in
    arrival order once slots free up."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, max_loras=1)
    sched = Scheduler(config, KVCacheManager(num_blocks=64, block_size=4))
    reqs = {}
    for rid, lora_id in (("r1", 1), ("x", 2), ("y", 3), ("z", 0)):
        r = make_request(rid, 3, 4)
        if lora_id:
            r.lora_request = LoRARequest(f"lora{lora_id}", lora_id, f"/nonexistent/{lora_id}")
        reqs[rid] = r
        sched.add_request(r)
    out, _ = step(sched)
    assert scheduled_ids(out) == ["r1", "z"]
    assert [r.request_id for r in sched.waiting] == ["x", "y"]
