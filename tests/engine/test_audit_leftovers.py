"""Leftovers of an earlier mutation audit: rules that no test broke when they were changed.
The ranks of the top-k log-probability entries (1-based, as vLLM), and the sliding-window
blocks a step leaves behind returned to the pool right after that step."""

from __future__ import annotations

from pagedllm import SamplingParams
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedllm.kv_cache.kv_cache_manager import NULL_BLOCK, KVCacheManager
from pagedllm.outputs import RowLogprobs
from pagedllm.request import Request
from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.test_scheduler import fake_token, make_request


def _logprob_entries(tok, rows: list[tuple[int, RowLogprobs]]):
    proc = OutputProcessor(tok)
    req = Request("r", None, tok.encode("Count:", add_special_tokens=False),
                  SamplingParams(temperature=0, max_tokens=50, logprobs=3), parent_id="p")
    proc.add([req], RequestOutputKind.CUMULATIVE)
    for token, lp in rows:
        req.append_output_token(token)
        req.logprobs.append(lp)
        proc.on_new_tokens(req, 1)
    (out,) = proc.make_outputs()
    return out.outputs[0].logprobs


def test_top_logprob_ranks_are_one_based(default_tokenizer):
    """The i-th most likely token has rank i (1 = the most likely), whether the sampled token
    is the top one (greedy) or another one with its own rank; a 0-based rank would tell a client
    that the second token is the most likely."""
    a, b, c, d = default_tokenizer.encode(" one two three four", add_special_tokens=False)[:4]
    greedy = RowLogprobs(-0.1, 1, [a, b, c], [-0.1, -2.0, -3.0])
    sampled = RowLogprobs(-4.0, 5, [b, c, a], [-0.5, -1.0, -2.0])  # d: not among the top 3
    first, second = _logprob_entries(default_tokenizer, [(a, greedy), (d, sampled)])
    assert {t: e.rank for t, e in first.items()} == {a: 1, b: 2, c: 3}
    assert {t: e.rank for t, e in second.items()} == {d: 5, b: 1, c: 2, a: 3}
    assert second[b].logprob == -0.5 and second[d].logprob == -4.0


def test_blocks_behind_a_sliding_window_are_freed_right_after_the_step():
    """A sliding-window model: once a step has computed the tokens, the blocks no later query
    can read go back to the pool at once (not only at the request's next allocation), so a
    request that sits out steps or is followed by others in the queue does not hold them."""
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(4,))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024), kv)
    req = make_request("a", 16, 8)
    sched.add_request(req)
    out = sched.schedule()
    assert kv.num_free_blocks == 16 - 4
    sched.update_from_output(out, [[fake_token(req)]])
    # Queries from position 16 on read keys 13.. : only block 3 (positions 12-15) is still needed.
    assert [b is NULL_BLOCK for b in kv.tables[0]["a"]] == [True, True, True, False]
    assert kv.num_free_blocks == 16 - 1
