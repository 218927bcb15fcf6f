"""Scheduler tests with a real KVCacheManager and a fake, deterministic "model".

Each step: ``schedule()``, then a token for every scheduled request whose chunk ``samples``
(else None), then ``update_from_output``. The fake model's token depends only on the
request's tokens so far, so a preempted and recomputed request must produce the same
outputs as one that was never preempted.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.request import Request, RequestStatus
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.output import SchedulerOutput
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig


# --------------------------------------------------------------------------- helpers
def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 1024,
) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len
    )
    return Scheduler(config, kv)


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    *,
    eos: tuple[int, ...] = (),
    stop: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=list(stop), ignore_eos=ignore_eos)
    prompt = [1000 + 17 * len(rid) + i for i in range(prompt_len)]
    return Request(rid, None, prompt, params, eos_token_ids=frozenset(eos))


def fake_token(req: Request) -> int:
    """Deterministic next token from the request's tokens so far; never below 10."""
    return 10 + (sum(req.all_token_ids) * 31 + req.num_tokens) % 80


def check_step(sched: Scheduler, out: SchedulerOutput, computed_before: dict[str, int]) -> None:
    """Invariants of one schedule() result, checked before the outputs are applied."""
    cfg, kv = sched.config, sched.kv
    ids = [s.req_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert out.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    # Running requests (oldest first) come first, newly admitted ones after them.
    assert [s.req_id for s in out.scheduled] == [r.request_id for r in sched.running[: len(out.scheduled)]]
    for s in out.scheduled:
        req = sched.requests[s.req_id]
        assert s.samples == (s.num_computed_tokens + s.num_new_tokens == req.num_tokens)
        # Plain data: a request is described in full exactly when it was just admitted.
        assert (s.new is not None) == (computed_before.get(req.request_id) is None)
        if s.new is not None:
            assert s.new.prompt_token_ids == req.prompt_token_ids and s.new.output_token_ids == req.output_token_ids
        assert req.status is RequestStatus.RUNNING
        assert s.num_new_tokens > 0
        assert s.num_computed_tokens == computed_before.get(req.request_id, req.num_computed_tokens)
        assert s.num_computed_tokens + s.num_new_tokens <= req.num_tokens
        assert s.block_ids == kv.get_block_ids(req.request_id)
        assert len(s.block_ids) == cdiv(s.num_computed_tokens + s.num_new_tokens, kv.block_size)
    for rid in out.preempted_ids:
        req = next(r for r in sched.waiting if r.request_id == rid)
        assert req.status is RequestStatus.PREEMPTED
        assert req.num_computed_tokens == 0
        assert kv.get_block_ids(rid) == []
    kv.check_integrity()


def step(sched: Scheduler, token_fn=fake_token) -> tuple[SchedulerOutput, list[Request]]:
    computed_before = {r.request_id: r.num_computed_tokens for r in sched.running}
    out = sched.schedule()
    check_step(sched, out, computed_before)
    sampled = [token_fn(sched.requests[s.req_id]) if s.samples else None for s in out.scheduled]
    out.sampled = sampled  # kept for the tests' inspection
    finished = sched.update_from_output(out, [[] if t is None else [t] for t in sampled])
    for req in finished:
        assert req.status.finished
        assert req not in sched.running and req not in sched.waiting
        assert req.request_id not in sched.requests
        assert sched.kv.get_block_ids(req.request_id) == []  # freed at once
    sched.kv.check_integrity()
    return out, finished


def run_to_completion(sched: Scheduler, max_steps: int = 1000, token_fn=fake_token) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "scheduler made no progress"
        out, _ = step(sched, token_fn)
        assert not out.is_empty, "a step scheduled nothing while requests were unfinished"
        outs.append(out)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.block_pool.blocks)
    assert sched.requests == {}
    return outs


def expected_outputs(req: Request, n: int, token_fn=fake_token) -> list[int]:
    """The first ``n`` tokens ``req`` generates when run alone, never preempted."""
    r = Request("ref", None, list(req.prompt_token_ids), req.sampling_params)
    for _ in range(n):
        r.append_output_token(token_fn(r))
    return r.output_token_ids


