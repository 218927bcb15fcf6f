"""The pool of KV-cache blocks: reference counts, an ordered free queue, and the prefix cache.

A block is free exactly when its reference count is 0; free blocks sit in a doubly linked
queue so any of them can be taken out in O(1). New blocks are taken from the head. A freed
block that holds cached content (a hash, below) joins the tail, so cached blocks are evicted
least recently freed first (LRU), and only after every block that holds nothing findable: a
freed block without a hash joins the head (the last freed is reused first). So the blocks in
use cycle through the same memory - pages already committed, often still in the CPU's caches -
instead of walking the whole pool and first-touching all of it (the pool's pages are committed
only when first written: kv_cache_dtype.py), while the prefix cache keeps everything it had.

Prefix caching: a full block may carry a content hash (see ``hash_block``) and be listed in
``cached_blocks``. A freed block keeps its hash and contents; a later request with the same
prefix revives it (``touch``) instead of recomputing. Only when the block is handed out
again as a new block is its hash dropped (evicted).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence


BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Chained content hash of a full block: SHA-256 of (parent hash, token ids, extra keys).

    SHA-256 is deterministic across processes (a later on-disk cache can reuse it) and
    strong enough that a collision - two different prefixes sharing KV - is not a practical
    concern, so hits are not re-checked token by token. ``extra_keys`` leaves room for a
    LoRA id or cache salt.
    """
    h = hashlib.sha256(parent or b"\0" * 32)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; both None while the block is in use.
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVBlock]):
        # Sentinels keep the link updates branch-free.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        assert prev is not None and prev.next_free is not None
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        block.prev_free, block.next_free = prev, prev.next_free
        prev.next_free.prev_free = block
        prev.next_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise RuntimeError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Owns every block; hands them out and takes them back by reference count."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_block_queue.popleft()
            assert b.ref_cnt == 0
            if b.block_hash is not None:  # evict: its old contents are about to be overwritten
                del self.cached_blocks[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a block that is now full; a duplicate of cached content stays unlisted."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash; blocks keep their owners, but nothing is found by content (so the
        free ones among them move to the head: they hold nothing findable any more)."""
        for b in self.cached_blocks.values():
            b.block_hash = None
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
                self.free_block_queue.appendleft(b)
        self.cached_blocks.clear()

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (sharing); a free block leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order: a block left unreferenced joins
        the tail if cached (the given order becomes eviction order), else the head (reused first)."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_block_queue.appendleft(b)
                else:
                    self.free_block_queue.append(b)

    def check_integrity(self) -> None:
        """Free queue holds exactly the blocks with no references, each once."""
        queued = [b.block_id for b in self.free_block_queue]
        assert len(queued) == len(set(queued)) == self.num_free_blocks, "free queue corrupt"
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert set(queued) == unreferenced, "free queue and reference counts disagree"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        for h, b in self.cached_blocks.items():
            assert b.block_hash == h, "cache map and block hash disagree"
        assert sum(b.block_hash is not None for b in self.blocks) == len(self.cached_blocks)
