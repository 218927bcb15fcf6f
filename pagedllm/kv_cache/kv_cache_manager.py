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

KV-cache groups (``kv_cache/groups.py``): a model with sliding-window layers has several
groups, each with its own table per request, all drawing on the one pool; every operation
here (allocation all-or-nothing across groups, free, fork, swap, prefix caching) runs over
every group. A sliding group's table keeps its logical positions, but the entries of blocks
wholly behind the window of every query still to come hold the placeholder ``NULL_BLOCK``
(id ``NULL_BLOCK_ID`` in the ids handed to the runner) and the blocks themselves go back to
the pool (``remove_skipped_blocks``, after each step and before each allocation, as vLLM's
hybrid allocator does). Attention never reads those entries: a query at position p reads
keys from p - window + 1 on. A sliding group's prefix-cache hit of L tokens needs only the
blocks covering positions L - window + 1 .. L - 1; the others are adopted as placeholders.
The scheduler sees the same interface as with one group; ``get_block_ids`` is group 0's table
and ``get_group_block_ids`` every group's.

At DEBUG (logger ``pagedllm.kv_cache``) each allocation event logs one line starting with
``kv alloc``, ``kv free``, ``kv fork``, ``kv swap_out`` or ``kv swap_in`` (counts summed over
the groups).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

from pagedllm.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block

logger = logging.getLogger("pagedllm.kv_cache")

# The placeholder of a sliding group's table entry whose block went back to the pool. Never in
# the pool, never reference-counted; the runner gets NULL_BLOCK_ID for it (any valid id would
# do: no kernel reads it, the torch backends gather and mask it).
NULL_BLOCK = KVBlock(-1)
NULL_BLOCK_ID = 0
# A block table's key: a request id, or a holder's (beam search keeps a retired request's blocks
# under a tuple, which no request id can equal).
TableId = str | tuple[str, str]


def abbrev(items: Iterable[object], limit: int = 16) -> str:
    """``[a,b,c]`` for log lines; past ``limit`` items the rest shows as ``...+N``."""
    items = list(items)
    shown = ",".join(map(str, items[:limit]))
    if len(items) > limit:
        shown += f",...+{len(items) - limit}"
    return f"[{shown}]"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks_held(windows: Sequence[int | None], block_size: int, num_tokens: int, max_chunk: int) -> int:
    """The most pool blocks a request of ``num_tokens`` tokens holds at once, in steps of at
    most ``max_chunk`` tokens: a full group holds all its blocks; a sliding group the ones
    covering a step's queries and the window before the first (at most window - 1 +
    max_chunk positions, which touch at most one block more than they fill)."""
    n = cdiv(num_tokens, block_size)
    return sum(n if w is None else min(n, cdiv(w - 1 + max_chunk, block_size) + 1) for w in windows)


@dataclass
class KVPoolSnapshot:
    """``KVCacheManager.snapshot()``: each block's state (``states[i]``: 0 free, 1 free but
    still holding a cached prefix, 2 in use), the requests whose tables hold each used block
    (more than one: shared, e.g. a prefix-cache hit or a fork), and how many blocks carry a
    prefix-cache hash (free or not)."""

    num_blocks: int
    block_size: int
    states: bytes
    owners: dict[int, list[TableId]]
    num_cached_blocks: int

    @property
    def num_used(self) -> int:
        return self.states.count(2)

    @property
    def num_cached_free(self) -> int:
        return self.states.count(1)


class CachedPrefix(list):
    """``get_computed_blocks``' answer: group 0's hit blocks (a list, as one-group callers use
    it; its length is the hit in blocks, the same in every group) and every group's in
    ``groups`` (placeholders where a sliding group needs no block)."""

    def __init__(self, groups: list[list[KVBlock]]):
        super().__init__(groups[0])
        self.groups = groups


