"""The connector's contracts: the store interface, the step's plain-data metadata, the stats."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields


class KVStore(ABC):
    """Where block payloads live, keyed by a block's chained content hash.

    A store is bound to one model fingerprint (fingerprint.py): a payload it returns was
    written for that fingerprint and that hash, and its bytes are intact - anything else
    (torn, corrupt, another model's) reads as a miss. ``put`` runs on the saver thread and
    ``get``/``contains`` on the engine's, so implementations must be thread-safe.
    """

    @abstractmethod
    def get(self, block_hash: bytes) -> bytes | None:
        """The verified payload of ``block_hash``, or None."""

    @abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """Cheap existence check (no verification): whether a save would be redundant."""

    @abstractmethod
    def put(self, block_hash: bytes, payload: memoryview) -> bool:
        """Store a payload durably; False when it was already there."""

    def release(self, payload: memoryview) -> None:
        """``get``'s payload is no longer used (its buffer may be reused)."""

    def close(self) -> None:
        """Release resources (the saver thread is drained before)."""


@dataclass(slots=True)
class RequestLoad:
    """Blocks of one request to fill from the store before the forward: ``payloads[i]`` goes
    to ``block_ids[i]``. ``read_seconds``: what reading and verifying them took."""

    req_id: str
    block_ids: list[int]
    payloads: list[bytes]
    read_seconds: float = 0.0


@dataclass(slots=True)
class BlockSave:
    """A block that is full of verified tokens after this step: copy it out under its hash."""

    req_id: str
    block_id: int
    block_hash: bytes


@dataclass
class KVConnectorMetadata:
    """The connector's part of a step (in ``SchedulerOutput.kv_connector_metadata``)."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class KVConnectorStats:
    """Counters since the last ``take`` (the engine passes them on with each step's stats)."""

    num_queried_blocks: int = 0  # blocks looked up in the store (beyond the local prefix cache)
    num_hit_blocks: int = 0  # of those, found and verified
    num_rejected_blocks: int = 0  # found but torn, corrupt or another model's: ignored, recomputed
    num_loaded_blocks: int = 0  # copied into the KV pool
    num_loaded_bytes: int = 0
    num_saved_blocks: int = 0  # written to the store
    num_saved_bytes: int = 0
    num_dropped_saves: int = 0  # not saved: the saver's backlog was full (the step never waits), or the write failed
    load_seconds: list[float] = field(default_factory=list)  # per request: read + verify + copy in

    def add(self, other: "KVConnectorStats") -> None:
        for f in fields(self):
            if f.name == "load_seconds":
                self.load_seconds.extend(other.load_seconds)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0


class StatsBox:
    """Counters shared by the engine thread and the saver thread, taken as a delta."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVConnectorStats()
        self.total = KVConnectorStats()  # since the start (tests, the shutdown log line)

    def update(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)
                setattr(self.total, name, getattr(self.total, name) + value)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self._stats.load_seconds.append(seconds)  # (not in total: it would grow without end)

    def take(self) -> KVConnectorStats | None:
        """The counters since the last call, or None when nothing happened."""
        with self._lock:
            stats, self._stats = self._stats, KVConnectorStats()
        return stats if stats != KVConnectorStats() else None
