"""KV-cache groups: layers that share one block table per request.

A sliding-window layer only ever reads its last ``window`` positions, so the blocks behind
its window can go back to the pool while the request runs - but a full-attention layer needs
every block. If one block held every layer (as it does without sliding layers), a hybrid model
like Gemma 3 (5 sliding layers of every 6) could free nothing. So, after vLLM's hybrid
allocator, the layers are split into groups of one attention type, each group with its own
block table per request, all groups drawing blocks from one shared pool:

    Gemma 3 270M, 18 layers (S = sliding 512, F = full), groups of gcd(15, 3) = 3 layers:
        layer:  0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17
        type:   S S S S S F S S S S S  F  S  S  S  S  S  F
        group:  1 1 1 2 2 0 2 3 3 3 4  0  4  4  5  5  5  0     (group 0: the full layers)
        slot:   0 1 2 0 1 0 2 0 1 2 0  1  1  2  0  1  2  2

Every group holds the same number of layers (``num_slots``), so a block - block_size
tokens of K and V for ``num_slots`` layers - has one size whatever group it serves, and one
pool serves them all. Layer l keeps its K/V in the tensors of its slot (one [num_blocks,
block_size, kv_heads, head_dim] K and V per slot) at the blocks of its group's table: layers in
the same slot of different groups share tensors but never blocks. The group size is the gcd
of the per-type layer counts, so no slot is ever padding (vLLM pads to the smallest count
instead; with gcd a model like 20 sliding + 6 full layers gets 13 groups of 2 rather than
wasting memory, at the cost of more block tables per step).

A model with one attention type keeps exactly one group of all its layers: the single block
table, block size and cost it always had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table; ``window`` None = full attention."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    """How the layers map onto groups and onto the per-slot KV tensors."""

    groups: tuple[KVCacheGroup, ...]
    layer_group: tuple[int, ...]  # layer -> its group
    layer_slot: tuple[int, ...]  # layer -> its KV tensors (position within its group)

    @property
    def num_slots(self) -> int:
        """Layers per group: K/V tensors per block, and the block's size in layers."""
        return len(self.groups[0].layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @classmethod
    def single(cls, num_layers: int) -> "KVCacheLayout":
        """One full-attention group of every layer (models without sliding windows)."""
        return cls((KVCacheGroup(None, tuple(range(num_layers))),), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def from_windows(cls, windows: list[int | None]) -> "KVCacheLayout":
        """Groups for layers with these windows (None = full; the runner reads them off the
        model's architecture): full groups first, then sliding ones by window, each type's
        layers cut in order into groups of gcd(type counts)."""
        by_type: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            by_type.setdefault(w, []).append(layer)
        if len(by_type) == 1:
            (w,) = by_type
            n = len(windows)
            return cls((KVCacheGroup(w, tuple(range(n))),), (0,) * n, tuple(range(n)))
        size = math.gcd(*(len(v) for v in by_type.values()))
        groups: list[KVCacheGroup] = []
        for w in sorted(by_type, key=lambda w: -1 if w is None else w):
            layers = by_type[w]
            groups += [KVCacheGroup(w, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for g, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                layer_group[layer], layer_slot[layer] = g, slot
        return cls(tuple(groups), tuple(layer_group), tuple(layer_slot))

    def describe(self) -> str:
        """One line for the startup log."""
        parts = []
        for g, group in enumerate(self.groups):
            kind = "full" if group.window is None else f"sliding {group.window}"
            parts.append(f"{g}: {kind} layers {','.join(map(str, group.layers))}")
        return f"{len(self.groups)} group(s) of {self.num_slots} layer(s) [" + "; ".join(parts) + "]"
