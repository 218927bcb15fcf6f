"""DEBUG logs: one ``step N:`` line per schedule() and one ``kv ...`` line per KV allocation event.

The scheduler and KV manager are driven directly, without a model: every scheduled request
whose chunk ends its known tokens gets a fixed token.
"""

from __future__ import annotations

import logging
import re

import pytest

from pagedllm.request import Request, RequestStatus
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager, abbrev
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.output import SchedulerOutput
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig

LOGGERS = ("pagedllm.scheduler", "pagedllm.kv_cache")
STEP_RE = re.compile(
    r"step (?P<step>\d+): scheduled=(?P<scheduled>\d+) \(prefill=(?P<prefill>\d+) decode=(?P<decode>\d+)\) "
    r"tokens=(?P<tokens>\d+) reqs=\[(?P<reqs>[^\]]*)\] waiting=(?P<waiting>\d+) running=(?P<running>\d+) "
    r"preempted=\[(?P<preempted>[^\]]*)\] blocks: allocated=(?P<allocated>\d+) freed=(?P<freed>\d+) "
    r"cached_hits=(?P<cached_hits>\d+) free=(?P<free>\d+)/(?P<total>\d+) copies=(?P<copies>\d+) "
    r"swap_out=(?P<swap_out>\d+) swap_in=(?P<swap_in>\d+)$"
)


@pytest.fixture
def logs(caplog):
    """Capture the two loggers exactly once, whether or not configure_logging() ran.

    configure_logging() sets propagate=False on "pagedllm", so caplog's root handler would
    miss them; the handler is attached to the loggers themselves instead (and propagation
    switched off meanwhile, so nothing is captured twice). The level is set on "pagedllm".
    """
    loggers = [logging.getLogger(n) for n in LOGGERS]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(caplog.handler)
        lg.propagate = False

    def set_level(level: int) -> None:
        caplog.set_level(level, logger="pagedllm")  # restored by caplog at teardown

    yield set_level
    for lg, propagate in zip(loggers, saved):
        lg.removeHandler(caplog.handler)
        lg.propagate = propagate


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, **kw) -> Scheduler:
    num_swap_blocks = kw.pop("num_swap_blocks", 0)
    enable_caching = kw.pop("enable_caching", False)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, num_swap_blocks=num_swap_blocks)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=1024, **kw)
    return Scheduler(config, kv)


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, None, list(range(100, 100 + prompt_len)), params)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
    sched.kv.check_integrity()
    return out