def scheduled_ids(out: SchedulerOutput) -> list[str]:
    return [s.req_id for s in out.scheduled]


# --------------------------------------------------------------------------- max_num_seqs
def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 4, 3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)

    out, _ = step(sched)
    assert scheduled_ids(out) == ["r0", "r1"]
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "r4"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_computed_tokens == 0

    admitted_at = {}
    step_no = 1
    while sched.has_unfinished_requests():
        for r in sched.running:
            admitted_at.setdefault(r.request_id, step_no)
        assert len(sched.running) <= 2
        out, _ = step(sched)
        step_no += 1
        assert len(out.scheduled) <= 2
    # FIFO admission, two at a time: r0/r1 finish after 3 steps, then r2/r3, then r4.
    assert [admitted_at[f"r{i}"] for i in range(5)] == [1, 1, 4, 4, 7]
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert len(r.output_token_ids) == 3
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# --------------------------------------------------------------------------- token budget / chunked prefill
def test_token_budget_chunks_long_prompt_and_decodes_go_first():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    a = make_request("a", 3, 20)
    sched.add_request(a)
    out, _ = step(sched)
    assert [(s.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 3)]
    assert len(a.output_token_ids) == 1

    b = make_request("b", 20, 2)
    sched.add_request(b)
    chunks = []
    while not b.output_token_ids:
        out, _ = step(sched)
        assert out.num_scheduled_tokens <= 8
        # The running request's decode token comes first, every step.
        first = out.scheduled[0]
        assert (first.req_id, first.num_new_tokens) == ("a", 1)
        assert out.sampled[0] is not None
        sb = out.scheduled[1]
        assert sb.req_id == b.request_id
        chunks.append((sb.num_computed_tokens, sb.num_new_tokens, len(sb.block_ids), out.sampled[1] is not None))
    # 20 prompt tokens over budgets of 8 - 1 = 7: chunks of 7, 7, 6; only the last samples.
    assert chunks == [(0, 7, 2, False), (7, 7, 4, False), (14, 6, 5, True)]
    assert b.num_computed_tokens == 20
    assert len(b.output_token_ids) == 1
    assert len(a.output_token_ids) == 4  # one decode per step, never skipped

    out, _ = step(sched)
    assert [(s.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    run_to_completion(sched)
    assert len(a.output_token_ids) == 20 and len(b.output_token_ids) == 2
    assert b.output_token_ids == expected_outputs(b, 2)
    assert a.output_token_ids == expected_outputs(a, 20)


def test_prompt_longer_than_budget_is_chunked_and_samples_only_at_end():
    sched = make_scheduler(block_size=16, max_num_batched_tokens=16)
    r = make_request("r", 40, 3)
    sched.add_request(r)
    seen = []
    for _ in range(3):
        out, _ = step(sched)
        (s,) = out.scheduled
        seen.append((s.num_computed_tokens, s.num_new_tokens))
    assert seen == [(0, 16), (16, 16), (32, 8)]
    assert len(r.output_token_ids) == 1  # only the last chunk sampled
    assert r.num_computed_tokens == 40
    assert sched.kv.get_block_ids("r") == [0, 1, 2]
    run_to_completion(sched)
    assert r.output_token_ids == expected_outputs(r, 3)


def test_budget_limits_admission():
    sched = make_scheduler(max_num_batched_tokens=10)
    for rid, n in (("a", 6), ("b", 6), ("c", 6)):
        sched.add_request(make_request(rid, n, 4))
    out, _ = step(sched)
    # a takes 6, b gets the remaining 4 as a first chunk, c waits (no budget left).
    assert [(s.req_id, s.num_new_tokens, t is not None) for s, t in zip(out.scheduled, out.sampled)] == [
        ("a", 6, True),
        ("b", 4, False),
    ]
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, _ = step(sched)
    assert [(s.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 2), ("c", 6)]
    assert out.num_scheduled_tokens == 9
    run_to_completion(sched)


# --------------------------------------------------------------------------- finishing
def test_finish_by_max_tokens_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=16, block_size=4)
    short = make_request("short", 5, 3)
    long = make_request("long", 5, 10)
    sched.add_request(short)
    sched.add_request(long)
    finished_at = None
    for i in range(3):
        _, finished = step(sched)
        if finished:
            finished_at = i
            assert finished == [short]
    assert finished_at == 2
    assert short.status is RequestStatus.FINISHED_LENGTH
    assert short.finish_reason == "length"
    assert len(short.output_token_ids) == 3
    assert short.output_token_ids == expected_outputs(short, 3)
    assert short.finished_time is not None and short.first_token_time is not None
    # Only the long request's blocks are still in use: it has computed 5 + 2 = 7 tokens.
    assert sched.kv.get_block_ids("short") == []
    assert sched.kv.num_free_blocks == 16 - len(sched.kv.get_block_ids("long"))
    assert len(sched.kv.get_block_ids("long")) == cdiv(long.num_computed_tokens, 4) == 2
    assert sched.running == [long]
    run_to_completion(sched)
    assert len(long.output_token_ids) == 10


def test_finish_by_eos():
    eos = 7
    sched = make_scheduler()
    r = make_request("r", 4, 50, eos=(eos, 8))
    other = make_request("other", 4, 6)
    sched.add_request(r)
    sched.add_request(other)

    def tokens(req):
        return eos if req is r and len(req.output_token_ids) == 2 else 20

    finished_all = []
    while not finished_all:
        _, finished_all = step(sched, tokens)
    assert finished_all == [r]
    assert r.output_token_ids == [20, 20, eos]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.stop_reason is None
    assert sched.kv.get_block_ids("r") == []
    assert sched.running == [other]
    # EOS only stops the request that declares it.
    run_to_completion(sched, token_fn=lambda req: eos)
    assert other.status is RequestStatus.FINISHED_LENGTH and len(other.output_token_ids) == 6


def test_ignore_eos_keeps_generating():
    sched = make_scheduler()
    r = make_request("r", 4, 5, eos=(7,), ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, token_fn=lambda req: 7)
    assert r.output_token_ids == [7] * 5
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_finish_by_stop_token_ids():
    sched = make_scheduler()
    r = make_request("r", 4, 50, stop=(42, 43))
    sched.add_request(r)
    run_to_completion(sched, token_fn=lambda req: 43 if len(req.output_token_ids) == 4 else 11)
    assert r.output_token_ids == [11, 11, 11, 11, 43]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 43


def test_stop_on_first_token():
    sched = make_scheduler()
    r = make_request("r", 9, 50, eos=(2,))
    sched.add_request(r)
    outs = run_to_completion(sched, token_fn=lambda req: 2)
    assert len(outs) == 1
    assert r.output_token_ids == [2] and r.status is RequestStatus.FINISHED_STOPPED


# --------------------------------------------------------------------------- preemption
def test_preemption_of_most_recent_request_and_recompute():
    # 4 blocks of 4 tokens. a and b (4-token prompts, 8 new tokens) each need 3 blocks in
    # the end, so they cannot both finish without one of them being preempted.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a = make_request("a", 4, 8)
    b = make_request("b", 4, 8)
    c = make_request("c", 4, 2)
    for r in (a, b, c):
        sched.add_request(r)

    steps = 0
    while True:
        out, _ = step(sched)
        steps += 1
        if out.preempted_ids:
            break
        assert steps < 20
    # Step 6: a needs its third block (token 8) with the pool dry; b, admitted last, goes.
    assert steps == 6
    assert out.preempted_ids == ["b"]
    assert scheduled_ids(out) == ["a"]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert sched.kv.get_block_ids("b") == []
    assert len(b.output_token_ids) == 5  # generated tokens are kept
    assert sched.running == [a]
    # Back at the FRONT of the waiting queue, ahead of c which arrived earlier.
    assert list(sched.waiting) == [b, c]
    # No admission in a step that preempted, though a block and a seat are free.
    assert sched.kv.num_free_blocks == 1
    assert c.status is RequestStatus.WAITING

    # Run on: b is recomputed from prompt + its 5 outputs in one chunk, then continues.
    recompute = None
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        for s, t in zip(out.scheduled, out.sampled):
            if s.req_id == b.request_id and recompute is None:
                recompute = (s.num_computed_tokens, s.num_new_tokens, t is not None)
    assert recompute == (0, 9, True)
    for r, n in ((a, 8), (b, 8), (c, 2)):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert len(r.output_token_ids) == n
        assert r.output_token_ids == expected_outputs(r, n)  # preemption did not change outputs
    assert sched.kv.num_free_blocks == 4
    # c was admitted next to b, then preempted itself on its first decode (pool dry again).
    assert c.num_preemptions == 1 and b.num_preemptions == 1 and a.num_preemptions == 0
    assert sched.num_preemptions_total == 2


def test_preemption_victims_are_taken_from_the_back():
    # Three running requests; the oldest needs a new block with the pool dry: the newest goes,
    # and its blocks are enough for both older ones.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=3)
    a = make_request("a", 8, 4)  # 2 blocks
    b = make_request("b", 8, 4)  # 2 blocks
    c = make_request("c", 7, 5)  # 2 blocks
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = step(sched)
    assert scheduled_ids(out) == ["a", "b", "c"]
    assert sched.kv.num_free_blocks == 0
    out, _ = step(sched)  # a and b need a third block; c writes token 7 in its 2nd block
    assert out.preempted_ids == ["c"]
    assert scheduled_ids(out) == ["a", "b"]
    assert list(sched.waiting) == [c]
    assert c.num_computed_tokens == 0 and c.status is RequestStatus.PREEMPTED
    assert sched.running == [a, b]
    assert len(sched.kv.get_block_ids("a")) == 3 and len(sched.kv.get_block_ids("b")) == 3
    run_to_completion(sched)
    for r in (a, b, c):
        assert r.output_token_ids == expected_outputs(r, r.max_tokens)


def test_two_victims_return_to_waiting_oldest_first():
    # a needs a block: c (newest) is preempted for it; then b needs one and, being the newest
    # left, preempts itself. Both go to the front of waiting, b (older) before c.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=3)
    a = make_request("a", 8, 4)  # 2 blocks, 3rd needed for token 8
    b = make_request("b", 4, 4)  # 1 block, 2nd needed for token 4
    c = make_request("c", 4, 4)  # 1 block
    d = make_request("d", 2, 1)  # waits: no seat
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    sched.add_request(d)
    assert sched.kv.num_free_blocks == 0
    out, _ = step(sched)
    assert out.preempted_ids == ["c", "b"]
    assert scheduled_ids(out) == ["a"]
    assert list(sched.waiting) == [b, c, d]
    assert sched.running == [a]
    assert sched.num_preemptions_total == 2
    assert len(sched.kv.get_block_ids("a")) == 3 and sched.kv.num_free_blocks == 1
    run_to_completion(sched)
    for r in (a, b, c, d):
        assert r.output_token_ids == expected_outputs(r, r.max_tokens)


def test_newest_request_preempts_itself():
    # b is the newest running request and cannot grow: it is its own victim, a keeps running.
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)
    a = make_request("a", 5, 2)  # 2 blocks, room up to 8 tokens
    b = make_request("b", 4, 3)  # 1 block, then needs a second one for token 4
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv.num_free_blocks == 0
    out, finished = step(sched)
    assert out.preempted_ids == ["b"]
    assert scheduled_ids(out) == ["a"]
    assert finished == [a]
    assert list(sched.waiting) == [b] and b.status is RequestStatus.PREEMPTED
    out, _ = step(sched)
    assert scheduled_ids(out) == ["b"]
    # Recomputed from its prompt and the one token it had generated.
    assert (out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens) == (0, 5)
    run_to_completion(sched)
    assert b.output_token_ids == expected_outputs(b, 3)
    assert b.num_preemptions == 1


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_finishes_everything_and_frees_all_blocks(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(12, 40)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(4, 48),
        max_model_len=num_blocks * block_size,
    )
    reqs = []
    for i in range(12):
        prompt = rng.randint(1, 24)
        max_tokens = rng.randint(1, 16)
        if sched.kv.num_blocks_for(prompt + max_tokens) > num_blocks:
            continue
        r = make_request(f"q{i}", prompt, max_tokens, stop=(12,))
        sched.add_request(r)
        reqs.append(r)
    # Requests also arrive while others run.
    late = [make_request(f"late{i}", rng.randint(1, 10), rng.randint(1, 8)) for i in range(4)]
    steps = 0
    while sched.has_unfinished_requests() or late:
        if late and steps % 3 == 0:
            r = late.pop()
            if sched.kv.num_blocks_for(r.num_prompt_tokens + r.max_tokens) <= num_blocks:
                sched.add_request(r)
                reqs.append(r)
        if sched.has_unfinished_requests():
            step(sched)
        steps += 1
        assert steps < 2000
    for r in reqs:
        assert r.status.finished
        exp = expected_outputs(r, r.max_tokens)
        if 12 in r.sampling_params.stop_token_ids and 12 in exp:
            exp = exp[: exp.index(12) + 1]
        assert r.output_token_ids == exp
    assert sched.kv.num_free_blocks == num_blocks
    assert sched.requests == {} and not sched.running and not sched.waiting


