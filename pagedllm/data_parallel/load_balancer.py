"""Which replica gets a new request: the least loaded one, unless another holds its prefix.

Pure logic (no processes, no clocks), so it is unit-tested on its own. The load of a replica is
what the API process knows about it: requests it routed there and that have not finished
(counted at once, so a burst does not all land on the replica that looked idle a step ago) and
the KV-cache usage the replica reported after its last step.

Prefix affinity: a prompt's full blocks get chained hashes (like the prefix cache's, but only
within this process, so Python's hash does); the replica that last served a chain is
remembered. A new prompt goes to the replica that holds its longest remembered chain, because
there its prefix is probably still cached - unless that replica is busier than the least
loaded one by more than ``affinity_margin`` (load units), when spreading the work wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ReplicaLoad:
    """What the balancer knows about one replica."""

    num_requests: int = 0  # routed here and not finished (waiting + running)
    kv_cache_usage: float = 0.0  # 0..1, reported after the replica's last step
    alive: bool = True


@dataclass
class BalancerConfig:
    block_size: int = 16  # tokens per hashed block (the engines' block size)
    # A full KV pool weighs as much as this many queued requests: a replica near its pool's end
    # would preempt, which costs more than a longer queue.
    kv_usage_weight: float = 8.0
    # Affinity holds while the owner's load is at most the least loaded replica's + this.
    affinity_margin: float = 4.0
    max_prefix_blocks: int = 64  # hash at most this many leading blocks of a prompt
    max_remembered: int = 100_000  # prefix hashes kept (least recently used forgotten first)


@dataclass
class LoadBalancer:
    """Routes requests to ``num_replicas`` replicas; ``loads[i]`` is updated by the caller."""

    num_replicas: int
    config: BalancerConfig = field(default_factory=BalancerConfig)
    loads: list[ReplicaLoad] = field(default_factory=list)
    _owner: OrderedDict[int, int] = field(default_factory=OrderedDict)  # prefix hash -> replica

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if not self.loads:
            self.loads = [ReplicaLoad() for _ in range(self.num_replicas)]

    def score(self, replica: int) -> float:
        load = self.loads[replica]
        return load.num_requests + self.config.kv_usage_weight * load.kv_cache_usage

    def prefix_hashes(self, token_ids: Sequence[int], salt: int = 0) -> list[int]:
        """Chained hashes of the prompt's full blocks, shortest prefix first. ``salt`` keeps
        prefixes apart that the engine caches apart (a LoRA adapter's id)."""
        bs = self.config.block_size
        n = min(len(token_ids) // bs, self.config.max_prefix_blocks)
        hashes, parent = [], hash(("prefix", salt))
        for b in range(n):
            parent = hash((parent, tuple(token_ids[b * bs : (b + 1) * bs])))
            hashes.append(parent)
        return hashes

    def choose(self, token_ids: Sequence[int], salt: int = 0) -> int:
        """The replica for a prompt; remembers it as the prompt's prefix owner."""
        alive = [i for i in range(self.num_replicas) if self.loads[i].alive]
        if not alive:
            raise RuntimeError("no replica is alive")
        least = min(alive, key=lambda i: (self.score(i), i))
        hashes = self.prefix_hashes(token_ids, salt)
        chosen = least
        for h in reversed(hashes):  # the longest remembered prefix first
            owner = self._owner.get(h)
            if owner is None or not self.loads[owner].alive:
                continue
            if self.score(owner) <= self.score(least) + self.config.affinity_margin:
                chosen = owner
            break
        for h in hashes:
            self._owner[h] = chosen
            self._owner.move_to_end(h)
        while len(self._owner) > self.config.max_remembered:
            self._owner.popitem(last=False)
        return chosen