def messages(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def step_lines(caplog) -> list[dict[str, str]]:
    lines = messages(caplog, "pagedllm.scheduler")
    parsed = [STEP_RE.match(m) for m in lines]
    assert all(parsed), lines
    return [m.groupdict() for m in parsed]


def kv_lines(caplog, kind: str) -> list[str]:
    return [m for m in messages(caplog, "pagedllm.kv_cache") if m.startswith(f"kv {kind} ")]


# --------------------------------------------------------------------------- step lines
def test_one_step_line_per_schedule_with_counts(caplog, logs):
    logs(logging.DEBUG)
    sched = make_scheduler(num_blocks=64)
    a, b = make_request("a", 10, 2), make_request("b", 3, 2)
    sched.add_request(a)
    sched.add_request(b)

    out = step(sched)  # a: 10 tokens in 3 blocks, b: 3 tokens in 1 block
    assert messages(caplog, "pagedllm.scheduler") == [
        "step 1: scheduled=2 (prefill=2 decode=0) tokens=13 reqs=[a:10,b:3] waiting=0 running=2 preempted=[] "
        "blocks: allocated=4 freed=0 cached_hits=0 free=60/64 copies=0 swap_out=0 swap_in=0"
    ]
    assert out.num_scheduled_tokens == 13

    caplog.clear()
    step(sched)  # two decodes within their blocks; both finish (max_tokens=2) after the step
    (line,) = step_lines(caplog)
    assert line["step"] == "2" and line["reqs"] == "a:1,b:1"
    assert (line["scheduled"], line["prefill"], line["decode"], line["tokens"]) == ("2", "0", "2", "2")
    assert (line["allocated"], line["freed"], line["running"]) == ("0", "0", "2")
    assert sched.kv.num_free_blocks == 64  # freed by update_from_output, after the line

    # The next line counts blocks since the previous line: a's and b's 4 blocks come back.
    caplog.clear()
    sched.add_request(make_request("c", 5, 1))
    step(sched)
    (line,) = step_lines(caplog)
    assert (line["step"], line["reqs"], line["allocated"], line["freed"]) == ("3", "c:5", "2", "4")
    assert (line["free"], line["total"]) == ("62", "64")

    # A step with nothing to do still logs its line (and counts its number).
    caplog.clear()
    sched.schedule()
    (line,) = step_lines(caplog)
    assert (line["step"], line["scheduled"], line["tokens"], line["reqs"], line["freed"]) == ("4", "0", "0", "", "2")
    assert sched.num_steps == 4


def test_step_line_counts_match_the_output_over_a_workload(caplog, logs):
    logs(logging.DEBUG)
    # 4 blocks of 4 for requests needing up to 3 each: preemptions along the way.
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    for i, (p, n) in enumerate([(4, 8), (4, 8), (4, 2), (2, 5), (6, 3)]):
        sched.add_request(make_request(f"r{i}", p, n))
    total_allocated = total_freed = 0
    while sched.has_unfinished_requests():
        caplog.clear()
        out = step(sched)
        (line,) = step_lines(caplog)
        assert int(line["scheduled"]) == len(out.scheduled)
        assert int(line["prefill"]) + int(line["decode"]) == len(out.scheduled)
        assert int(line["tokens"]) == out.num_scheduled_tokens
        assert line["reqs"] == ",".join(f"{s.req_id}:{s.num_new_tokens}" for s in out.scheduled)
        assert line["preempted"] == ",".join(out.preempted_ids)
        total_allocated += int(line["allocated"])
        total_freed += int(line["freed"])
        assert int(line["step"]) == sched.num_steps < 200
    assert sched.num_preemptions_total > 0
    # Every block handed out was returned; the last finishes are counted by the KV totals.
    assert total_allocated == sched.kv.num_allocated_total == sched.kv.num_freed_total
    assert total_freed <= sched.kv.num_freed_total


def test_reqs_list_is_truncated_after_16_entries(caplog, logs):
    logs(logging.DEBUG)
    sched = make_scheduler(num_blocks=64, max_num_seqs=20)
    for i in range(20):
        sched.add_request(make_request(f"q{i}", 1, 1))
    step(sched)
    (line,) = step_lines(caplog)
    assert line["scheduled"] == "20"
    assert line["reqs"] == ",".join(f"q{i}:1" for i in range(16)) + ",...+4"
    assert abbrev([]) == "[]" and abbrev(range(3), limit=2) == "[0,1,...+1]"


def test_preemption_shows_in_the_step_line(caplog, logs):
    logs(logging.DEBUG)
    # 3 blocks of 4: a holds 2, b holds 1 and needs a second one for its token 4 -> b preempts itself.
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 5, 2), make_request("b", 4, 3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    caplog.clear()
    out = step(sched)
    assert out.preempted_ids == ["b"] and b.status is RequestStatus.PREEMPTED
    (line,) = step_lines(caplog)
    assert (line["step"], line["scheduled"], line["reqs"], line["preempted"]) == ("2", "1", "a:1", "b")
    assert (line["waiting"], line["running"], line["freed"], line["allocated"]) == ("1", "1", "1", "0")
    assert kv_lines(caplog, "free") == [
        "kv free req=b blocks=1 returned=1 swapped=0 free=1/3",  # preempted, in schedule()
        "kv free req=a blocks=2 returned=2 swapped=0 free=3/3",  # finished, after the step
    ]

    caplog.clear()
    step(sched)  # a finished after step 2 (2 blocks back); b recomputes 5 tokens in 2 blocks
    (line,) = step_lines(caplog)
    assert (line["reqs"], line["preempted"], line["allocated"], line["freed"]) == ("b:5", "", "2", "2")


def test_swap_preemption_shows_in_the_step_and_kv_lines(caplog, logs):
    logs(logging.DEBUG)
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, preemption_mode="swap", num_swap_blocks=4)
    sched.add_request(make_request("a", 5, 2))
    sched.add_request(make_request("b", 4, 3))
    step(sched)
    caplog.clear()
    step(sched)
    (line,) = step_lines(caplog)
    assert (line["preempted"], line["swap_out"], line["swap_in"]) == ("b", "1", "0")
    assert kv_lines(caplog, "swap_out") == ["kv swap_out req=b blocks=1 swap_free=3/4"]
    caplog.clear()
    step(sched)
    (line,) = step_lines(caplog)
    assert (line["reqs"], line["swap_out"], line["swap_in"]) == ("b:1", "0", "1")
    (swap_in,) = kv_lines(caplog, "swap_in")
    assert swap_in.startswith("kv swap_in req=b blocks=1 ids=[")


