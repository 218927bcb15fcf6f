"""Tests of per-request block tables: growth, freeing order, fork and copy-on-write.

Ends with a hypothesis state machine that drives random allocate / fork / free sequences
against a simple model and checks the pool after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.kv_cache.kv_cache_manager import KVCacheManager, cdiv


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue]


def ref(kv: KVCacheManager, block_id: int) -> int:
    return kv.block_pool.blocks[block_id].ref_cnt


# --------------------------------------------------------------------------- growth
# (num_computed_tokens, num_new_tokens) steps of one request, and the block count after each.
GROWTH = [(0, 5), (5, 11), (16, 1), (17, 20), (37, 0), (37, 27), (64, 1), (65, 30)]
EXPECTED_BLOCKS = {
    16: [1, 1, 2, 3, 3, 4, 5, 6],  # ends: 5 16 17 37 37 64 65 95
    32: [1, 1, 1, 2, 2, 2, 3, 3],
}


@pytest.mark.parametrize("block_size", [16, 32])
def test_allocate_slots_grows_block_table(block_size):
    kv = KVCacheManager(num_blocks=10, block_size=block_size)
    for (computed, new), expected in zip(GROWTH, EXPECTED_BLOCKS[block_size], strict=True):
        assert kv.allocate_slots("r", computed, new)
        # Fresh pool: blocks are handed out in id order and never replaced while unshared.
        assert kv.get_block_ids("r") == list(range(expected))
        assert kv.num_free_blocks == 10 - expected
        assert kv.num_blocks_for(computed + new) == expected
        assert kv.take_pending_copies() == []
        kv.check_integrity()
    kv.free("r")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_num_blocks_for_and_cdiv():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert [kv.num_blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert cdiv(7, 3) == 3 and cdiv(6, 3) == 2 and cdiv(0, 5) == 0
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)


def test_two_requests_get_disjoint_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 0, 6)  # 2 blocks
    assert kv.allocate_slots("b", 0, 9)  # 3 blocks
    assert kv.allocate_slots("a", 6, 3)  # 9 tokens -> 3 blocks
    assert kv.get_block_ids("a") == [0, 1, 5]
    assert kv.get_block_ids("b") == [2, 3, 4]
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_allocate_returns_false_and_changes_nothing_when_pool_short():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 0, 40)  # 3 blocks
    before_a = kv.get_block_ids("a")
    before_free = free_ids(kv)
    assert before_free == [3]

    # A new request needing 2 blocks.
    assert not kv.allocate_slots("b", 0, 17)
    assert kv.get_block_ids("b") == []
    # An existing request growing past what is free (48 -> needs 4 blocks: ok; 65 -> 5: not).
    assert not kv.allocate_slots("a", 40, 25)
    assert kv.get_block_ids("a") == before_a
    assert free_ids(kv) == before_free
    assert kv.num_free_blocks == 1
    assert kv.take_pending_copies() == []
    kv.check_integrity()

    # Exactly what is free still fits.
    assert kv.allocate_slots("a", 40, 24)
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 0
    # Writing within the last block needs no new block even with the pool empty.
    assert kv.allocate_slots("a", 64, 0)
    kv.check_integrity()


def test_free_releases_blocks_in_reverse_order():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 0, 12)  # blocks 0 1 2
    assert kv.allocate_slots("b", 0, 4)  # block 3
    kv.free("a")
    # Tail block first: 2 is freed before 1 before 0, each to the head (they hold nothing
    # findable), so the next request reuses them in the same order, before never-used 4 and 5.
    assert free_ids(kv) == [0, 1, 2, 4, 5]
    assert kv.get_block_ids("a") == []
    assert "a" not in kv.req_to_blocks
    kv.check_integrity()
    # Freeing an unknown or already freed request is a no-op.
    kv.free("a")
    kv.free("nobody")
    assert free_ids(kv) == [0, 1, 2, 4, 5]
    # New allocations take the head: the freed blocks (memory already written) first.
    assert kv.allocate_slots("c", 0, 12)
    assert kv.get_block_ids("c") == [0, 1, 2]
    kv.check_integrity()


# --------------------------------------------------------------------------- fork / copy-on-write
def test_fork_shares_blocks_and_copy_on_write_of_partial_last_block():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert kv.allocate_slots("p", 0, 20)  # block 0 full, block 1 holds 4 tokens
    assert kv.get_block_ids("p") == [0, 1]
    kv.fork("p", "c")
    assert kv.get_block_ids("c") == [0, 1]
    assert ref(kv, 0) == 2 and ref(kv, 1) == 2
    assert kv.num_free_blocks == 6  # sharing uses no new blocks
    kv.check_integrity()

    # The child writes token 20 into the shared, partly filled block 1: copy it first.
    assert kv.allocate_slots("c", 20, 1)
    assert kv.get_block_ids("c") == [0, 2]
    assert kv.get_block_ids("p") == [0, 1]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_pending_copies() == []  # taken once
    assert ref(kv, 0) == 2  # the full prefix block stays shared
    assert ref(kv, 1) == 1 and ref(kv, 2) == 1
    assert kv.num_free_blocks == 5
    kv.check_integrity()

    # The parent now owns block 1 alone: its write needs no copy.
    assert kv.allocate_slots("p", 20, 1)
    assert kv.get_block_ids("p") == [0, 1]
    assert kv.take_pending_copies() == []
    kv.check_integrity()

    # Freeing the parent leaves the child's blocks alive.
    kv.free("p")
    assert ref(kv, 0) == 1 and ref(kv, 1) == 0 and ref(kv, 2) == 1
    assert free_ids(kv)[0] == 1  # the parent's private block went back (to the head); block 0 did not
    assert 0 not in free_ids(kv)
    kv.free("c")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_parent_write_copies_too():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("p", 0, 6)  # [0, 1(2 tokens)]
    kv.fork("p", "c")
    assert kv.allocate_slots("p", 6, 1)  # the parent is the first writer
    assert kv.get_block_ids("p") == [0, 2]
    assert kv.get_block_ids("c") == [0, 1]
    assert kv.take_pending_copies() == [(1, 2)]
    kv.check_integrity()


def test_write_after_full_shared_block_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert kv.allocate_slots("p", 0, 32)  # two full blocks
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 32, 1)  # goes into a new block
    assert kv.get_block_ids("c") == [0, 1, 2]
    assert kv.get_block_ids("p") == [0, 1]
    assert kv.take_pending_copies() == []
    assert ref(kv, 0) == 2 and ref(kv, 1) == 2 and ref(kv, 2) == 1
    kv.check_integrity()


def test_multi_token_write_copies_shared_block_and_extends():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("p", 0, 5)  # [0 full, 1 with 1 token]
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 5, 6)  # tokens 5..10 -> blocks 1 (copied) and 2 (new)
    assert kv.get_block_ids("c") == [0, 2, 3]
    assert kv.take_pending_copies() == [(1, 2)]
    assert ref(kv, 1) == 1
    kv.check_integrity()


def test_copy_on_write_counts_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("p", 0, 6)  # 2 blocks
    kv.fork("p", "c")
    assert kv.allocate_slots("x", 0, 1)  # the last free block
    assert kv.num_free_blocks == 0
    # The child's write into the shared block needs a copy, and there is no room.
    assert not kv.allocate_slots("c", 6, 1)
    assert kv.get_block_ids("c") == [0, 1]
    assert ref(kv, 1) == 2
    assert kv.take_pending_copies() == []
    kv.check_integrity()
    kv.free("x")
    assert kv.allocate_slots("c", 6, 1)
    assert kv.get_block_ids("c") == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    kv.check_integrity()


def test_fork_into_request_with_blocks_is_rejected():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("p", 0, 4)
    assert kv.allocate_slots("c", 0, 4)
    with pytest.raises(ValueError):
        kv.fork("p", "c")
    assert ref(kv, 0) == 1
    kv.check_integrity()


def test_check_integrity_detects_a_block_with_two_owners():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 0, 4)
    # Hand a's block to b behind the pool's back (no touch): one reference, two owners.
    kv.req_to_blocks["b"] = list(kv.req_to_blocks["a"])
    with pytest.raises(AssertionError):
        kv.check_integrity()


# --------------------------------------------------------------------------- property test
REQ_IDS = [f"r{i}" for i in range(6)]


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / fork / free against a model of token counts and block ownership."""

    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(1, 16))
    def setup(self, block_size, num_blocks):
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
        self.length: dict[str, int] = {}  # request -> tokens it has slots for
        # block id -> requests allowed to hold it (its allocator, plus fork descendants).
        self.allowed: dict[int, set[str]] = {}

    # ------------------------------------------------------------- helpers
    def owners(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rid, blocks in self.kv.req_to_blocks.items():
            for b in blocks:
                out.setdefault(b.block_id, []).append(rid)
        return out

    # ------------------------------------------------------------- rules
    @rule(rid=st.sampled_from(REQ_IDS), data=st.data())
    def allocate(self, rid, data):
        kv, bs = self.kv, self.bs
        n = data.draw(st.integers(0, 3 * bs), label="num_new_tokens")
        computed = self.length.get(rid, 0)
        end = computed + n
        before_ids = kv.get_block_ids(rid)
        before_free = free_ids(kv)
        held_before = set(self.owners())  # every block some table holds

        # What the model expects: existing blocks written this step that are shared get copied.
        written = range(computed // bs, min(len(before_ids), cdiv(end, bs))) if n else range(0)
        to_copy = [i for i in written if ref(kv, before_ids[i]) > 1]
        grow = max(0, cdiv(end, bs) - len(before_ids))
        fits = grow + len(to_copy) <= len(before_free)

        ok = kv.allocate_slots(rid, computed, n)
        assert ok == fits
        copies = kv.take_pending_copies()
        after_ids = kv.get_block_ids(rid)

        if not ok:
            assert after_ids == before_ids
            assert free_ids(kv) == before_free
            assert copies == []
            return

        self.length[rid] = end
        assert len(after_ids) == cdiv(end, bs)
        assert len(set(after_ids)) == len(after_ids)
        new_ids = [after_ids[i] for i in to_copy] + after_ids[len(before_ids) :]
        # Fresh blocks come from the head of the free queue, copies first, in order.
        assert new_ids == before_free[: len(new_ids)]
        assert not set(new_ids) & held_before
        assert copies == [(before_ids[i], after_ids[i]) for i in to_copy]
        for i, old in enumerate(before_ids):
            if i not in to_copy:
                assert after_ids[i] == old
        for b in new_ids:
            self.allowed[b] = {rid}
        for i in to_copy:
            self.allowed[before_ids[i]].discard(rid)

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.length)), label="parent")
        free_children = [r for r in REQ_IDS if r not in self.length]
        if not free_children:
            return
        child = data.draw(st.sampled_from(free_children), label="child")
        before_free = free_ids(self.kv)
        parent_ids = self.kv.get_block_ids(parent)
        refs_before = [ref(self.kv, b) for b in parent_ids]
        self.kv.fork(parent, child)
        assert self.kv.get_block_ids(child) == parent_ids
        assert [ref(self.kv, b) for b in parent_ids] == [r + 1 for r in refs_before]
        assert free_ids(self.kv) == before_free
        self.length[child] = self.length[parent]
        for b in parent_ids:
            self.allowed[b].add(child)

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.length)), label="request")
        ids = self.kv.get_block_ids(rid)
        before_free = free_ids(self.kv)
        released = [b for b in reversed(ids) if ref(self.kv, b) == 1]
        self.kv.free(rid)
        # Blocks whose last owner left hold nothing findable (no prefix caching here): they join
        # the head, tail block first, so the head is now the request's first block.
        assert free_ids(self.kv) == released[::-1] + before_free
        assert self.kv.get_block_ids(rid) == []
        del self.length[rid]
        for b in ids:
            self.allowed[b].discard(rid)

    # ------------------------------------------------------------- invariants
    @invariant()
    def pool_is_consistent(self):
        self.kv.check_integrity()
        for b, holders in self.owners().items():
            assert len(holders) == len(set(holders)), f"block {b} twice in one table"
            assert set(holders) <= self.allowed.get(b, set()), f"block {b} held by {holders}"
        for rid, n in self.length.items():
            assert len(self.kv.get_block_ids(rid)) == cdiv(n, self.bs)
        used = set(self.owners())
        assert self.kv.num_free_blocks == self.kv.num_blocks - len(used)
        assert self.kv.usage() == pytest.approx(len(used) / self.kv.num_blocks)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in list(self.length):
            self.kv.free(rid)
            self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)
        assert sorted(free_ids(self.kv)) == list(range(self.kv.num_blocks))


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase


