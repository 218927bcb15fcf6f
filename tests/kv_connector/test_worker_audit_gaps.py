"""The connector's worker side, buffer pool, weights digest and factory, unit by unit: what a
mutation audit (2026-12) found the engine-level tests did not pin down."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from pagedllm.kv_connector.base import BlockSave, KVConnectorMetadata, KVStore, RequestLoad, StatsBox
from pagedllm.kv_connector.buffers import BufferPool
from pagedllm.kv_connector.fingerprint import weights_digest
from pagedllm.kv_connector.worker_side import BlockSaver, WorkerConnector, block_layout, block_views
from tests.kv_connector.test_saver import SlowStore


class CountingStore(KVStore):
    """put() waits for one ``permits`` release per block; records releases."""

    def __init__(self, delay: float = 0.0):
        self.permits = threading.Semaphore(0)
        self.gated = delay == 0.0
        self.delay = delay
        self.blocks: dict[bytes, bytes] = {}
        self.released: list = []

    def get(self, block_hash):
        return None

    def contains(self, block_hash):
        return block_hash in self.blocks

    def put(self, block_hash, payload):
        if self.gated:
            assert self.permits.acquire(timeout=10)
        else:
            time.sleep(self.delay)
        self.blocks[block_hash] = bytes(payload)
        return True

    def release(self, payload):
        self.released.append(payload)


class RecordingPool(BufferPool):
    def __init__(self):
        super().__init__()
        self.given: list = []

    def give(self, buf):
        self.given.append(buf)
        super().give(buf)


def kv_tensors(num_blocks: int = 6):
    """Two block-indexed tensors of different widths and dtypes (keys fp32, a scale fp16)."""
    torch.manual_seed(0)
    return [torch.randn(num_blocks, 2, 4, 3), torch.randn(num_blocks, 5).to(torch.float16)]


def payload_of(tensors, block_id: int) -> bytes:
    return b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


# ---------------------------------------------------------------- layout

def test_block_views_and_layout():
    a, b = kv_tensors()
    views = block_views([a, b])
    assert [tuple(v.shape) for v in views] == [(6, 2 * 4 * 3 * 4), (6, 5 * 2)] and views[0].dtype == torch.uint8
    assert views[0].data_ptr() == a.data_ptr()  # a view, no copy
    assert block_layout([a, b]) == "float32[2, 4, 3];float16[5]"  # every dim past the block index
    with pytest.raises(ValueError, match="contiguous"):
        block_views([a.transpose(1, 2)])


# ---------------------------------------------------------------- saver

def test_a_backlog_exactly_at_the_cap_is_accepted_and_drops_count_every_block():
    store, stats = SlowStore(), StatsBox()
    saver = BlockSaver(store, stats, max_backlog_bytes=6)
    assert saver.submit([(b"a", memoryview(b"xyz")), (b"b", memoryview(b"xyz"))])  # 6 <= 6
    assert not saver.submit([(b"c", memoryview(b"x")), (b"d", memoryview(b"y"))])
    assert stats.total.num_dropped_saves == 2  # one per block, not per batch
    store.gate.set()
    saver.close()


def test_the_backlog_shrinks_once_written():
    store, stats = SlowStore(), StatsBox()
    store.gate.set()
    saver = BlockSaver(store, stats, max_backlog_bytes=5)
    for h in (b"a", b"b", b"c"):
        assert saver.submit([(h, memoryview(b"xyz"))]) and saver.flush(5)
    assert set(store.blocks) == {b"a", b"b", b"c"} and stats.total.num_dropped_saves == 0
    saver.close()


def test_a_block_queued_twice_stays_pending_until_both_are_written():
    store, stats = CountingStore(), StatsBox()
    saver = BlockSaver(store, stats)
    first_done = threading.Event()
    saver.submit([(b"h", memoryview(b"12"))])
    saver.when_saved(first_done.set)
    saver.submit([(b"h", memoryview(b"12"))])  # a second request filled the same block
    store.permits.release()
    assert first_done.wait(5)
    assert saver.is_pending(b"h")  # the second copy is still queued
    store.permits.release()
    assert saver.flush(5) and not saver.is_pending(b"h")
    saver.close()


def test_a_written_batch_hands_its_buffer_back_to_the_pool():
    store, stats = SlowStore(), StatsBox()
    store.gate.set()
    saver = BlockSaver(store, stats)
    pool, buf = BufferPool(), bytearray(b"abcdef")
    saver.submit([(b"a", memoryview(buf)[:3]), (b"b", memoryview(buf)[3:])], buf, pool)
    assert saver.flush(5) and store.blocks == {b"a": b"abc", b"b": b"def"}
    assert pool.take(6) is buf
    saver.close()


def test_close_writes_the_whole_queue_and_stops_the_thread():
    store, stats = CountingStore(delay=0.7), StatsBox()
    saver = BlockSaver(store, stats)
    saver.submit([(b"a", memoryview(b"x")), (b"b", memoryview(b"y"))])  # ~1.4 s of writes
    saver.close()
    assert set(store.blocks) == {b"a", b"b"}
    assert not saver._thread.is_alive()


# ---------------------------------------------------------------- worker: load / save

def test_load_copies_payloads_in_and_releases_them():
    src, dst = kv_tensors(), [torch.zeros(6, 2, 4, 3), torch.zeros(6, 5, dtype=torch.float16)]
    store, stats = CountingStore(), StatsBox()
    worker = WorkerConnector(None, stats, store)
    payloads = [payload_of(src, 1), payload_of(src, 4)]
    rl = RequestLoad("r", [3, 0], list(payloads), read_seconds=0.25)
    worker.load(KVConnectorMetadata(loads=[rl]), dst)
    for t_src, t_dst in zip(src, dst):
        assert torch.equal(t_dst[3], t_src[1]) and torch.equal(t_dst[0], t_src[4])
        assert not t_dst[[1, 2, 4, 5]].any()
    assert store.released == payloads and rl.payloads == []  # back to the store's buffers, not held
    width = len(payloads[0])
    assert stats.total.num_loaded_blocks == 2 and stats.total.num_loaded_bytes == 2 * width
    (seconds,) = stats.take().load_seconds
    assert seconds >= 0.25  # the read's time counts


def test_load_refuses_a_payload_of_the_wrong_size():
    dst = kv_tensors()
    before = [t.clone() for t in dst]
    width = len(payload_of(dst, 0))
    rl = RequestLoad("r", [2], [b"\0" * (width - 1)])
    with pytest.raises(ValueError, match=f"not {width} bytes"):
        WorkerConnector(None, StatsBox(), CountingStore()).load(KVConnectorMetadata(loads=[rl]), dst)
    assert all(torch.equal(a, b) for a, b in zip(before, dst))


def test_save_copies_out_only_the_given_requests_blocks():
    tensors = kv_tensors()
    store, stats = SlowStore(), StatsBox()
    store.gate.set()
    saver = BlockSaver(store, stats)
    worker = WorkerConnector(saver, stats, store)
    meta = KVConnectorMetadata(saves=[BlockSave("a", 2, b"h2"), BlockSave("b", 5, b"h5"), BlockSave("a", 0, b"h0")])
    worker.save(meta, ["a"], tensors)  # b's block is not written yet this step
    assert saver.flush(5)
    assert store.blocks == {b"h2": payload_of(tensors, 2), b"h0": payload_of(tensors, 0)}
    worker.save(meta, ["c"], tensors)  # none of these requests: nothing
    assert saver.flush(5) and len(store.blocks) == 2
    saver.close()


def test_a_dropped_save_gives_its_buffer_back():
    store, stats = SlowStore(), StatsBox()
    saver = BlockSaver(store, stats, max_backlog_bytes=1)
    pool = RecordingPool()
    worker = WorkerConnector(saver, stats, store, pool)
    worker.save(KVConnectorMetadata(saves=[BlockSave("a", 1, b"h1")]), ["a"], kv_tensors())
    assert stats.total.num_dropped_saves == 1 and len(pool.given) == 1
    store.gate.set()
    saver.close()


# ---------------------------------------------------------------- buffer pool

def test_a_taken_buffer_frees_its_room_in_the_pool():
    pool = BufferPool(max_cached_bytes=8)
    a, b, c = bytearray(4), bytearray(4), bytearray(4)
    pool.give(a)
    pool.give(b)
    pool.take(4)
    pool.give(c)  # room again: one of the two was taken
    assert {id(pool.take(4)), id(pool.take(4))} >= {id(c)}


def test_give_view_keeps_only_bytearrays():
    pool = BufferPool()
    pool.give_view(memoryview(b"xyz"))  # bytes cannot be written into: never handed out again
    pool.give_view(b"xyz")  # not a view: no-op
    got = pool.take(3)
    assert isinstance(got, bytearray)
    got[0] = 1
    buf = bytearray(3)
    pool.give_view(memoryview(buf)[1:])
    assert pool.take(3) is buf


# ---------------------------------------------------------------- weights digest

def test_the_directory_digest_covers_the_config_and_whole_big_files(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    big = bytearray(3 << 20)
    (d / "model.safetensors").write_bytes(big)
    (d / "nested.json").mkdir()  # a directory with a weights-like name is skipped, not opened
    (d / "README.md").write_text("x")
    first = weights_digest(d)
    (d / "README.md").write_text("y")  # not a config or weights file
    assert weights_digest(d) == first
    (d / "config.json").write_text('{"a": 2}')
    second = weights_digest(d)
    assert second != first
    big[(2 << 20) + 5] = 1  # past the first read chunk
    (d / "model.safetensors").write_bytes(big)
    assert weights_digest(d) != second


def test_the_digest_cache_is_written_and_a_bad_one_is_ignored(tmp_path):
    w = tmp_path / "w.gguf"
    w.write_bytes(b"weights")
    want = weights_digest(w)
    cache = tmp_path / "c" / "digests.json"
    assert weights_digest(w, cache) == want
    assert list(json.loads(cache.read_text()).values()) == [want]  # remembered
    cache.write_text(json.dumps({k: 123 for k in json.loads(cache.read_text())}))  # a non-string entry
    assert weights_digest(w, cache) == want
    for garbage in ("{not json", "[1, 2]"):
        cache.write_text(garbage)
        assert weights_digest(w, cache) == want


# ---------------------------------------------------------------- factory

def _connector(tmp_path, role: str):
    from pagedllm.config import KVTransferConfig
    from pagedllm.kv_connector.factory import make_kv_connector
    from pagedllm.kv_connector.fingerprint import ModelFingerprint

    fp = ModelFingerprint("w", "float32", "auto", 16, "float32[4]")
    return make_kv_connector(KVTransferConfig(kv_role=role, path=str(tmp_path / "store")), fp, 16, 16)


def test_factory_checks_writability_only_for_saving_roles(tmp_path, monkeypatch):
    from pagedllm.kv_connector.disk_store import DiskKVStore

    checked = []
    monkeypatch.setattr(DiskKVStore, "check_writable", lambda self: checked.append(self.root))
    for role, want in [("kv_consumer", 0), ("kv_producer", 1), ("kv_both", 2)]:
        _connector(tmp_path, role).close()
        assert len(checked) == want, role


def test_a_closed_connector_has_no_saver_left_and_a_loader_answers_at_once(tmp_path):
    consumer = _connector(tmp_path, "kv_consumer")
    fired = []
    consumer.when_saved(lambda: fired.append(1))  # nothing is ever saved: at once
    assert fired == [1] and consumer.flush(0) is True
    consumer.close()
    both = _connector(tmp_path, "kv_both")
    saver = both.saver
    both.close()
    assert both.saver is None and both.worker.saver is None  # a later save is a no-op, not a queue nobody drains
    assert not both.on_drop.alive and not saver._thread.is_alive()


def test_close_passes_its_timeout_to_the_saver(tmp_path):
    from pagedllm.kv_connector.factory import _close

    seen = []

    class FakeSaver:
        def close(self, timeout):
            seen.append(timeout)

    _close(FakeSaver(), CountingStore(), 7.5)
    assert seen == [7.5]