# --------------------------------------------------------------------------- KV lines
def test_kv_alloc_lines_name_the_request(caplog, logs):
    logs(logging.DEBUG)
    sched = make_scheduler(num_blocks=64, block_size=4, enable_caching=True)
    sched.add_request(make_request("a", 10, 1))
    step(sched)
    assert kv_lines(caplog, "alloc") == [
        "kv alloc req=a new=3 ids=[0,1,2] cached_hits=0 cow=0 tokens=0+10 blocks=3 free=61/64"
    ]
    assert kv_lines(caplog, "free") == ["kv free req=a blocks=3 returned=3 swapped=0 free=64/64"]

    # Same prompt: its two full blocks are prefix-cache hits, one new block for the rest.
    caplog.clear()
    sched.add_request(make_request("b", 10, 2))
    step(sched)
    (alloc,) = kv_lines(caplog, "alloc")
    assert alloc.startswith("kv alloc req=b new=1 ids=[") and "cached_hits=2 cow=0 tokens=8+2 blocks=3" in alloc
    (line,) = step_lines(caplog)
    assert (line["reqs"], line["allocated"], line["cached_hits"]) == ("b:2", "1", "2")

    # A decode that stays within its blocks allocates nothing and logs nothing.
    caplog.clear()
    sched.kv.allocate_slots("b", 11, 1)
    assert kv_lines(caplog, "alloc") == []


def test_kv_fork_and_cow_lines(caplog, logs):
    logs(logging.DEBUG)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("p", 0, 6)
    kv.fork("p", "c")
    assert kv_lines(caplog, "fork") == ["kv fork parent=p child=c shared=2"]
    caplog.clear()
    assert kv.allocate_slots("c", 6, 1)  # writes into the shared partial block: copied
    assert kv_lines(caplog, "alloc") == ["kv alloc req=c new=0 ids=[] cached_hits=0 cow=1 tokens=6+1 blocks=2 free=5/8"]
    assert kv.num_allocated_total == 3
    kv.free("c")
    kv.free("p")
    assert kv_lines(caplog, "free") == [
        "kv free req=c blocks=2 returned=1 swapped=0 free=6/8",  # its first block is still p's
        "kv free req=p blocks=2 returned=2 swapped=0 free=8/8",
    ]
    assert kv.num_freed_total == 3


# --------------------------------------------------------------------------- INFO
def test_nothing_logged_at_info(caplog, logs):
    logs(logging.INFO)
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, preemption_mode="swap", num_swap_blocks=2)
    sched.add_request(make_request("a", 5, 2))
    sched.add_request(make_request("b", 4, 3))
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.num_preemptions_total > 0 and sched.kv.num_swap_outs > 0
    assert [r for r in caplog.records if r.name in LOGGERS] == []
    # The counters run regardless of the level.
    assert sched.num_steps > 0 and sched.kv.num_allocated_total == sched.kv.num_freed_total > 0

    # Lowering the level at run time takes effect at the next step.
    logs(logging.DEBUG)
    sched.add_request(make_request("c", 2, 1))
    step(sched)
    (line,) = step_lines(caplog)
    assert line["step"] == str(sched.num_steps) and line["reqs"] == "c:2"
    assert (line["allocated"], line["freed"]) == ("1", "0")  # counted from this step, not since the start
