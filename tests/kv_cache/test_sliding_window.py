"""KV-cache groups: sliding-window groups return the blocks behind their window while a request
runs, and every manager operation (all-or-nothing allocation, free, fork, swap, prefix cache)
works across groups that share one pool.

Ends with the content state machine of test_kv_cache_manager.py run over a full and a sliding
group: after every step each request must read its own K/V through every group's table at
every position a coming query can see.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from pagedllm.kv_cache.groups import KVCacheLayout
from pagedllm.kv_cache.kv_cache_manager import NULL_BLOCK, NULL_BLOCK_ID, KVCacheManager, cdiv
from pagedllm.model.arch import FULL, SLIDING, ModelArch
from pagedllm.runner.model_runner import kv_cache_layout
from tests.kv_cache.test_kv_cache_manager import KVContentMachine


def held(kv: KVCacheManager, rid: str, group: int) -> int:
    return sum(b is not NULL_BLOCK for b in kv.tables[group].get(rid, []))


def run_step(kv: KVCacheManager, rid: str, computed: int, new: int, tokens: list[int] | None = None) -> None:
    """What the scheduler does around a step: allocate, then (after the forward) cache and trim."""
    assert kv.allocate_slots(rid, computed, new)
    kv.cache_blocks(rid, computed + new, tokens or list(range(computed + new)))
    kv.remove_skipped_blocks(rid, computed + new)


# --------------------------------------------------------------------------- layout
def test_gemma3_layers_form_six_groups_of_three():
    types = ([SLIDING] * 5 + [FULL]) * 3
    arch = ModelArch("gemma3", 10, 8, 16, 18, 2, 1, 4, 1e-6, 1e4, 64, sliding_window=512, layer_types=types)
    layout = kv_cache_layout(arch)
    assert layout.windows == (None, 512, 512, 512, 512, 512) and layout.num_slots == 3
    assert layout.groups[0].layers == (5, 11, 17)
    assert layout.groups[1].layers == (0, 1, 2) and layout.groups[2].layers == (3, 4, 6)
    # Each layer has one (group, slot), and no two layers share both.
    assert len(set(zip(layout.layer_group, layout.layer_slot))) == 18
    assert layout.layer_group[:7] == (1, 1, 1, 2, 2, 0, 2) and layout.layer_slot[:7] == (0, 1, 2, 0, 1, 0, 2)


def test_one_attention_type_keeps_one_group_of_every_layer():
    assert KVCacheLayout.from_windows([None] * 4) == KVCacheLayout.single(4)
    mistral = KVCacheLayout.from_windows([24] * 4)
    assert mistral.windows == (24,) and mistral.num_slots == 4 and mistral.layer_slot == (0, 1, 2, 3)
    tiny_gemma = KVCacheLayout.from_windows([24] * 5 + [None])
    assert tiny_gemma.windows == (None,) + (24,) * 5 and tiny_gemma.num_slots == 1


def test_groups_are_cut_by_the_gcd_of_the_type_counts():
    """20 sliding and 6 full layers: groups of gcd(20, 6) = 2, every group the same size (the
    block layout has one slot per layer of a group; groups of min(20, 6) = 6 left one of 2)."""
    layout = KVCacheLayout.from_windows([8] * 20 + [None] * 6)
    assert layout.num_slots == 2 and len(layout.groups) == 13
    assert {len(g.layers) for g in layout.groups} == {2}


# --------------------------------------------------------------------------- freeing behind the window
def test_long_decode_holds_only_the_window():
    """Mistral-like (every layer slides): 10x the window decoded token by token holds at most
    the window's blocks plus one, and every freed block is back in the pool."""
    window, bs = 16, 4
    kv = KVCacheManager(num_blocks=12, block_size=bs, windows=(window,))
    run_step(kv, "r", 0, 7)  # the prompt
    most = 0
    for n in range(7, 10 * window):
        run_step(kv, "r", n, 1)
        table = kv.tables[0]["r"]
        assert len(table) == cdiv(n + 1, bs)  # logical positions kept
        first = max(0, n + 1 - window + 1) // bs  # the next query (position n + 1) reads from n + 2 - window
        assert all(b is NULL_BLOCK for b in table[:first]) and all(b is not NULL_BLOCK for b in table[first:])
        most = max(most, held(kv, "r", 0))
        assert kv.num_free_blocks == 12 - held(kv, "r", 0)
        kv.check_integrity()
    assert most <= window // bs + 1
    assert kv.get_block_ids("r")[0] == NULL_BLOCK_ID
    assert kv.num_skipped_total == cdiv(10 * window, bs) - held(kv, "r", 0)
    kv.free("r")
    assert kv.num_free_blocks == 12
    kv.check_integrity()


