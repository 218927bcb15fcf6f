"""How many cores a data-parallel replica uses, and which ones when pinned.

Replicas that each use every core only contend for them: on a 2-core machine DP=2 means one
core per replica. ``PAGEDLLM_NUM_THREADS``, when set, is each replica's own thread count.
With ``PAGEDLLM_PIN_THREADS=1`` replica r is pinned to its own slice of the usable cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedllm.envs import env_flag

PIN_ENV = "PAGEDLLM_PIN_THREADS"
THREADS_ENV = "PAGEDLLM_NUM_THREADS"


@dataclass(frozen=True)
class CpuShare:
    num_threads: int
    cpus: tuple[int, ...] | None  # None: not pinned


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def replica_cpu_share(rank: int, size: int, cpus: list[int], num_threads: int | None = None, pin: bool = False) -> CpuShare:
    """Replica ``rank`` of ``size``: ``num_threads`` (else its share of ``cpus``, at least one) and,
    if ``pin``, that many cores of its own slice (wrapping round when there are more replicas
    than cores)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    n = num_threads if num_threads is not None else max(1, len(cpus) // size)
    if n < 1:
        raise ValueError(f"{THREADS_ENV} must be at least 1, got {n}")
    if not pin:
        return CpuShare(n, None)
    per = max(1, len(cpus) // size)
    start = (rank * per) % len(cpus)
    return CpuShare(n, tuple(cpus[(start + k) % len(cpus)] for k in range(per)))


def share_from_env(rank: int, size: int) -> CpuShare:
    env = os.environ.get(THREADS_ENV)
    try:
        threads = int(env) if env else None
    except ValueError as e:
        raise ValueError(f"{THREADS_ENV} must be an integer, got {env!r}") from e
    pin = env_flag(PIN_ENV, False)
    return replica_cpu_share(rank, size, usable_cpus(), threads, pin)
