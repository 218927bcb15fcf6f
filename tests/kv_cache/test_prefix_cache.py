"""Prefix caching in the KV manager: textbook cases and a property test."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.kv_cache.block_pool import hash_block
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager

BS = 4


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit a request as the scheduler does: adopt cache hits, allocate the rest, run the step."""
    hits = kv.get_computed_blocks(rid, tokens)
    computed = len(hits) * BS
    assert kv.allocate_slots(rid, computed, len(tokens) - computed, hits)
    kv.cache_blocks(rid, len(tokens), tokens)  # after the forward computed them
    return computed


def test_two_requests_sharing_three_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    shared = list(range(100, 112))  # 3 full blocks
    a = shared + [1, 2]
    b = shared + [7, 8, 9]
    assert admit(kv, "a", a) == 0
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert admit(kv, "b", b) == 12  # three blocks from the cache
    assert kv.get_block_ids("b") == [0, 1, 2, 4]
    refs = [kv.block_pool.blocks[i].ref_cnt for i in range(5)]
    assert refs == [2, 2, 2, 1, 1]
    h0 = hash_block(None, shared[0:4])
    h1 = hash_block(h0, shared[4:8])
    h2 = hash_block(h1, shared[8:12])
    assert [kv.block_pool.blocks[i].block_hash for i in range(3)] == [h0, h1, h2]
    assert kv.block_pool.blocks[3].block_hash is None  # partial blocks are never cached
    assert set(kv.block_pool.cached_blocks) == {h0, h1, h2}
    kv.check_integrity()


def test_a_block_hash_names_its_whole_prefix_not_just_its_tokens():
    """[S, S] after [S, T]: its second block holds S's tokens, like the cached first block, but
    after a different prefix, so only the first block is a hit (block hashes are chained)."""
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    s, t = [5, 6, 7, 8], [9, 10, 11, 12]
    admit(kv, "a", s + t + [1])
    assert admit(kv, "b", s + s + [1]) == BS
    assert admit(kv, "c", s + t + [2]) == 2 * BS
    kv.check_integrity()


def test_last_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    tokens = list(range(8))  # exactly two blocks
    admit(kv, "a", tokens)
    kv.free("a")
    # Both blocks are cached, but the last token must produce logits: only one block is a hit.
    assert admit(kv, "b", tokens) == 4


def test_free_queue_order_is_eviction_order_and_a_miss_evicts_in_that_order():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True)
    admit(kv, "a", list(range(0, 9)))  # blocks 0,1 full + 2 partial
    admit(kv, "b", list(range(50, 58)) + [1])  # blocks 3,4 full + 5 partial
    kv.free("a")  # tail first: 2 (partial, uncached: to the head), then 1, 0 (cached: to the tail)
    kv.free("b")  # then 5 (head), 4, 3 (tail)
    order = [b.block_id for b in kv.block_pool.free_block_queue]
    assert order == [5, 2, 1, 0, 4, 3]
    cached_before = dict(kv.block_pool.cached_blocks)
    assert len(cached_before) == 4
    # A request that shares nothing takes blocks from the head: the uncached ones first, then
    # it evicts in that order.
    admit(kv, "c", list(range(900, 912)))
    assert kv.get_block_ids("c") == [5, 2, 1]
    evicted = {h for h, blk in cached_before.items() if blk.block_id == 1}
    assert not evicted & set(kv.block_pool.cached_blocks)
    assert all(kv.block_pool.blocks[i].block_hash is not None for i in (0, 3, 4))  # block 0 kept
    kv.check_integrity()


def test_a_hit_revives_a_freed_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    tokens = list(range(9))
    admit(kv, "a", tokens)
    kv.free("a")
    assert kv.num_free_blocks == 4
    assert admit(kv, "b", tokens) == 8
    assert kv.get_block_ids("b")[:2] == [0, 1]
    assert kv.num_free_blocks == 1
    kv.check_integrity()


def test_reset_clears_everything():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True)
    admit(kv, "a", list(range(9)))
    kv.free("a")
    kv.reset_prefix_cache()
    assert not kv.block_pool.cached_blocks
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert admit(kv, "b", list(range(9))) == 0
    kv.check_integrity()