def test_prefill_chunks_keep_what_their_first_query_needs():
    """A chunk's first query reads window - 1 positions back: those blocks stay until it ran."""
    kv = KVCacheManager(num_blocks=40, block_size=4, windows=(None, 10))
    run_step(kv, "r", 0, 24)
    # The next query (24) reads 15..24: blocks 3.. of the sliding group; the full group keeps all.
    assert [b is NULL_BLOCK for b in kv.tables[1]["r"]] == [True] * 3 + [False] * 3
    assert held(kv, "r", 0) == 6
    assert kv.allocate_slots("r", 24, 16)  # a 16-token chunk: its first query still reads 15..
    assert [b is NULL_BLOCK for b in kv.tables[1]["r"]] == [True] * 3 + [False] * 7
    kv.remove_skipped_blocks("r", 40)  # after it: the next query (40) reads 31..40
    assert [b is NULL_BLOCK for b in kv.tables[1]["r"]] == [True] * 7 + [False] * 3
    kv.check_integrity()


def test_allocation_is_all_or_nothing_across_groups():
    kv = KVCacheManager(num_blocks=10, block_size=4, windows=(None, 8, 8))
    assert kv.allocate_slots("a", 0, 12)  # 3 blocks in each of 3 groups
    assert kv.num_free_blocks == 1
    full, s1, s2 = kv.get_group_block_ids("a")
    # Queries from 12 read 5..: each sliding group's block 0 goes back, even when the
    # allocation then fails (6 more tokens: 2 new blocks in every group, 3 free) ...
    assert not kv.allocate_slots("a", 12, 6)
    assert kv.get_group_block_ids("a") == [full, [NULL_BLOCK_ID] + s1[1:], [NULL_BLOCK_ID] + s2[1:]]
    assert kv.num_free_blocks == 3
    kv.check_integrity()
    # ... and 2 tokens (one block per group) fit.
    assert kv.allocate_slots("a", 12, 2)
    assert kv.num_free_blocks == 0 and [len(t) for t in kv.get_group_block_ids("a")] == [4, 4, 4]
    kv.check_integrity()
    kv.free("a")  # preemption / finish: every group's blocks back
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_max_blocks_held_bounds_a_request():
    kv = KVCacheManager(num_blocks=8, block_size=4, windows=(None, 16))
    # 200 tokens in 8-token chunks: all 50 blocks in the full group, (15 + 8) / 4 + 1 = 7 sliding.
    assert kv.max_blocks_held(200, 8) == 50 + 7
    assert kv.max_blocks_held(10, 8) == 3 + 3  # never more than the request's own blocks
    assert KVCacheManager(8, 4).max_blocks_held(200, 8) == 50


