"""The saver thread: answers held for saves go out once written, even when writes fail; a full
backlog drops saves instead of waiting."""

from __future__ import annotations

import threading

from pagedllm.kv_connector.base import KVStore, StatsBox
from pagedllm.kv_connector.worker_side import BlockSaver


class SlowStore(KVStore):
    def __init__(self, fail: bool = False):
        self.gate = threading.Event()
        self.fail = fail
        self.blocks: dict[bytes, bytes] = {}

    def get(self, block_hash):
        return None

    def contains(self, block_hash):
        return block_hash in self.blocks

    def put(self, block_hash, payload):
        self.gate.wait(10)
        if self.fail:
            raise OSError("disk full")
        self.blocks[block_hash] = bytes(payload)
        return True


def test_when_saved_waits_for_the_writes():
    store, stats = SlowStore(), StatsBox()
    saver = BlockSaver(store, stats)
    fired = threading.Event()
    saver.when_saved(fired.set)
    assert fired.is_set()  # nothing queued: at once
    fired.clear()
    assert saver.submit([(b"a", memoryview(b"xyz"))])
    saver.when_saved(fired.set)
    assert not fired.wait(0.05)
    store.gate.set()
    assert fired.wait(5) and store.blocks == {b"a": b"xyz"}
    assert saver.flush(5) and stats.total.num_saved_blocks == 1 and stats.total.num_saved_bytes == 3
    saver.close()


def test_a_failing_store_never_holds_an_answer_forever():
    store, stats = SlowStore(fail=True), StatsBox()
    store.gate.set()
    saver = BlockSaver(store, stats)
    saver.submit([(b"a", memoryview(b"xyz")), (b"b", memoryview(b"xyz"))])
    fired = threading.Event()
    saver.when_saved(fired.set)
    assert fired.wait(5)
    assert stats.total.num_dropped_saves == 2  # failed writes are counted (a full disk was silent)
    saver.close()


def test_a_full_backlog_drops_saves():
    store, stats = SlowStore(), StatsBox()
    saver = BlockSaver(store, stats, max_backlog_bytes=5)
    assert saver.submit([(b"a", memoryview(b"xyz"))])
    assert not saver.submit([(b"b", memoryview(b"xyz"))])  # 6 > 5 bytes: dropped, never waited for
    assert stats.total.num_dropped_saves == 1
    store.gate.set()
    saver.close()
    assert set(store.blocks) == {b"a"}