# --------------------------------------------------------------------------- admission checks
def test_check_request_rejects_too_long_for_max_model_len():
    sched = make_scheduler(max_model_len=32)
    sched.check_request(make_request("ok", 20, 12))  # exactly 32 is fine
    with pytest.raises(ValueError, match="max_model_len"):
        sched.check_request(make_request("bad", 20, 13))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("bad", 40, 1))
    assert not sched.waiting and sched.requests == {}


def test_check_request_rejects_request_larger_than_pool():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=1000)
    sched.check_request(make_request("ok", 10, 6))  # 16 tokens = 4 blocks
    with pytest.raises(ValueError, match="KV blocks") as exc:
        sched.add_request(make_request("bad", 10, 7))  # 17 tokens = 5 blocks
    assert "5" in str(exc.value) and "4" in str(exc.value)
    assert not sched.waiting and sched.requests == {}


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    first = make_request("dup", 4, 2)
    sched.add_request(first)
    with pytest.raises(ValueError, match="dup"):
        sched.add_request(make_request("dup", 5, 3))
    assert list(sched.waiting) == [first]
    assert sched.requests == {"dup": first}
    # Also while it is running.
    step(sched)
    with pytest.raises(ValueError):
        sched.add_request(make_request("dup", 5, 3))
    assert sched.running == [first] and not sched.waiting