# --------------------------------------------------------------------------- copy-on-write vs preemption
def _apply_moves(content: dict, swap: dict, copies, swap_out, swap_in) -> None:
    """The runner's order: swap-outs, then copies, then swap-ins (block ids -> contents)."""
    for src, dst in swap_out:
        swap[dst] = content.get(src)
    snapshot = {src: content.get(src) for src, _ in copies}  # index_copy_ reads all sources first
    for src, dst in copies:
        content[dst] = snapshot[src]
    for src, dst in swap_in:
        content[dst] = swap.get(src)


def _forked_pair(kv: KVCacheManager, content: dict) -> None:
    """Parent 'a' computed 6 tokens (block 2 partly filled), then forked into 'b'."""
    assert kv.allocate_slots("a", 0, 6)
    for b in kv.get_block_ids("a"):
        content[b] = f"kv-of-a-block-{b}"
    kv.fork("a", "b")


def test_preempted_request_withdraws_its_pending_copy_in_swap_mode():
    """Bug: a copy-on-write copy pending when its request is swapped out in the same step
    was applied after the swap-out, so the swapped copy of the block held stale K/V."""
    kv = KVCacheManager(num_blocks=8, block_size=4, num_swap_blocks=8)
    content: dict = {}
    swap: dict = {}
    _forked_pair(kv, content)
    shared_tail = kv.get_block_ids("a")[1]
    assert kv.allocate_slots("a", 6, 1)  # writes into the shared partial block: copy pending
    assert kv.get_block_ids("a")[1] != shared_tail
    assert kv.swap_out("a")  # preempted in the same step, before the runner ran
    copies = kv.take_pending_copies()
    out, inn = kv.take_pending_swaps()
    assert copies == []  # the copy went with the request
    _apply_moves(content, swap, copies, out, inn)
    # Bring 'a' back in a later step: its second block must hold the shared block's K/V.
    assert kv.swap_in("a", 7)
    out, inn = kv.take_pending_swaps()
    _apply_moves(content, swap, kv.take_pending_copies(), out, inn)
    restored = kv.get_block_ids("a")
    assert [content[b] for b in restored] == [f"kv-of-a-block-{b}" for b in (0, shared_tail)]
    kv.check_integrity()


