"""Pipeline parallel engines keep batches in flight: the scheduler neither schedules nor
preempts a request in flight, and caps a batch's requests (``schedule(in_flight, max_batch_seqs)``)."""

from __future__ import annotations

from tests.scheduler.test_scheduler import fake_token, make_request, make_scheduler


def _sampled(sched, out):
    return [[fake_token(sched.requests[s.req_id])] if s.samples else [] for s in out.scheduled]


def test_in_flight_requests_are_skipped_and_batches_capped():
    sched = make_scheduler()
    for rid in "abcd":
        sched.add_request(make_request(rid, 6, 4))
    first = sched.schedule(max_batch_seqs=2)
    assert [s.req_id for s in first.scheduled] == ["a", "b"]
    second = sched.schedule(in_flight={"a", "b"}, max_batch_seqs=2)
    assert [s.req_id for s in second.scheduled] == ["c", "d"]
    assert sched.schedule(in_flight={"a", "b", "c", "d"}).is_empty  # nothing else to run
    sched.update_from_output(first, _sampled(sched, first))
    third = sched.schedule(in_flight={"c", "d"}, max_batch_seqs=2)
    assert [(s.req_id, s.num_computed_tokens) for s in third.scheduled] == [("a", 6), ("b", 6)]


def test_an_in_flight_request_is_never_preempted():
    # 4 blocks of 4 tokens: a and b take 2 each; b's next token needs a third block.
    sched = make_scheduler(num_blocks=4)
    for rid in "ab":
        sched.add_request(make_request(rid, 8, 4))
    out = sched.schedule()
    sched.update_from_output(out, _sampled(sched, out))
    # With "a" in flight, "b" cannot get a block without preempting "a": it waits instead.
    blocked = sched.schedule(in_flight={"a"})
    assert blocked.is_empty and not blocked.preempted_ids and sched.num_preemptions_total == 0
    # Without anything in flight, the usual rule applies: the most recent request (b) goes.
    freed = sched.schedule()
    assert freed.preempted_ids == ["b"]


def test_max_num_seqs_holds_while_a_running_request_is_in_flight():
    """A full running set with one request in flight: a waiting request is not admitted (found
    by a mutation audit: admitting at len(running) == max_num_seqs tripped the scheduler's own
    budget assertion, which would end the engine; no test had this case)."""
    sched = make_scheduler(max_num_seqs=2)
    for rid in "ab":
        sched.add_request(make_request(rid, 6, 4))
    first = sched.schedule()
    sched.update_from_output(first, _sampled(sched, first))
    sched.add_request(make_request("c", 6, 4))
    out = sched.schedule(in_flight={"b"})
    assert [s.req_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in sched.running] == ["a", "b"] and len(sched.waiting) == 1
    assert not out.preempted_ids
