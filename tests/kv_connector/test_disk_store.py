"""The disk store: round trip, crash-safe files, corruption and foreign files ignored, LRU cap."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pagedllm.kv_connector.base import StatsBox
from pagedllm.kv_connector.disk_store import HEADER, DiskKVStore

FP = b"\x01" * 32
OTHER_FP = b"\x02" * 32


def payload(i: int, n: int = 1000) -> memoryview:
    return memoryview(np.full(n, i % 251, dtype=np.uint8))


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def store(path, fp=FP, max_bytes=1 << 30, stats=None) -> DiskKVStore:
    return DiskKVStore(path, fp, fp.hex()[:8], max_bytes, stats or StatsBox())


def test_round_trip_and_a_second_instance_sees_it(tmp_path):
    s = store(tmp_path)
    assert s.get(h(1)) is None and not s.contains(h(1))
    assert s.put(h(1), payload(1))
    assert not s.put(h(1), payload(1))  # already there
    assert bytes(s.get(h(1))) == bytes(payload(1))
    again = store(tmp_path)  # a restart, or a replica on the same directory
    assert again.num_files == 1 and again.total_bytes == HEADER.size + 1000
    assert bytes(again.get(h(1))) == bytes(payload(1))


def test_a_replica_finds_blocks_written_after_it_started(tmp_path):
    a, b = store(tmp_path), store(tmp_path)
    a.put(h(5), payload(5))
    assert b.contains(h(5)) and bytes(b.get(h(5))) == bytes(payload(5))


@pytest.mark.parametrize("where", ["payload", "header", "truncated"])
def test_a_damaged_file_is_ignored_and_removed(tmp_path, where):
    stats = StatsBox()
    s = store(tmp_path, stats=stats)
    s.put(h(2), payload(2))
    path = s.path_of(h(2))
    data = bytearray(path.read_bytes())
    if where == "payload":
        data[HEADER.size + 500] ^= 0x10
    elif where == "header":
        data[20] ^= 0x01
    else:
        data = data[: HEADER.size + 10]
    path.write_bytes(bytes(data))
    assert s.get(h(2)) is None
    assert stats.total.num_rejected_blocks == 1
    assert not path.exists()  # so a good copy can be saved again
    assert s.put(h(2), payload(2)) and s.get(h(2)) is not None


def test_a_fifo_or_an_odd_sized_file_is_refused_unread(tmp_path):
    """A named pipe under a block's name used to block the open, and the engine with it, for
    good (found by an adversarial session); a file of the wrong size is refused before its
    bytes are read."""
    stats = StatsBox()
    s = DiskKVStore(tmp_path, FP, FP.hex()[:8], 1 << 30, stats, payload_bytes=1000)
    for i in (3, 4):
        s.put(h(i), payload(i))
    os.unlink(s.path_of(h(3)))
    os.mkfifo(s.path_of(h(3)))
    with open(s.path_of(h(4)), "ab") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte that must not be read
    assert s.get(h(3)) is None and s.get(h(4)) is None
    assert stats.total.num_rejected_blocks == 2
    assert not s.path_of(h(3)).exists() and not s.path_of(h(4)).exists()
    assert s.put(h(3), payload(3)) and bytes(s.get(h(3))) == bytes(payload(3))


def test_another_models_file_under_this_name_is_ignored(tmp_path):
    theirs = store(tmp_path, fp=OTHER_FP)
    theirs.put(h(3), payload(3))
    stats = StatsBox()
    mine = store(tmp_path, stats=stats)
    assert mine.get(h(3)) is None  # other directory: never even looked at
    os.makedirs(mine.path_of(h(3)).parent, exist_ok=True)
    os.replace(theirs.path_of(h(3)), mine.path_of(h(3)))  # planted under our name
    assert mine.get(h(3)) is None and stats.total.num_rejected_blocks == 1
    # and a file of another block under this block's name
    mine.put(h(4), payload(4))
    os.replace(mine.path_of(h(4)), mine.path_of(h(6)))
    assert mine.get(h(6)) is None and stats.total.num_rejected_blocks == 2


def test_temporary_files_are_never_read_and_stale_ones_are_cleaned(tmp_path):
    s = store(tmp_path)
    final = s.path_of(h(7))
    final.parent.mkdir(parents=True, exist_ok=True)
    torn = final.with_name(final.name + ".123.abcd.tmp")
    torn.write_bytes(b"half a block")  # a writer that crashed before its rename
    assert s.get(h(7)) is None and not s.contains(h(7))
    old = time.time() - 3600
    # Others' temporary files in a shared root are not the store's to delete (they were).
    foreign = [tmp_path / "notes.tmp", tmp_path / "someone" / "download.tmp", final.parent / "x.kvb.1.ab.tmp"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("not ours")
    for f in [torn, *foreign]:
        os.utime(f, (old, old))
    fresh = final.with_name(final.name + ".456.ef01.tmp")
    fresh.write_bytes(b"being written")  # another replica's save in flight: not stale yet
    store(tmp_path)  # a restart cleans it up
    assert not torn.exists() and all(f.exists() for f in foreign) and fresh.exists()


def test_lru_eviction_under_the_cap(tmp_path):
    size = HEADER.size + 1000
    s = store(tmp_path, max_bytes=3 * size)
    for i in range(3):
        s.put(h(i), payload(i))
    assert s.get(h(0)) is not None  # 0 is now the most recently used
    s.put(h(3), payload(3))  # over the cap: 1 goes (least recently used)
    assert s.total_bytes == 3 * size and s.num_files == 3
    assert s.contains(h(0)) and not s.contains(h(1)) and s.contains(h(2)) and s.contains(h(3))


def test_a_file_deleted_behind_the_stores_back_leaves_its_books(tmp_path):
    """contains() finding a listed file gone (another process evicted it, someone deleted it)
    drops it from the index: its bytes no longer count against the cap, which would otherwise
    evict live blocks early."""
    size = HEADER.size + 1000
    s = store(tmp_path, max_bytes=2 * size)
    s.put(h(1), payload(1))
    s.put(h(2), payload(2))
    s.path_of(h(1)).unlink()
    assert not s.contains(h(1)) and s.num_files == 1 and s.total_bytes == size
    s.put(h(3), payload(3))  # fits beside 2: nothing evicted
    assert s.contains(h(2)) and s.contains(h(3))


def test_eviction_counts_another_processs_reads(tmp_path):
    """A consumer's hits touch the files; the producer evicted by its own write order anyway, so
    the hottest prefix - written first - went first (found by a review)."""
    size = HEADER.size + 1000
    producer, consumer = store(tmp_path, max_bytes=3 * size), store(tmp_path)
    for i in range(3):
        producer.put(h(i), payload(i))
    time.sleep(0.01)
    assert consumer.get(h(0)) is not None  # another process reads 0: now the most recently used
    producer.put(h(3), payload(3))
    assert producer.contains(h(0)) and not producer.contains(h(1))
    assert producer.total_bytes == 3 * size and producer.num_files == 3


def test_blocks_a_consumer_read_never_push_out_the_block_just_written(tmp_path):
    """Disaggregated serving: the consumer reads every block the producer writes. The second
    chance for read files once put them all behind the new block, so the new block was the
    one evicted, before anyone could read it (found by a review)."""
    size = HEADER.size + 1000
    producer, consumer = store(tmp_path, max_bytes=3 * size), store(tmp_path)
    for i in range(8):
        producer.put(h(i), payload(i))
        time.sleep(0.01)
        assert consumer.get(h(i)) is not None, f"block {i} was evicted as it was written"
        time.sleep(0.01)
        assert producer.num_files == min(i + 1, 3)
    # LRU among the read files: the three most recently read stay.
    assert [producer.contains(h(i)) for i in range(8)] == [False] * 5 + [True] * 3


def test_lru_order_survives_a_restart(tmp_path):
    size = HEADER.size + 1000
    s = store(tmp_path, max_bytes=3 * size)
    for i in range(3):
        s.put(h(i), payload(i))
        t = time.time() - 100 + i
        os.utime(s.path_of(h(i)), (t, t))
    restarted = store(tmp_path, max_bytes=3 * size)
    assert restarted.get(h(0)) is not None  # touches 0
    restarted.put(h(3), payload(3))
    assert restarted.contains(h(0)) and not restarted.contains(h(1))


def test_an_unwritable_path_is_a_value_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_transfer_config.path"):
        store(blocker / "sub")


def test_a_saver_refuses_an_existing_directory_it_cannot_write(tmp_path, monkeypatch):
    """A directory that exists but takes no files (read-only mode or mount; root ignores the
    mode bits, so the failure is injected) is refused at startup, not found save by save."""
    s = store(tmp_path)
    s.check_writable()  # writable: nothing left behind
    assert not [p for p in s.dir.iterdir() if p.name.startswith(".probe")]

    def refuse(self, data):
        raise PermissionError(13, "Read-only file system", str(self))

    monkeypatch.setattr(type(s.dir), "write_bytes", refuse)
    with pytest.raises(ValueError, match="kv_transfer_config.path .* is not a writable directory"):
        s.check_writable()


def test_payload_buffers_are_reused(tmp_path):
    from pagedllm.kv_connector.buffers import BufferPool

    s = DiskKVStore(tmp_path, FP, "fp", 1 << 30, buffers=BufferPool(max_cached_bytes=2 * (HEADER.size + 1000)))
    for i in range(3):
        s.put(h(i), payload(i))
    first = s.get(h(0))
    under = first.obj
    s.release(first)
    second = s.get(h(1))
    assert second.obj is under and bytes(second) == bytes(payload(1))  # the same memory, new contents
    views = [s.get(h(i)) for i in range(3)]
    for v in views:
        s.release(v)
    assert s.buffers._cached == 2 * (HEADER.size + 1000)  # the cap: the third is let go