def test_preempted_request_withdraws_its_pending_copy_in_recompute_mode():
    """Bug: the withdrawn copy's destination, freed and handed out again in the same step,
    could become a second copy's destination (index_copy_ with duplicate destinations)."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    content: dict = {}
    _forked_pair(kv, content)  # blocks 0, 1 shared; 2 free
    assert kv.allocate_slots("a", 6, 1)  # copy 1 -> 2 pending for 'a'
    kv.free("a")  # preempted (recompute) in the same step
    assert kv.allocate_slots("b", 6, 1)  # now 'b' alone holds block 1: no copy needed
    copies = kv.take_pending_copies()
    assert copies == []
    assert len({d for _, d in copies}) == len(copies)
    kv.check_integrity()


# --------------------------------------------------------------------------- steps, simulated on contents
CONTENT_REQS = ["p", "q", "r"]


class KVContentMachine(RuleBasedStateMachine):
    """Whole steps against the KV manager, with the runner simulated on block contents.

    Within a step requests are allocated slots (new ones adopt prefix-cache hits), forked
    (parallel samples / beams sharing blocks), and preempted - by swap or by recompute - even
    after they were allocated in the same step, as the priority policy does. ``run_step`` then
    applies the step's block moves in the runner's order (swap-outs, copies, swap-ins) and
    writes each scheduled token's K/V, which here is the token prefix it encodes. After every
    step each running request must read, through its block table, exactly its own K/V.
    """

    @initialize(caching=st.booleans())
    def setup(self, caching):
        self.bs = 2
        self.kv = KVCacheManager(num_blocks=10, block_size=self.bs, enable_caching=caching, num_swap_blocks=8)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # running requests: positions with K/V in the pool
        self.swapped: dict[str, int] = {}  # swapped-out requests: positions saved in the swap pool
        self.writes: dict[str, tuple[int, int]] = {}  # this step's [start, end) per request
        self.resumed: set[str] = set()  # swapped in this step (their K/V arrives with the step)
        self.content: dict[int, tuple] = {}  # pool slot -> K/V (the prefix it encodes)
        self.swap_content: dict[int, tuple] = {}

    def _kv(self, rid: str, pos: int) -> tuple:
        return tuple(self.tokens[rid][: pos + 1])

    def _ready(self) -> list[str]:
        """Running requests whose every token has K/V and that are untouched this step."""
        return sorted(r for r in self.computed
                      if r not in self.writes and r not in self.resumed and self.computed[r] == len(self.tokens[r]))  # fmt: skip

    def _drop(self, rid: str) -> None:
        self.kv.free(rid)
        for d in (self.tokens, self.computed, self.swapped, self.writes):
            d.pop(rid, None)
        self.resumed.discard(rid)

    @precondition(lambda self: len(self.tokens) < len(CONTENT_REQS))
    @rule(data=st.data(), prompt=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def admit(self, data, prompt):
        """A new request: small alphabet, so prompts share prefixes and hit the cache."""
        rid = data.draw(st.sampled_from([r for r in CONTENT_REQS if r not in self.tokens]), label="request")
        hits = self.kv.get_computed_blocks(rid, prompt)
        start = len(hits) * self.bs
        if self.kv.allocate_slots(rid, start, len(prompt) - start, hits):
            self.tokens[rid], self.computed[rid] = list(prompt), start
            self.writes[rid] = (start, len(prompt))
        else:
            self.kv.free(rid)

    @precondition(lambda self: self._ready())
    @rule(data=st.data())
    def decode(self, data):
        rid = data.draw(st.sampled_from(self._ready()), label="request")
        new = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=2), label="tokens")
        start = len(self.tokens[rid])
        if self.kv.allocate_slots(rid, start, len(new)):
            self.tokens[rid] += new
            self.writes[rid] = (start, start + len(new))

    @precondition(lambda self: self._ready() and len(self.tokens) < len(CONTENT_REQS))
    @rule(data=st.data())
    def fork(self, data):
        """Forks happen between steps (after the step that computed the parent's last token)."""
        children = [r for r in CONTENT_REQS if r not in self.tokens]
        parent = data.draw(st.sampled_from(self._ready()), label="parent")
        child = data.draw(st.sampled_from(children), label="child")
        self.kv.fork(parent, child)
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]

    @precondition(lambda self: self.computed)
    @rule(data=st.data(), swap=st.booleans())
    def preempt(self, data, swap):
        """Preempt a running request, possibly one allocated earlier in this very step."""
        rid = data.draw(st.sampled_from(sorted(self.computed)), label="victim")
        self.writes.pop(rid, None)  # withdrawn from the step
        if swap and self.kv.swap_out(rid):
            self.swapped[rid] = self.computed.pop(rid)
        else:  # recompute: it starts over later; here it simply leaves
            self._drop(rid)

    @precondition(lambda self: self._ready())
    @rule(data=st.data(), swap=st.booleans())
    def decode_then_preempted(self, data, swap):
        """The priority policy's pattern: a running request gets its slots for this step, then a
        higher-priority arrival preempts it before the step runs."""
        rid = data.draw(st.sampled_from(self._ready()), label="request")
        start = len(self.tokens[rid])
        if not self.kv.allocate_slots(rid, start, 1):
            return
        self.tokens[rid].append(0)
        if swap and self.kv.swap_out(rid):
            self.swapped[rid] = self.computed.pop(rid)
        else:
            self._drop(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def resume(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)), label="request")
        if self.kv.swap_in(rid, self.swapped[rid]):
            self.computed[rid] = self.swapped.pop(rid)
            self.resumed.add(rid)

    @precondition(lambda self: any(r not in self.writes for r in self.computed))
    @rule(data=st.data())
    def finish(self, data):
        self._drop(data.draw(st.sampled_from(sorted(r for r in self.computed if r not in self.writes)), label="request"))

    def _slot(self, rid: str, pos: int) -> int:
        return self.kv.get_block_ids(rid)[pos // self.bs] * self.bs + pos % self.bs

    def _move_blocks(self) -> None:
        """Apply the step's pending block moves to the simulated contents, in the runner's
        order: swap-outs, then copy-on-write copies (from a snapshot), then swap-ins."""
        copies = self.kv.take_pending_copies()
        swap_out, swap_in = self.kv.take_pending_swaps()
        assert len({d for _, d in copies}) == len(copies), f"two copies into one block: {copies}"
        bs = self.bs
        for src, dst in swap_out:
            for o in range(bs):
                self.swap_content[dst * bs + o] = self.content.get(src * bs + o)
        snapshot = {src * bs + o: self.content.get(src * bs + o) for src, _ in copies for o in range(bs)}
        for src, dst in copies:
            for o in range(bs):
                self.content[dst * bs + o] = snapshot[src * bs + o]
        for src, dst in swap_in:
            for o in range(bs):
                self.content[dst * bs + o] = self.swap_content.get(src * bs + o)

    @rule()
    def run_step(self):
        self._move_blocks()
        for rid, (start, end) in self.writes.items():
            for pos in range(start, end):
                self.content[self._slot(rid, pos)] = self._kv(rid, pos)
            self.computed[rid] = end
            self.kv.cache_blocks(rid, end, self.tokens[rid])
        self.writes, self.resumed = {}, set()
        for rid, n in self.computed.items():
            got = [self.content.get(self._slot(rid, pos)) for pos in range(n)]
            assert got == [self._kv(rid, pos) for pos in range(n)], f"{rid} reads wrong K/V"

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "kv"):
            self.kv.check_integrity()