# --------------------------------------------------------------------------- fork, swap, prefix cache
def test_fork_shares_every_group_and_trims_each_child_alone():
    kv = KVCacheManager(num_blocks=30, block_size=4, windows=(None, 8))
    run_step(kv, "p", 0, 18)  # sliding group: blocks 0..2 behind the window of query 18 (reads 11..)
    assert [b is NULL_BLOCK for b in kv.tables[1]["p"]] == [True, True, False, False, False]
    kv.fork("p", "c")
    assert kv.get_group_block_ids("c") == kv.get_group_block_ids("p")
    assert kv.num_free_blocks == 30 - 5 - 3
    # The child writes into the shared partial block of each group: one copy per group.
    assert kv.allocate_slots("c", 18, 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 2 and {s for s, _ in copies} == {kv.tables[0]["p"][4].block_id, kv.tables[1]["p"][4].block_id}
    kv.remove_skipped_blocks("c", 19)  # nothing new behind the window yet (query 19 reads 12..)
    run_step(kv, "c", 19, 6)  # the child moves on: its trim only drops its own references
    kv.check_integrity()
    assert held(kv, "p", 1) == 3 and all(b.ref_cnt >= 1 for b in kv.tables[1]["p"] if b is not NULL_BLOCK)
    kv.free("p")
    kv.free("c")
    assert kv.num_free_blocks == 30
    kv.check_integrity()


def test_swap_keeps_placeholders_and_moves_only_real_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=4, windows=(None, 8), num_swap_blocks=10)
    run_step(kv, "a", 0, 20)  # full: 5 blocks; sliding: 3 placeholders + 2 real (query 20 reads 13..)
    tables = kv.get_group_block_ids("a")
    assert kv.swap_out("a")
    out, inn = kv.take_pending_swaps()
    assert len(out) == 7 and inn == [] and kv.num_free_blocks == 20
    assert kv.swap_in("a", 21)
    out, inn = kv.take_pending_swaps()
    assert out == [] and len(inn) == 7
    assert [b is NULL_BLOCK for b in kv.tables[1]["a"]] == [True, True, True, False, False]
    assert len(kv.get_group_block_ids("a")[0]) == len(tables[0])
    assert kv.allocate_slots("a", 20, 1)  # room was reserved by swap_in
    kv.check_integrity()


def test_prefix_hit_needs_only_the_window_of_a_sliding_group():
    bs, window = 4, 8
    kv = KVCacheManager(num_blocks=40, block_size=bs, enable_caching=True, windows=(None, window))
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks
    run_step(kv, "a", 0, 33, prompt)
    sliding_a = list(kv.tables[1]["a"])
    kv.free("a")
    hit = kv.get_computed_blocks("b", prompt)
    # 8 blocks cached in the full group; the sliding group needs only blocks covering 25..31
    # (the first query after the hit, at 32, reads 25..32): blocks 6 and 7, the rest placeholders.
    assert len(hit) == 8
    assert [b is NULL_BLOCK for b in hit.groups[1]] == [True] * 6 + [False] * 2
    assert hit.groups[1][6:] == sliding_a[6:8]
    assert kv.allocate_slots("b", 32, 1, hit)
    assert kv.num_cached_hits_total == 8 + 2
    kv.check_integrity()


def _evict(kv: KVCacheManager, block) -> None:
    """Drop a free cached block's content, as handing it out to another request would."""
    kv.block_pool.free_block_queue.remove(block)
    del kv.block_pool.cached_blocks[block.block_hash]
    block.block_hash = None
    kv.block_pool.free_block_queue.append(block)


def test_prefix_hit_shrinks_to_a_prefix_whose_window_is_cached():
    bs, window = 4, 8
    kv = KVCacheManager(num_blocks=40, block_size=bs, enable_caching=True, windows=(None, window))
    prompt = list(range(100, 133))
    assert kv.allocate_slots("a", 0, 33)
    full_a, sliding_a = list(kv.tables[0]["a"]), list(kv.tables[1]["a"])
    kv.cache_blocks("a", 33, prompt)
    kv.remove_skipped_blocks("a", 33)  # sliding blocks 0..5 back to the pool, still cached
    kv.free("a")
    _evict(kv, sliding_a[7])  # the sliding group's block 7 only
    hit = kv.get_computed_blocks("b", prompt)
    # 7 blocks would need 21..27 = sliding blocks 5, 6 (still cached, freed behind the window
    # earlier): a 7-block hit.
    assert len(hit) == 7 and hit.groups[0] == full_a[:7] and hit.groups[1][5:] == sliding_a[5:7]
    kv.check_integrity()