# --------------------------------------------------------------------------- abort
def test_abort_running_and_waiting_requests():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    a = make_request("a", 10, 5)
    b = make_request("b", 3, 5)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b]
    assert len(sched.kv.get_block_ids("a")) == 3

    assert sched.abort("a") is a
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert sched.running == [] and "a" not in sched.requests
    assert sched.kv.get_block_ids("a") == []
    assert sched.kv.num_free_blocks == 16
    sched.kv.check_integrity()
    assert sched.abort("a") is None  # already finished
    assert sched.abort("nope") is None

    assert sched.abort("b") is b
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert not sched.waiting and sched.requests == {}
    assert not sched.has_unfinished_requests()
    assert sched.schedule().is_empty


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a = make_request("a", 4, 8)
    b = make_request("b", 4, 8)
    sched.add_request(a)
    sched.add_request(b)
    while b.status is not RequestStatus.PREEMPTED:
        step(sched)
    assert sched.abort("b") is b
    assert not sched.waiting and "b" not in sched.requests
    run_to_completion(sched)
    assert len(a.output_token_ids) == 8


# --------------------------------------------------------------------------- speculative drafts
def test_drafts_are_dropped_rather_than_preempting_another_request():
    """Draft tokens are optional: when the pool cannot also hold a request's drafts, its step
    verifies none of them instead of preempting another request (whose KV would be recomputed)."""
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, b = make_request("a", 3, 5), make_request("b", 3, 5)
    for r in (a, b):
        sched.add_request(r)
    step(sched)  # both prefill their 3 tokens into one block each: the pool is full
    assert sched.kv.num_free_blocks == 0
    a.spec_token_ids = [7, 8, 9]  # would need a second block for tokens 4..6
    out = sched.schedule()
    assert out.preempted_ids == [] and scheduled_ids(out) == ["a", "b"]
    entry = out.scheduled[0]
    assert entry.spec_token_ids == [] and entry.num_new_tokens == 1
    # With room, the same drafts are scheduled.
    roomy = make_scheduler(num_blocks=3, block_size=4)
    c, d = make_request("c", 3, 5), make_request("d", 3, 5)
    for r in (c, d):
        roomy.add_request(r)
    step(roomy)
    c.spec_token_ids = [7, 8, 9]
    out = roomy.schedule()
    assert out.preempted_ids == [] and out.scheduled[0].spec_token_ids == [7, 8, 9]
    assert out.scheduled[0].num_new_tokens == 4


