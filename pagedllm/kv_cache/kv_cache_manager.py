"""Per-request block tables on top of the block pool, with automatic prefix caching.

A request's block table maps its logical blocks (token index // block_size) to physical
blocks. Blocks are allocated as the request's computed tokens grow and freed, in reverse
order, the moment it finishes or is preempted. ``fork`` shares a request's blocks with a
new one (parallel sampling); a write into a shared, partly filled block first copies it
(copy-on-write), and the copy is handed to the model runner as a (src, dst) pair.

With prefix caching on, every block that becomes full is registered under its chained
content hash; a new request adopts the longest chain of cached blocks matching its tokens
(``get_computed_blocks``) and computes only the rest. The last token is always computed so
that the step produces logits.

At DEBUG (logger ``pagedllm.kv_cache``) each allocation event logs one line starting with
``kv alloc``, ``kv free``, ``kv fork``, ``kv swap_out`` or ``kv swap_in``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from pagedllm.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block

logger = logging.getLogger("pagedllm.kv_cache")


def abbrev(items: Iterable[object], limit: int = 16) -> str:
    """``[a,b,c]`` for log lines; past ``limit`` items the rest shows as ``...+N``."""
    items = list(items)
    shown = ",".join(map(str, items[:limit]))
    if len(items) > limit:
        shown += f",...+{len(items) - limit}"
    return f"[{shown}]"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_swap_blocks: int = 0):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks already offered to the cache
        # Copy-on-write copies not yet handed to the runner, by request: a request preempted
        # in the same step withdraws its copies with its blocks.
        self._pending_copies: dict[str, list[tuple[int, int]]] = {}
        # Swap preemption: a secondary pool holding the blocks of swapped-out requests.
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.req_to_swapped: dict[str, list[KVBlock]] = {}
        # This step's swaps, by request, so a request that leaves within the step withdraws its
        # own: swap-outs (primary block, swap block), swap-ins (swap block, primary block). The
        # swap blocks of a swap-in stay reserved until the step's moves are taken: a swap-out
        # later in the same step must not reuse them before the swap-in has read them.
        self._pending_swap_out: dict[str, list[tuple[int, int]]] = {}
        self._pending_swap_in: dict[str, tuple[list[KVBlock], list[tuple[int, int]]]] = {}
        self.num_swap_outs = 0
        # Running totals for the scheduler's DEBUG step line (an integer add each).
        self.num_allocated_total = 0  # primary blocks handed out new: fresh, copy-on-write, swap-in
        self.num_freed_total = 0  # primary blocks returned to the free queue
        self.num_cached_hits_total = 0  # prefix-cache blocks adopted

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request_id: str, token_ids: Sequence[int], num_tokens: int | None = None) -> list[BlockHash]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens, extended as they grow."""
        hashes = self.req_to_hashes.setdefault(request_id, [])
        bs = self.block_size
        n = len(token_ids) if num_tokens is None else num_tokens
        for i in range(len(hashes), n // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> list[KVBlock]:
        """The longest chain of cached blocks that starts the request's tokens.

        Stops one token short of the end: the last token is always recomputed for logits.
        """
        if not self.enable_caching:
            return []
        hashes = self._block_hashes(request_id, token_ids)
        hits: list[KVBlock] = []
        for h in hashes[: (len(token_ids) - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` after the first ``num_computed_tokens``.

        ``computed_blocks`` are prefix-cache hits to adopt (a request starting out, whose
        ``num_computed_tokens`` they cover). Returns False, changing nothing, when the pool
        has too few free blocks; the scheduler then preempts someone and tries again.
        """
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if computed_blocks:
            assert not blocks and len(computed_blocks) * self.block_size == num_computed_tokens
        end = num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, self.num_blocks_for(end) - len(blocks) - len(computed_blocks))
        # Reviving a freed cached block takes it out of the free queue too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        # Existing blocks this step writes into that others still reference.
        first = num_computed_tokens // self.block_size
        last = min(len(blocks), self.num_blocks_for(end))
        shared = [i for i in range(first, last) if blocks[i].ref_cnt > 1] if num_new_tokens else []
        if num_new_blocks + len(shared) + num_revived > self.block_pool.num_free_blocks:
            return False
        self.block_pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        for i in shared:
            (copy,) = self.block_pool.get_new_blocks(1)
            self._pending_copies.setdefault(request_id, []).append((blocks[i].block_id, copy.block_id))
            self.block_pool.free_blocks([blocks[i]])
            blocks[i] = copy
        new = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new)
        self.num_allocated_total += num_new_blocks + len(shared)
        self.num_cached_hits_total += len(computed_blocks)
        if (new or shared or computed_blocks) and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv alloc req=%s new=%d ids=%s cached_hits=%d cow=%d tokens=%d+%d blocks=%d free=%d/%d",
                request_id,
                len(new),
                abbrev(b.block_id for b in new),
                len(computed_blocks),
                len(shared),
                num_computed_tokens,
                num_new_tokens,
                len(blocks),
                self.block_pool.num_free_blocks,
                self.num_blocks,
            )
        return True

    def cache_blocks(self, request_id: str, num_computed_tokens: int, token_ids: Sequence[int]) -> None:
        """Register the request's blocks that are full of computed K/V in the prefix cache.

        Called after the step that computed them (not at allocation): a request withdrawn
        from a step before it ran must not leave unwritten blocks findable by content.
        """
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request_id, [])
        hashes = self._block_hashes(request_id, token_ids, num_computed_tokens)
        start = self._num_registered.get(request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(hashes), len(blocks))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_registered[request_id] = max(start, end)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (shared, reference-counted).

        Between steps only: the parent's blocks must already hold their K/V (no copy or
        swap-in of the parent is pending), or the child could lose them with the parent.
        """
        assert parent_id not in self._pending_copies and parent_id not in self._pending_swap_in
        if child_id in self.req_to_blocks and self.req_to_blocks[child_id]:
            raise ValueError(f"request {child_id!r} already has blocks")
        parent = self.req_to_blocks.get(parent_id, [])
        self.block_pool.touch(parent)
        self.req_to_blocks[child_id] = list(parent)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kv fork parent=%s child=%s shared=%d", parent_id, child_id, len(parent))

    def free(self, request_id: str) -> None:
        """Release a request's blocks (and swapped copies); its tail goes into the free queue first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self._pending_copies.pop(request_id, None)  # nothing will read the copies' destinations
        self._pending_swap_out.pop(request_id, None)
        swapping_in = self._pending_swap_in.pop(request_id, None)
        if swapping_in is not None and self.swap_pool is not None:
            self.swap_pool.free_blocks(swapping_in[0])
        self.req_to_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        free_before = self.block_pool.num_free_blocks
        self.block_pool.free_blocks(reversed(blocks))
        returned = self.block_pool.num_free_blocks - free_before  # less than len(blocks) if shared
        self.num_freed_total += returned
        swapped = self.req_to_swapped.pop(request_id, None)
        if swapped and self.swap_pool is not None:
            self.swap_pool.free_blocks(swapped)
        if (blocks or swapped) and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv free req=%s blocks=%d returned=%d swapped=%d free=%d/%d",
                request_id,
                len(blocks),
                returned,
                len(swapped or ()),
                self.block_pool.num_free_blocks,
                self.num_blocks,
            )

    def swap_out(self, request_id: str) -> bool:
        """Move a request's blocks to the swap pool (copied before the next forward)."""
        swapping_in = self._pending_swap_in.pop(request_id, None)
        if swapping_in is not None:  # swapped in earlier in this same step: just undo that
            saving = self._pending_swap_out.get(request_id)  # a swap-out still filling its swap blocks
            self.free(request_id)  # its primary blocks hold nothing yet
            if saving is not None:
                self._pending_swap_out[request_id] = saving
            self.req_to_swapped[request_id] = swapping_in[0]
            self.num_swap_outs += 1
            return True
        blocks = self.req_to_blocks.get(request_id, [])
        if self.swap_pool is None or not blocks or len(blocks) > self.swap_pool.num_free_blocks:
            return False
        dst = self.swap_pool.get_new_blocks(len(blocks))
        # A block whose copy-on-write copy is still pending holds nothing yet: save the copy's
        # source instead (swap-outs run before copies, while the source is intact).
        copied_from = {d: s for s, d in self._pending_copies.get(request_id, ())}
        pairs = [(copied_from.get(b.block_id, b.block_id), d.block_id) for b, d in zip(blocks, dst)]
        self.free(request_id)
        self._pending_swap_out[request_id] = pairs
        self.req_to_swapped[request_id] = dst
        self.num_swap_outs += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv swap_out req=%s blocks=%d swap_free=%d/%d",
                request_id,
                len(dst),
                self.swap_pool.num_free_blocks,
                self.swap_pool.num_blocks,
            )
        return True

    def swap_in(self, request_id: str, num_tokens_after: int) -> bool:
        """Bring a swapped request back, with room for ``num_tokens_after`` tokens in all."""
        swapped = self.req_to_swapped[request_id]
        needed = max(len(swapped), self.num_blocks_for(num_tokens_after))
        if needed > self.block_pool.num_free_blocks:
            return False
        new = self.block_pool.get_new_blocks(len(swapped))
        self._pending_swap_in[request_id] = (swapped, [(s.block_id, b.block_id) for s, b in zip(swapped, new)])
        del self.req_to_swapped[request_id]
        self.req_to_blocks[request_id] = new
        self.num_allocated_total += len(new)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv swap_in req=%s blocks=%d ids=%s free=%d/%d",
                request_id,
                len(new),
                abbrev(b.block_id for b in new),
                self.block_pool.num_free_blocks,
                self.num_blocks,
            )
        return True

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(swap-out, swap-in) block pairs; the runner applies swap-outs first. The swap blocks
        read by this step's swap-ins are free again from here on."""
        out = [pair for pairs in self._pending_swap_out.values() for pair in pairs]
        inn = [pair for _, pairs in self._pending_swap_in.values() for pair in pairs]
        for swapped, _ in self._pending_swap_in.values():
            assert self.swap_pool is not None
            self.swap_pool.free_blocks(swapped)
        self._pending_swap_out, self._pending_swap_in = {}, {}
        return out, inn

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs the runner must apply before the next forward."""
        copies = [c for pairs in self._pending_copies.values() for c in pairs]
        self._pending_copies = {}
        return copies

    def check_integrity(self) -> None:
        """Every reference is held by exactly one block-table entry; free + used = total."""
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"{b} has {refs.get(b.block_id, 0)} owners"
        assert self.block_pool.num_free_blocks + len(refs) == self.num_blocks
        if self.swap_pool is not None:
            self.swap_pool.check_integrity()
            swapped = sum(len(v) for v in self.req_to_swapped.values())
            swapped += sum(len(blocks) for blocks, _ in self._pending_swap_in.values())
            assert self.swap_pool.num_used_blocks == swapped