def test_a_sliding_block_behind_the_window_can_go_without_costing_the_hit():
    """Sliding blocks 0..5 lie behind the window of the first query after an 8-block hit: evicting
    block 0 must leave the hit at 8 blocks (all of them were required before: a Gemma 3 prompt
    lost its whole hit as soon as its oldest sliding block was reused)."""
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, windows=(None, 8))
    prompt = list(range(100, 133))  # 33 tokens: 8 full blocks
    assert kv.allocate_slots("a", 0, 33)
    sliding_a = list(kv.tables[1]["a"])
    kv.cache_blocks("a", 33, prompt)
    kv.remove_skipped_blocks("a", 33)  # sliding blocks 0..5 back to the pool, still cached
    kv.free("a")
    _evict(kv, sliding_a[0])
    hit = kv.get_computed_blocks("b", prompt)
    assert len(hit) == 8 and hit.groups[1][6:] == sliding_a[6:8]
    assert kv.allocate_slots("b", 32, 1, hit)
    kv.check_integrity()


def test_a_full_group_chain_broken_early_shortens_every_groups_hit():
    """The full group's chain ends at block 5 (evicted): the sliding group's hit must end there
    too, so every group adopts 5 blocks (a 5 / 8 split failed an assertion in allocate_slots,
    which ends the engine's step)."""
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, windows=(None, 8))
    prompt = list(range(100, 133))
    run_step(kv, "a", 0, 33, prompt)
    full_a = list(kv.tables[0]["a"])
    kv.free("a")
    _evict(kv, full_a[5])
    hit = kv.get_computed_blocks("b", prompt)
    assert len(hit) == 5 and [len(g) for g in hit.groups] == [5, 5]
    assert kv.allocate_slots("b", 20, 13, hit)
    kv.check_integrity()