def test_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    admit(kv, "a", list(range(9)))
    kv.free("a")
    assert admit(kv, "b", list(range(9))) == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 5), st.integers(1, 3), st.integers(1, 9)),
        max_size=40,
    )
)
def test_random_workloads_keep_the_books(ops):
    """free + used = total, cached blocks are exactly the hashed ones, no block has two writers."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=True)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for op, rid_n, prefix_kind, length in ops:
        rid = f"r{rid_n}"
        if op == "admit" and rid not in tokens:
            toks = [prefix_kind] * (4 * prefix_kind) + list(range(1000 * rid_n, 1000 * rid_n + length))
            hits = kv.get_computed_blocks(rid, toks)
            done = len(hits) * BS
            if kv.allocate_slots(rid, done, len(toks) - done, hits):
                kv.cache_blocks(rid, len(toks), toks)
                tokens[rid], computed[rid] = toks, len(toks)
            else:
                kv.free(rid)
        elif op == "grow" and rid in tokens:
            toks = tokens[rid]
            toks.extend(range(5000, 5000 + length))
            if kv.allocate_slots(rid, computed[rid], len(toks) - computed[rid]):
                kv.cache_blocks(rid, len(toks), toks)
                computed[rid] = len(toks)
            else:
                del toks[len(toks) - length :]
        elif op == "free" and rid in tokens:
            kv.free(rid)
            del tokens[rid], computed[rid]
        kv.check_integrity()
        pool = kv.block_pool
        used = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks}
        assert pool.num_free_blocks + len(used) == pool.num_blocks
        # A block being written (partial, or the next to fill) belongs to one request only.
        for r, blocks in kv.req_to_blocks.items():
            if r in computed and computed[r] % BS:
                assert blocks[computed[r] // BS].ref_cnt == 1
    for rid in list(tokens):
        kv.free(rid)
    assert kv.num_free_blocks == 12
    kv.check_integrity()


def test_blocks_join_the_cache_only_once_computed():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True)
    tokens = list(range(9))
    assert kv.allocate_slots("a", 0, 9)
    # Allocated but not yet computed (e.g. withdrawn from the step): nothing is findable.
    assert kv.get_computed_blocks("b", tokens) == []
    kv.free("a")
    assert not kv.block_pool.cached_blocks


def test_a_chunk_registers_only_the_blocks_it_filled():
    """A prefill chunk that ends inside a block leaves that block out of the cache: another
    request with the same prompt must not read K/V that was never written."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    tokens = list(range(13))
    assert kv.get_computed_blocks("a", tokens) == []
    assert kv.allocate_slots("a", 0, 6)  # the first chunk: tokens 0-5, block 1 half written
    kv.cache_blocks("a", 6, tokens)
    assert len(kv.get_computed_blocks("b", tokens)) == 1
    assert kv.allocate_slots("a", 6, 2)  # the chunk that fills block 1
    kv.cache_blocks("a", 8, tokens)
    assert len(kv.get_computed_blocks("c", tokens)) == 2


def test_sequential_requests_reuse_the_same_blocks_unless_they_hold_cached_content():
    """The pool's pages are committed when first written: one request after another must cycle
    through the same few blocks, not walk the whole pool - without prefix caching always, with it
    once the content of the freed blocks is forgotten (their hashes kept them at the tail)."""
    for caching in (False, True):
        kv = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=caching)
        used = set()
        for i in range(20):
            tokens = [1000 * i + j for j in range(3 * BS + 1)]  # 4 blocks, nothing shared
            admit(kv, f"r{i}", tokens)
            used.update(kv.get_block_ids(f"r{i}"))
            kv.free(f"r{i}")
            if caching:
                kv.reset_prefix_cache()
        assert len(used) == 4, (caching, sorted(used))
        kv.check_integrity()
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_caching=True)
    used = set()
    for i in range(10):  # cached content is kept: fresh blocks first, while there are any
        admit(kv, f"r{i}", [1000 * i + j for j in range(3 * BS + 1)])
        used.update(kv.get_block_ids(f"r{i}"))
        kv.free(f"r{i}")
    assert len(used) == 3 * 10 + 1  # every request's 3 full blocks stay cached; the partial one is reused