KVContentMachine.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVContentMachine = KVContentMachine.TestCase


def test_a_swap_pool_with_exactly_enough_room_takes_the_request():
    """Three blocks into three free swap blocks: swapped, not refused (a mutation audit made the
    room check strict without a test failing); one block more than the room is refused."""
    kv = KVCacheManager(num_blocks=8, block_size=4, num_swap_blocks=3)
    assert kv.allocate_slots("a", 0, 12)  # 3 blocks
    assert kv.swap_out("a") and kv.swap_pool.num_free_blocks == 0
    big = KVCacheManager(num_blocks=8, block_size=4, num_swap_blocks=3)
    assert big.allocate_slots("b", 0, 13)  # 4 blocks
    assert not big.swap_out("b") and big.get_block_ids("b")


def test_a_swapped_request_comes_back_into_exactly_enough_free_blocks():
    """swap_in's room check mirrors swap_out's: needing exactly the free blocks is enough (a strict
    check would leave a request needing the whole pool swapped out forever); one more is not."""
    kv = KVCacheManager(num_blocks=4, block_size=4, num_swap_blocks=4)
    assert kv.allocate_slots("a", 0, 12) and kv.swap_out("a")  # 3 blocks out
    kv.take_pending_swaps()
    assert kv.allocate_slots("x", 0, 4)  # 3 blocks left free
    assert not kv.swap_in("a", 13)  # room for a 13th token needs a 4th block
    assert kv.swap_in("a", 12) and kv.block_pool.num_free_blocks == 0
    kv.check_integrity()