def test_drafts_fit_the_token_budget_a_whole_chunk_and_max_tokens():
    """Found by a mutation audit (each rule could be dropped without a test failing): drafts
    take only the budget left after the request's own token; a chunk that the budget cuts short
    of the last known token verifies none; and no more are verified than max_tokens can keep
    (the last verified position also yields a token)."""
    sched = make_scheduler(max_num_batched_tokens=5)
    a, b = make_request("a", 3, 20), make_request("b", 3, 20)
    for r in (a, b):
        sched.add_request(r)
    step(sched)
    a.spec_token_ids = [7, 8, 9, 10, 11, 12]
    out = sched.schedule()
    assert out.scheduled[0].req_id == "a" and out.scheduled[0].spec_token_ids == [7, 8, 9, 10]
    assert out.num_scheduled_tokens == 5
    # A prompt in chunks of 4 (the per-request cap; the budget has room): drafts only once the
    # chunk reaches its last known token.
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                             long_prefill_token_threshold=4)  # fmt: skip
    chunked = Scheduler(config, KVCacheManager(num_blocks=64, block_size=4))
    c = make_request("c", 10, 20)
    chunked.add_request(c)
    step(chunked)  # its first chunk: c is running now
    c.spec_token_ids = [7, 8]
    second = chunked.schedule()
    assert second.scheduled[0].num_new_tokens == 4 and second.scheduled[0].spec_token_ids == []
    # max_tokens 5 with one token out: 3 drafts at most (4 verified positions, 4 new tokens).
    edge = make_scheduler()
    d = make_request("d", 3, 5)
    edge.add_request(d)
    step(edge)
    assert len(d.output_token_ids) == 1
    d.spec_token_ids = [7, 8, 9, 10, 11]
    assert edge.schedule().scheduled[0].spec_token_ids == [7, 8, 9]


def test_the_priority_policy_preempts_the_least_urgent_then_the_latest():
    """Largest priority value first; among equals the latest arrival, whose recomputation
    costs least (a mutation audit reversed the tie-break without a test failing)."""
    from pagedllm.scheduler.policy import pick_victim

    reqs = [make_request(rid, 3, 4) for rid in "abcd"]
    for r, (priority, arrival) in zip(reqs, [(0, 1.0), (0, 2.0), (-1, 3.0), (0, 0.5)]):
        r.priority, r.arrival_time = priority, arrival
    assert pick_victim(reqs, "priority").request_id == "b"
    reqs[0].priority = 1
    assert pick_victim(reqs, "priority").request_id == "a"
    assert pick_victim(reqs, "fcfs").request_id == "d"  # the last admitted
