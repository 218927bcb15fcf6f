"""Build a connector from ``kv_transfer_config``: the store, and the two sides sharing it."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

from pagedllm.config import KVTransferConfig
from pagedllm.kv_connector.base import KVConnectorStats, KVStore, StatsBox
from pagedllm.kv_connector.disk_store import DiskKVStore
from pagedllm.kv_connector.fingerprint import ModelFingerprint
from pagedllm.kv_connector.scheduler_side import SchedulerConnector
from pagedllm.kv_connector.worker_side import BlockSaver, WorkerConnector

logger = logging.getLogger("pagedllm.kv_connector")


@dataclass
class KVConnector:
    """The connector of one engine: its scheduler side, its worker side, their store."""

    config: KVTransferConfig
    fingerprint: ModelFingerprint
    store: KVStore
    stats: StatsBox
    scheduler: SchedulerConnector
    worker: WorkerConnector
    saver: BlockSaver | None
    # Closes the saver and store if this connector is dropped, or the process exits, unclosed.
    on_drop: weakref.finalize | None = field(default=None, repr=False, compare=False)

    def take_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    def when_saved(self, callback) -> None:
        """Run ``callback`` once every save queued so far is in the store (now, without saves)."""
        if self.saver is None:
            callback()
        else:
            self.saver.when_saved(callback)

    def flush(self, timeout: float | None = None) -> bool:
        return self.saver.flush(timeout) if self.saver is not None else True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout``), stop the saver thread."""
        if self.on_drop is not None:
            self.on_drop.detach()
        _close(self.saver, self.store, timeout)
        self.saver = None
        self.worker.saver = None


def _close(saver: BlockSaver | None, store: KVStore, timeout: float = 30.0) -> None:
    if saver is not None:
        saver.close(timeout)
    store.close()


def make_kv_connector(config: KVTransferConfig, fingerprint: ModelFingerprint, block_size: int, block_bytes: int) -> KVConnector:
    """``block_bytes``: one block's payload (every block-indexed KV tensor's bytes of one block)."""
    stats = StatsBox()
    if config.kv_connector != "disk":  # KVTransferConfig validated the name
        raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} is unknown")
    store = DiskKVStore(config.path, fingerprint.digest, fingerprint.id, config.max_bytes, stats,
                        payload_bytes=block_bytes)  # fmt: skip
    if config.saves:
        store.check_writable()
    saver = BlockSaver(store, stats) if config.saves else None
    scheduler = SchedulerConnector(store, config, block_size, block_bytes, stats, saver.is_pending if saver else None)
    connector = KVConnector(config, fingerprint, store, stats, scheduler, WorkerConnector(saver, stats, store), saver)
    # An engine dropped, or an offline run ended, without close() still writes what it queued
    # and stops its saver thread (which holds the saver and store, not the connector).
    connector.on_drop = weakref.finalize(connector, _close, saver, store)
    logger.info("KV connector: %s, role %s, store %s (fingerprint %s, cap %.1f GiB)", config.kv_connector,
                config.kv_role, store.dir, fingerprint.id, config.max_bytes / (1 << 30))  # fmt: skip
    return connector
