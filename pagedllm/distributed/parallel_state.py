"""A worker's place in the world and its torch.distributed groups.

Rank layout: ``rank = pp_rank * tp + tp_rank``, so the ranks of one pipeline stage are
contiguous (and on one node when a node holds a whole stage). Each stage has its own
tensor-parallel group; pipeline point-to-point goes to the rank with the same ``tp_rank`` in
the next / previous stage. The backend follows the device: gloo on CPU (nccl would follow on
GPUs). No global state: a ``ParallelContext`` is passed to what needs it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedllm.envs import env_seconds

# A collective that waits this long for a peer fails instead of hanging (the engine has
# usually noticed the dead peer long before; PAGEDLLM_DIST_TIMEOUT overrides, in seconds).
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankInfo:
    """Where one worker sits: its global rank and the world's shape."""

    rank: int
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp


@dataclass
class ParallelContext:
    """The groups a worker's model uses: its stage's tensor-parallel group, and the ranks it
    exchanges hidden states with. ``allreduce_seconds`` accumulates the time spent in the
    tensor-parallel all-reduces (read and reset by the worker per step)."""

    info: RankInfo
    tp_group: object | None
    allreduce_seconds: float = 0.0
    allreduce_calls: int = 0
    _time: bool = field(default=False, repr=False)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_parallel(info: RankInfo, master_addr: str, master_port: int, device: str = "cpu") -> ParallelContext:
    """Join the world (tcp:// rendezvous at rank 0's address, as torchrun's env://) and build
    every stage's tensor-parallel group (each rank must create every group, in order)."""
    timeout = datetime.timedelta(seconds=env_seconds("PAGEDLLM_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://{master_addr}:{master_port}", rank=info.rank,
        world_size=info.world_size, timeout=timeout,
    )  # fmt: skip
    tp_group = None
    for stage in range(info.pp):
        ranks = list(range(stage * info.tp, (stage + 1) * info.tp))
        group = dist.new_group(ranks) if info.pp > 1 else dist.group.WORLD
        if stage == info.pp_rank:
            tp_group = group
    return ParallelContext(info, tp_group if info.tp > 1 else None)