def _real(blocks: Iterable[KVBlock]) -> list[KVBlock]:
    return [b for b in blocks if b is not NULL_BLOCK]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        num_swap_blocks: int = 0,
        windows: Sequence[int | None] = (None,),
    ):
        """``windows``: one entry per KV-cache group, its sliding window or None (full)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not windows or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must name at least one group, each None or >= 1, got {windows!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self._sliding = [g for g, w in enumerate(self.windows) if w is not None]
        self.block_pool = BlockPool(num_blocks)
        # Per group: request -> its block table (sliding groups: placeholders behind the window).
        self.tables: list[dict[str, list[KVBlock]]] = [{} for _ in self.windows]
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: list[dict[str, int]] = [{} for _ in self.windows]  # leading blocks offered to the cache
        self._num_skipped: list[dict[str, int]] = [{} for _ in self.windows]  # leading entries already placeholders
        # Copy-on-write copies not yet handed to the runner, by request: a request preempted
        # in the same step withdraws its copies with its blocks.
        self._pending_copies: dict[str, list[tuple[int, int]]] = {}
        # Swap preemption: a secondary pool holding the blocks of swapped-out requests (per
        # group, placeholders kept where the table had them).
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.req_to_swapped: dict[str, list[list[KVBlock]]] = {}
        # This step's swaps, by request, so a request that leaves within the step withdraws its
        # own: swap-outs (primary block, swap block), swap-ins (swap block, primary block). The
        # swap blocks of a swap-in stay reserved until the step's moves are taken: a swap-out
        # later in the same step must not reuse them before the swap-in has read them.
        self._pending_swap_out: dict[str, list[tuple[int, int]]] = {}
        self._pending_swap_in: dict[str, tuple[list[list[KVBlock]], list[tuple[int, int]]]] = {}
        self.num_swap_outs = 0
        # Running totals for the scheduler's DEBUG step line (an integer add each).
        self.num_allocated_total = 0  # primary blocks handed out new: fresh, copy-on-write, swap-in
        self.num_freed_total = 0  # primary blocks returned to the free queue
        self.num_cached_hits_total = 0  # prefix-cache blocks adopted
        self.num_skipped_total = 0  # of the freed: sliding-group blocks behind the window

    @property
    def req_to_blocks(self) -> dict[str, list[KVBlock]]:
        """Group 0's tables (the only ones of a model without sliding windows)."""
        return self.tables[0]

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        """Entries of one block table covering ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The module's ``max_blocks_held`` for this manager's groups and block size."""
        return max_blocks_held(self.windows, self.block_size, num_tokens, max_chunk)

    def _first_needed(self, group: int, num_computed_tokens: int) -> int:
        """The first table entry a query at a position >= ``num_computed_tokens`` may read."""
        w = self.windows[group]
        return 0 if w is None else max(0, num_computed_tokens - w + 1) // self.block_size

    @staticmethod
    def _key(group: int, block_hash: BlockHash) -> BlockHash:
        """The prefix-cache key of a block of ``group`` (same tokens, other layers' K/V)."""
        return block_hash if group == 0 else block_hash + group.to_bytes(4, "little")

    def _block_hashes(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int | None = None, extra_keys: tuple = ()
    ) -> list[BlockHash]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens, extended as they grow.
        ``extra_keys`` (a request's LoRA adapter) go into every block's hash: the same tokens
        under another adapter are other K/V."""
        hashes = self.req_to_hashes.setdefault(request_id, [])
        bs = self.block_size
        n = len(token_ids) if num_tokens is None else num_tokens
        for i in range(len(hashes), n // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], extra_keys))
        return hashes

    def block_hashes(self, request_id: str, token_ids: Sequence[int], num_tokens: int | None = None,
                     extra_keys: tuple = ()) -> list[BlockHash]:
        """The chained hashes of the request's full blocks (the prefix cache's keys; the KV
        connector's too), computed once per request."""
        return self._block_hashes(request_id, token_ids, num_tokens, extra_keys)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int], extra_keys: tuple = ()) -> CachedPrefix:
        """The longest cached prefix of the request's tokens, in whole blocks, usable by every group.

        A full group needs the whole chain of cached blocks; a sliding group only the blocks
        the first query after the hit can see (the rest become placeholders), so the hit is
        the longest k blocks for which both hold. Stops one token short of the end: the last
        token is always recomputed for logits.
        """
        if not self.enable_caching:
            return CachedPrefix([[] for _ in self.windows])
        hashes = self._block_hashes(request_id, token_ids, extra_keys=extra_keys)
        k = min(len(hashes), (len(token_ids) - 1) // self.block_size)
        pool = self.block_pool
        chains: dict[int, list[KVBlock]] = {}
        for g, w in enumerate(self.windows):
            if w is None:
                chain: list[KVBlock] = []
                for h in hashes[:k]:
                    block = pool.get_cached_block(self._key(g, h))
                    if block is None:
                        break
                    chain.append(block)
                chains[g] = chain
                k = len(chain)
        found = {g: [pool.get_cached_block(self._key(g, h)) for h in hashes[:k]] for g in self._sliding}
        while k > 0 and not all(
            all(b is not None for b in found[g][self._first_needed(g, k * self.block_size) : k]) for g in self._sliding
        ):
            k -= 1
        groups: list[list[KVBlock]] = []
        for g in range(self.num_groups):
            if g in chains:
                groups.append(chains[g][:k])
            else:
                first = self._first_needed(g, k * self.block_size)
                groups.append([NULL_BLOCK] * first + found[g][first:k])  # type: ignore[operator]
        return CachedPrefix(groups)

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make room in every group for ``num_new_tokens`` after the first ``num_computed_tokens``.

        ``computed_blocks`` are prefix-cache hits to adopt (``get_computed_blocks``' answer for a
        request starting out, whose ``num_computed_tokens`` they cover). All groups or none:
        returns False when the pool has too few free blocks for all of them, having changed
        nothing but returning the sliding groups' blocks no step can read any more (as vLLM
        does: fewer evictions); the scheduler then preempts someone and tries again.
        """
        bs = self.block_size
        if isinstance(computed_blocks, CachedPrefix):
            hits: list[Sequence[KVBlock]] | None = computed_blocks.groups
        elif computed_blocks:
            if self.num_groups != 1:
                raise ValueError("with several KV-cache groups, pass get_computed_blocks()' answer")
            hits = [computed_blocks]
        else:
            hits = None
        if self._sliding:
            self.remove_skipped_blocks(request_id, num_computed_tokens)
        end = num_computed_tokens + num_new_tokens
        want = self.num_blocks_for(end)
        first_write = num_computed_tokens // bs
        plans = []
        needed = 0
        for g in range(self.num_groups):
            blocks = self.tables[g].setdefault(request_id, [])
            adopt = hits[g] if hits else ()
            if adopt:
                assert not blocks and len(adopt) * bs == num_computed_tokens
            num_new = max(0, want - len(blocks) - len(adopt))
            if adopt:  # reviving a freed cached block takes it out of the free queue too
                needed += sum(1 for b in adopt if b.ref_cnt == 0 and b is not NULL_BLOCK)
            # Existing blocks this step writes into that others still reference (never placeholders:
            # they lie behind the window of the step's first query).
            last = min(len(blocks), want)
            shared = [i for i in range(first_write, last) if blocks[i].ref_cnt > 1] if num_new_tokens else []
            plans.append((blocks, adopt, num_new, shared))
            needed += num_new + len(shared)
        if needed > self.block_pool.num_free_blocks:
            return False
        # Every group adopts its hits before any group takes new blocks: a free cached block one
        # group is about to adopt must not be handed to another as a new block first.
        num_adopted = 0
        if hits:
            for blocks, adopt, _, _ in plans:
                real = _real(adopt)
                self.block_pool.touch(real)
                blocks.extend(adopt)
                num_adopted += len(real)
        new_ids: list[int] = []
        num_shared = 0
        for blocks, _, num_new, shared in plans:
            for i in shared:
                (copy,) = self.block_pool.get_new_blocks(1)
                self._pending_copies.setdefault(request_id, []).append((blocks[i].block_id, copy.block_id))
                self.block_pool.free_blocks([blocks[i]])
                blocks[i] = copy
            num_shared += len(shared)
            if num_new:
                new = self.block_pool.get_new_blocks(num_new)
                blocks.extend(new)
                new_ids += [b.block_id for b in new]
        self.num_allocated_total += len(new_ids) + num_shared
        self.num_cached_hits_total += num_adopted
        if (new_ids or num_shared or num_adopted) and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv alloc req=%s new=%d ids=%s cached_hits=%d cow=%d tokens=%d+%d blocks=%d free=%d/%d",
                request_id,
                len(new_ids),
                abbrev(new_ids),
                num_adopted,
                num_shared,
                num_computed_tokens,
                num_new_tokens,
                sum(len(_real(p[0])) for p in plans),
                self.block_pool.num_free_blocks,
                self.num_blocks,
            )
        return True

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Return to the pool the sliding groups' blocks that no query from position
        ``num_computed_tokens`` on can read; their entries become placeholders. Returns how
        many entries it cleared (a no-op for full groups, and while a swap-in is pending).

        Query p reads keys p - w + 1 .. p, so the next step (queries from c =
        ``num_computed_tokens``) reads nothing before c - w + 1; every entry wholly before
        that position's block goes::

            positions:  0 ........................ c-w+1 ........ c ...... c+n
            blocks:     | 0 | 1 | ... | f-1 |  f  | ... |        |         |
                        '-- placeholders --'  '-- kept: f = (c-w+1) // block_size
        """
        if not self._sliding or request_id in self._pending_swap_in:
            return 0
        freed: list[KVBlock] = []
        for g in self._sliding:
            blocks = self.tables[g].get(request_id)
            if not blocks:
                continue
            first = min(self._first_needed(g, num_computed_tokens), len(blocks))
            start = self._num_skipped[g].get(request_id, 0)
            for i in range(start, first):
                if blocks[i] is not NULL_BLOCK:
                    freed.append(blocks[i])
                    blocks[i] = NULL_BLOCK
            if first > start:
                self._num_skipped[g][request_id] = first
        if freed:
            free_before = self.block_pool.num_free_blocks
            self.block_pool.free_blocks(freed)  # oldest first: evicted first
            returned = self.block_pool.num_free_blocks - free_before  # fewer if shared with a fork
            self.num_freed_total += returned
            self.num_skipped_total += returned
        return len(freed)

    def cache_blocks(
        self, request_id: str, num_computed_tokens: int, token_ids: Sequence[int], extra_keys: tuple = ()
    ) -> None:
        """Register the request's blocks that are full of computed K/V in the prefix cache.

        Called after the step that computed them (not at allocation): a request withdrawn
        from a step before it ran must not leave unwritten blocks findable by content. Call it
        before ``remove_skipped_blocks``: a sliding block freed behind the window stays
        findable (in the free queue) until its slot is handed out again.
        """
        if not self.enable_caching:
            return
        hashes = self._block_hashes(request_id, token_ids, num_computed_tokens, extra_keys)
        for g in range(self.num_groups):
            blocks = self.tables[g].get(request_id, [])
            start = self._num_registered[g].get(request_id, 0)
            end = min(num_computed_tokens // self.block_size, len(hashes), len(blocks))
            for i in range(start, end):
                if blocks[i] is not NULL_BLOCK:
                    self.block_pool.cache_block(blocks[i], self._key(g, hashes[i]))
            self._num_registered[g][request_id] = max(start, end)

    def fork(self, parent_id: TableId, child_id: TableId) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (shared, reference-counted).

        Between steps only: the parent's blocks must already hold their K/V (no copy or
        swap-in of the parent is pending), or the child could lose them with the parent.
        """
        assert parent_id not in self._pending_copies and parent_id not in self._pending_swap_in
        if any(self.tables[g].get(child_id) for g in range(self.num_groups)):
            raise ValueError(f"request {child_id!r} already has blocks")
        shared = 0
        for g in range(self.num_groups):
            parent = self.tables[g].get(parent_id, [])
            real = _real(parent)
            self.block_pool.touch(real)
            shared += len(real)
            self.tables[g][child_id] = list(parent)
            if parent_id in self._num_skipped[g]:
                self._num_skipped[g][child_id] = self._num_skipped[g][parent_id]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kv fork parent=%s child=%s shared=%d", parent_id, child_id, shared)

    def free(self, request_id: TableId) -> None:
        """Release a request's blocks (and swapped copies); its tail goes into the free queue first."""
        tables = [t.pop(request_id, []) for t in self.tables]
        self._pending_copies.pop(request_id, None)  # nothing will read the copies' destinations
        self._pending_swap_out.pop(request_id, None)
        swapping_in = self._pending_swap_in.pop(request_id, None)
        if swapping_in is not None and self.swap_pool is not None:
            self.swap_pool.free_blocks(b for s in swapping_in[0] for b in _real(s))
        self.req_to_hashes.pop(request_id, None)
        for g in range(self.num_groups):
            self._num_registered[g].pop(request_id, None)
            self._num_skipped[g].pop(request_id, None)
        if self.num_groups == 1:
            order = _real(reversed(tables[0]))
        else:  # later positions first across the groups, so prefixes stay cached longest
            indexed = [(i, b) for blocks in tables for i, b in enumerate(blocks) if b is not NULL_BLOCK]
            order = [b for _, b in sorted(indexed, key=lambda ib: -ib[0])]
        free_before = self.block_pool.num_free_blocks
        self.block_pool.free_blocks(order)
        returned = self.block_pool.num_free_blocks - free_before  # less than len(order) if shared
        self.num_freed_total += returned
        swapped = self.req_to_swapped.pop(request_id, None)
        if swapped and self.swap_pool is not None:
            self.swap_pool.free_blocks(b for s in swapped for b in _real(s))
        if (order or swapped) and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv free req=%s blocks=%d returned=%d swapped=%d free=%d/%d",
                request_id,
                len(order),
                returned,
                sum(len(_real(s)) for s in swapped or ()),
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
        tables = [t.get(request_id, []) for t in self.tables]
        real = [(g, i, b) for g, blocks in enumerate(tables) for i, b in enumerate(blocks) if b is not NULL_BLOCK]
        if self.swap_pool is None or not real or len(real) > self.swap_pool.num_free_blocks:
            return False
        dst = self.swap_pool.get_new_blocks(len(real))
        # A block whose copy-on-write copy is still pending holds nothing yet: save the copy's
        # source instead (swap-outs run before copies, while the source is intact).
        copied_from = {d: s for s, d in self._pending_copies.get(request_id, ())}
        pairs = [(copied_from.get(b.block_id, b.block_id), d.block_id) for (_, _, b), d in zip(real, dst)]
        swapped: list[list[KVBlock]] = [[NULL_BLOCK] * len(blocks) for blocks in tables]
        for (g, i, _), d in zip(real, dst):
            swapped[g][i] = d
        self.free(request_id)
        self._pending_swap_out[request_id] = pairs
        self.req_to_swapped[request_id] = swapped
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
        want = self.num_blocks_for(num_tokens_after)
        num_real = sum(len(_real(s)) for s in swapped)
        needed = num_real + sum(max(0, want - len(s)) for s in swapped)
        if needed > self.block_pool.num_free_blocks:
            return False
        new = iter(self.block_pool.get_new_blocks(num_real))
        pairs = []
        for g, s in enumerate(swapped):
            blocks = [NULL_BLOCK if b is NULL_BLOCK else next(new) for b in s]
            pairs += [(b.block_id, p.block_id) for b, p in zip(s, blocks) if b is not NULL_BLOCK]
            self.tables[g][request_id] = blocks
        self._pending_swap_in[request_id] = (swapped, pairs)
        del self.req_to_swapped[request_id]
        self.num_allocated_total += num_real
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv swap_in req=%s blocks=%d ids=%s free=%d/%d",
                request_id,
                num_real,
                abbrev(p for _, p in pairs),
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
            self.swap_pool.free_blocks(b for s in swapped for b in _real(s))
        self._pending_swap_out, self._pending_swap_in = {}, {}
        return out, inn

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (placeholders as ``NULL_BLOCK_ID``)."""
        blocks = self.tables[0].get(request_id, [])
        if not self._sliding:
            return [b.block_id for b in blocks]
        return [NULL_BLOCK_ID if b is NULL_BLOCK else b.block_id for b in blocks]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's table, group 0 first (placeholders as ``NULL_BLOCK_ID``)."""
        if self.num_groups == 1:
            return [self.get_block_ids(request_id)]
        return [[NULL_BLOCK_ID if b is NULL_BLOCK else b.block_id for b in t.get(request_id, [])] for t in self.tables]

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request's tables reference (placeholders not counted)."""
        return sum(len(_real(t.get(request_id, []))) for t in self.tables)

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs the runner must apply before the next forward."""
        copies = [c for pairs in self._pending_copies.values() for c in pairs]
        self._pending_copies = {}
        return copies

    def snapshot(self) -> "KVPoolSnapshot":
        """The pool as plain data, for a live view (the dashboard): one pass over the blocks and
        the block tables, no copies of K/V. Call it on the thread that steps the engine."""
        owners: dict[int, list[TableId]] = {}
        for table in self.tables:
            for request_id, blocks in table.items():
                for b in blocks:
                    if b is not NULL_BLOCK:
                        owners.setdefault(b.block_id, []).append(request_id)
        states = bytearray(self.num_blocks)  # 0 free, 1 free but cached (revivable), 2 in use
        num_cached = 0
        for b in self.block_pool.blocks:
            if b.ref_cnt > 0:
                states[b.block_id] = 2
            elif b.block_hash is not None:
                states[b.block_id] = 1
            num_cached += b.block_hash is not None
        return KVPoolSnapshot(self.num_blocks, self.block_size, bytes(states), owners, num_cached)

    def check_integrity(self) -> None:
        """Every reference is held by exactly one block-table entry, of one group; free + used = total."""
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for g, table in enumerate(self.tables):
            for blocks in table.values():
                for b in blocks:
                    if b is not NULL_BLOCK:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
                        assert group_of.setdefault(b.block_id, g) == g, f"{b} is in groups {group_of[b.block_id]} and {g}"
        assert NULL_BLOCK.ref_cnt == 0 and NULL_BLOCK.block_hash is None, "the placeholder was touched"
        for b in self.block_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"{b} has {refs.get(b.block_id, 0)} owners"
        assert self.block_pool.num_free_blocks + len(refs) == self.num_blocks
        if self.swap_pool is not None:
            self.swap_pool.check_integrity()
            swapped = sum(len(_real(s)) for v in self.req_to_swapped.values() for s in v)
            swapped += sum(len(_real(s)) for v, _ in self._pending_swap_in.values() for s in v)
            assert self.swap_pool.num_used_blocks == swapped
