"""Unit tests of the KV block pool and its free queue (no model, no torch tensors)."""

from __future__ import annotations

import pytest

from pagedllm.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# --------------------------------------------------------------------------- FreeBlockQueue
def test_free_queue_keeps_insertion_order_and_length():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5
    assert ids(q) == [0, 1, 2, 3, 4]


def test_free_queue_popleft_append_remove():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    first = q.popleft()
    assert first.block_id == 0
    assert first.prev_free is None and first.next_free is None
    assert ids(q) == [1, 2, 3]

    q.remove(blocks[2])  # from the middle
    assert ids(q) == [1, 3]
    assert len(q) == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None

    q.append(first)
    q.append(blocks[2])
    assert ids(q) == [1, 3, 0, 2]
    assert len(q) == 4

    q.remove(blocks[1])  # the head
    q.remove(blocks[2])  # the tail
    assert ids(q) == [3, 0]
    assert q.popleft().block_id == 3
    assert q.popleft().block_id == 0
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(RuntimeError):
        q.popleft()


def test_free_queue_remove_of_block_not_in_queue_raises():
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)
    with pytest.raises(RuntimeError):
        q.remove(KVBlock(99))
    assert len(q) == 1 and ids(q) == [1]


# --------------------------------------------------------------------------- BlockPool
def test_pool_rejects_non_positive_size():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(-3)


def test_new_blocks_come_from_head_in_id_order():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)
    assert ids(a) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a)
    b = pool.get_new_blocks(2)
    assert ids(b) == [3, 4]
    assert free_ids(pool) == [5, 6, 7]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 5
    assert pool.get_new_blocks(0) == []
    pool.check_integrity()


def test_freed_blocks_without_content_join_the_head_last_freed_first():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 0 1 2 3 ; free: 4 5
    # Free in a scrambled order: each joins the head, so the last freed comes first.
    pool.free_blocks([blocks[2], blocks[0], blocks[3]])
    assert free_ids(pool) == [3, 0, 2, 4, 5]
    assert all(blocks[i].ref_cnt == 0 for i in (0, 2, 3))
    assert blocks[1].ref_cnt == 1
    pool.check_integrity()

    # Allocation order = head first: the freed ones (memory already written), then never-used.
    again = pool.get_new_blocks(5)
    assert ids(again) == [3, 0, 2, 4, 5]
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_freed_cached_blocks_join_the_tail_in_given_order_behind_the_rest():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)  # 0 1 2 3 ; free: 4 5
    for i, h in ((2, b"h2"), (0, b"h0")):
        pool.cache_block(blocks[i], h)
    pool.free_blocks([blocks[2], blocks[3], blocks[0], blocks[1]])
    # The cached ones keep the given order at the tail (eviction order), after the never-used
    # blocks; the empty ones went to the head.
    assert free_ids(pool) == [1, 3, 4, 5, 2, 0]
    assert ids(pool.get_new_blocks(5)) == [1, 3, 4, 5, 2]  # 2 is evicted only when nothing else is left
    assert pool.get_cached_block(b"h2") is None and pool.get_cached_block(b"h0") is blocks[0]
    pool.check_integrity()


def test_reset_prefix_cache_moves_the_free_cached_blocks_to_the_head():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[0], b"h0")
    pool.cache_block(blocks[1], b"h1")
    pool.free_blocks([blocks[0], blocks[1]])  # block 2 stays in use
    assert free_ids(pool) == [3, 4, 0, 1]
    pool.reset_prefix_cache()
    assert free_ids(pool) == [1, 0, 3, 4]  # nothing findable now: reused first
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity()


def test_ref_counts_with_touch_and_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    assert b.ref_cnt == 1
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 3
    pool.check_integrity()

    pool.free_blocks([b])
    assert b.ref_cnt == 2
    assert b.block_id not in free_ids(pool)
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert b.block_id not in free_ids(pool)
    assert pool.num_free_blocks == 3
    pool.free_blocks([b])
    assert b.ref_cnt == 0
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_touching_a_free_block_removes_it_from_free_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)  # free queue: 1 0 2 3 4
    assert free_ids(pool) == [1, 0, 2, 3, 4]
    target = pool.blocks[2]
    assert target.ref_cnt == 0
    pool.touch([target])  # revive a free block from the middle of the queue
    assert target.ref_cnt == 1
    assert free_ids(pool) == [1, 0, 3, 4]
    assert pool.num_free_blocks == 4
    pool.check_integrity()
    # It can no longer be handed out as a new block.
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 0, 3, 4]
    assert target not in got
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.check_integrity()


def test_double_free_raises():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    # The failed free did not corrupt the queue (the block is in it once).
    assert free_ids(pool).count(b.block_id) == 1
    pool.check_integrity()

    # Never-allocated blocks cannot be freed either.
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[2]])
    pool.check_integrity()


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    before = free_ids(pool)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == before == [3]
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        BlockPool(2).get_new_blocks(3)


def test_usage_values():
    pool = BlockPool(4)
    assert pool.usage() == 0.0
    a = pool.get_new_blocks(1)
    assert pool.usage() == pytest.approx(0.25)
    b = pool.get_new_blocks(3)
    assert pool.usage() == pytest.approx(1.0)
    pool.touch(a)  # sharing does not use more blocks
    assert pool.usage() == pytest.approx(1.0)
    pool.free_blocks(a)
    assert pool.usage() == pytest.approx(1.0)
    pool.free_blocks(a)
    assert pool.usage() == pytest.approx(0.75)
    pool.free_blocks(b[:2])
    assert pool.usage() == pytest.approx(0.25)
    pool.free_blocks(b[2:])
    assert pool.usage() == 0.0


def test_check_integrity_passes_in_normal_use_and_catches_corruption():
    pool = BlockPool(10)
    pool.check_integrity()
    a = pool.get_new_blocks(4)
    pool.check_integrity()
    pool.touch(a[1:3])
    pool.check_integrity()
    pool.free_blocks(reversed(a))
    pool.check_integrity()
    b = pool.get_new_blocks(6)
    pool.check_integrity()
    pool.free_blocks(a[1:3])
    pool.free_blocks(b)
    pool.check_integrity()
    assert pool.num_free_blocks == 10

    # Corrupt a reference count: the check must notice.
    pool.blocks[0].ref_cnt = 1
    with pytest.raises(AssertionError):
        pool.check_integrity()