def test_a_hit_waiting_in_the_free_queue_is_never_another_groups_new_block():
    """Bug: group 0 took its new blocks before group 1 adopted its hits, so a cached block of
    group 1 at the head of the free queue became group 0's new block and group 1's hit at once."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True, windows=(None, 8))
    prompt = [5, 6, 7, 8, 9]
    run_step(kv, "a", 0, 5, prompt)  # full: blocks 0, 1; sliding: 2, 3; block 0 of each cached
    kv.free("a")
    queue = kv.block_pool.free_block_queue
    order = [kv.block_pool.blocks[i] for i in (2, 1, 3, 0)]  # the sliding hit least recently freed
    for b in order:
        queue.remove(b)
    for b in order:
        queue.append(b)
    hit = kv.get_computed_blocks("b", prompt)
    assert [b.block_id for b in hit.groups[0]] == [0] and [b.block_id for b in hit.groups[1]] == [2]
    assert kv.allocate_slots("b", 4, 1, hit)
    full, sliding = kv.get_group_block_ids("b")
    assert full[0] == 0 and sliding[0] == 2 and not set(full) & set(sliding)
    kv.check_integrity()


# --------------------------------------------------------------------------- scheduler
def test_scheduler_runs_a_request_longer_than_the_pool_would_hold_without_freeing():
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(num_blocks=12, block_size=4, windows=(16,))
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=512), kv)
    req = Request("r", None, list(range(10, 50)), SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
    sched.add_request(req)  # 200 tokens = 50 blocks; with the window at most 7 at once
    most = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not out.preempted_ids
        most = max(most, kv.num_blocks - kv.num_free_blocks)
        ids = out.scheduled[0].block_ids
        assert len(ids) == cdiv(out.scheduled[0].num_computed_tokens + out.scheduled[0].num_new_tokens, 4)
        sched.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
        kv.check_integrity()
    assert most <= 7 and kv.num_free_blocks == 12 and len(req.output_token_ids) == 160


# --------------------------------------------------------------------------- content machine
class GroupedKVContentMachine(KVContentMachine):
    """The content machine over a full and a sliding group (window 3, blocks of 2)."""

    WINDOW = 3

    @initialize(caching=st.booleans())
    def setup(self, caching):
        super().setup(caching)
        self.kv = KVCacheManager(num_blocks=14, block_size=self.bs, enable_caching=caching, num_swap_blocks=10,
                                 windows=(None, self.WINDOW))  # fmt: skip

    def _kv(self, rid: str, pos: int, group: int = 0) -> tuple:
        return (group, *self.tokens[rid][: pos + 1])

    def _slot_in(self, rid: str, pos: int, group: int) -> int:
        return self.kv.get_group_block_ids(rid)[group][pos // self.bs] * self.bs + pos % self.bs

    @rule()
    def run_step(self):
        self._move_blocks()
        for rid, (start, end) in self.writes.items():
            for g in range(2):
                for pos in range(start, end):
                    self.content[self._slot_in(rid, pos, g)] = self._kv(rid, pos, g)
            self.computed[rid] = end
            self.kv.cache_blocks(rid, end, self.tokens[rid])
            self.kv.remove_skipped_blocks(rid, end)
        self.writes, self.resumed = {}, set()
        for rid, n in self.computed.items():
            for g, first in ((0, 0), (1, max(0, n - self.WINDOW + 1))):  # what the next query reads
                got = [self.content.get(self._slot_in(rid, pos, g)) for pos in range(first, n)]
                assert got == [self._kv(rid, pos, g) for pos in range(first, n)], f"{rid} reads wrong K/V in group {g}"
            held_sliding = held(self.kv, rid, 1)
            assert held_sliding <= cdiv(self.WINDOW - 1 + 5, self.bs) + 1  # writes are at most 5 tokens


GroupedKVContentMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestGroupedKVContentMachine = GroupedKVContentMachine.TestCase


def test_admission_bounds_a_sliding_group_by_the_long_prefill_cap():
    """A sliding group holds the window plus one step's chunk; with long_prefill_token_threshold
    that chunk is the cap (plus drafts), not the whole budget: a request that runs in the pool
    is admitted (it was refused, found by an adversarial review), and runs within the bound."""
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.scheduler.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(num_blocks=8, block_size=4, windows=(6,))
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=512, long_prefill_token_threshold=5)
    assert config.max_request_tokens == 5
    assert SchedulerConfig(2, 32, 512, long_prefill_token_threshold=5, num_speculative_tokens=3).max_request_tokens == 8
    assert SchedulerConfig(2, 32, 512).max_request_tokens == 32
    assert kv.max_blocks_held(60, 32) > 8 >= kv.max_blocks_held(60, 5)  # refused before, fits now
    sched = Scheduler(config, kv)
    req = Request("r", None, list(range(10, 50)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    sched.add_request(req)
    most = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert not out.preempted_ids and out.scheduled
        most = max(most, kv.num_blocks - kv.num_free_blocks)
        sched.update_from_output(out, [[7] if s.samples else [] for s in out.scheduled])
    assert most <= kv.max_blocks_held(60, 5) and len(req.output_token_ids) == 20


def test_cached_blocks_leave_in_prefix_order_so_prefixes_stay_longest():
    """Freed cached blocks join the free queue's tail in eviction order: behind the window the
    sliding group's oldest first; at the end both groups' later positions first, so a request's
    prefix blocks are the last of its blocks to be evicted."""
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, windows=(None, 8))
    prompt = list(range(100, 125))  # 25 tokens: 6 full blocks
    assert kv.allocate_slots("a", 0, 25)
    full_a, sliding_a = list(kv.tables[0]["a"]), list(kv.tables[1]["a"])
    kv.cache_blocks("a", 25, prompt)
    kv.remove_skipped_blocks("a", 25)  # sliding blocks 0..3 go behind the window
    cached_tail = [b for b in kv.block_pool.free_block_queue if b.block_hash is not None]
    assert cached_tail == sliding_a[:4]  # oldest first
    kv.free("a")
    cached = [b for b in kv.block_pool.free_block_queue if b.block_hash is not None]
    later = cached[4:]  # what free() appended: cached blocks 5, 4 of both groups, then the full group's 3..0
    assert later == [full_a[5], sliding_a[5], full_a[4], sliding_a[4], full_a[3], full_a[2], full_a[1], full_a[0]]
