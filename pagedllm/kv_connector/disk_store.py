"""The ``disk`` store: one file per block in a directory, a size cap, crash-safe writes.

Layout: ``<path>/<fingerprint id>/<2 hex>/<block hash hex>.kvb``. Each file is a header -
magic, the model fingerprint, the block hash, the payload's length and CRC-32, and the
header's own CRC-32 - then the payload (the block's bytes, see worker_side.py). A file is
written under a temporary name in the same directory, fsynced, then renamed into place: a
reader sees a whole file or none, never a torn one. A file whose header or payload does not
check out (a flipped byte, a truncated copy, another model's block under this name) is
ignored - those tokens are recomputed - and removed so a good copy can take its place.

The index is in memory: every block file under ``path`` by last use, rebuilt from the
directory (file mtimes) at startup, so LRU order survives restarts; a hit touches the
file's mtime. The directory stays the source of truth: a block another replica wrote is
found by its name even before this index knows it. Past ``max_bytes`` the least recently
used files are deleted (with replicas sharing a directory each enforces the cap on what it
knows, so the total can briefly exceed it).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import secrets
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

from pagedllm.kv_connector.base import KVStore, StatsBox
from pagedllm.kv_connector.buffers import BufferPool

logger = logging.getLogger("pagedllm.kv_connector")

MAGIC = b"PGKVBLK1"
# magic, fingerprint digest, block hash, payload length, payload CRC-32, header CRC-32
HEADER = struct.Struct("<8s32s32sQII")
SUFFIX = ".kvb"
STALE_TMP_SECONDS = 600.0  # a temporary file this old is a crashed writer's leftover
# The store's own temporary files: a block being written ("<hash>.kvb.<pid>.<hex>.tmp") and a
# writability probe (".probe-<hex>.tmp").
_OWN_TMP = re.compile(r"[0-9a-f]+" + re.escape(SUFFIX) + r"\.\d+\.[0-9a-f]+\.tmp|\.probe-[0-9a-f]{8}\.tmp")


def encode_header(fingerprint: bytes, block_hash: bytes, payload: memoryview | bytes) -> bytes:
    crc = zlib.crc32(payload)
    head = HEADER.pack(MAGIC, fingerprint, block_hash, len(payload), crc, 0)
    return head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))


def check_block_file(data: bytes, fingerprint: bytes, block_hash: bytes) -> str | None:
    """Why ``data`` is not a good block file for (fingerprint, block_hash), or None if it is."""
    if len(data) < HEADER.size:
        return "shorter than its header"
    magic, fp, h, length, crc, head_crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "bad magic"
    if zlib.crc32(data[: HEADER.size - 4]) != head_crc:
        return "header checksum mismatch"
    if fp != fingerprint:
        return "written for another model fingerprint"
    if h != block_hash:
        return "written for another block hash"
    if length != len(data) - HEADER.size:
        return f"payload is {len(data) - HEADER.size} bytes, header says {length}"
    if zlib.crc32(memoryview(data)[HEADER.size :]) != crc:
        return "payload checksum mismatch"
    return None


class DiskKVStore(KVStore):
    def __init__(self, path: str | Path, fingerprint: bytes, fingerprint_id: str, max_bytes: int,
                 stats: StatsBox | None = None, fsync: bool = True, buffers: BufferPool | None = None,
                 payload_bytes: int | None = None):  # fmt: skip
        """``payload_bytes``: every block's payload length, when known: a file of another size
        is refused before it is read."""
        self.root = Path(path)
        self.payload_bytes = payload_bytes
        self.dir = self.root / fingerprint_id
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.stats = stats or StatsBox()
        self.fsync = fsync
        self.buffers = buffers or BufferPool()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_transfer_config.path {str(path)!r} is not a writable directory: {e}") from None
        self._lock = threading.Lock()
        # file path -> (size, mtime as this process last knew it), least recently used first
        self._index: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.total_bytes = 0
        self._scan()

    def check_writable(self) -> None:
        """A saver's store must take files: found at startup, not as a dropped save per block
        (a directory can exist yet be read-only, or sit on a read-only mount)."""
        probe = self.dir / f".probe-{secrets.token_hex(4)}.tmp"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"kv_transfer_config.path {str(self.root)!r} is not a writable directory "
                             f"(this kv_role saves blocks there): {e}") from None

    # ------------------------------------------------------------------ index
    def _scan(self) -> None:
        """Index every block file under the root (all fingerprints share the cap) by mtime;
        delete crashed writers' temporary files."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                if name.endswith(SUFFIX):
                    found.append((st.st_mtime, full, st.st_size))
                elif _OWN_TMP.fullmatch(name) and now - st.st_mtime > STALE_TMP_SECONDS:
                    # (only the store's own: the root may be a shared folder with others' .tmp files)
                    _unlink(full)
        found.sort()
        for mtime, full, size in found:
            self._index[full] = (size, mtime)
            self.total_bytes += size
        if found:
            logger.info("KV store %s: %d block files, %.1f MiB (cap %.1f MiB)", self.root, len(found),
                        self.total_bytes / (1 << 20), self.max_bytes / (1 << 20))  # fmt: skip

    def _remember(self, path: str, size: int) -> None:
        """``path`` (``size`` bytes) was just written or read: the most recent. Over the cap, the
        least recent files go. This process knows only its own reads and writes; another
        process's read touches the file's mtime, so an entry whose file is newer than the index
        says is put back where that mtime places it, among the entries still to compare (the
        producer's own order alone evicted the hottest prefix first, since it was written first;
        and putting read files back behind the block just written evicted that block, unread)."""
        now = time.time()
        with self._lock:
            old = self._index.pop(path, None)
            self.total_bytes += size - (old[0] if old else 0)
            self._index[path] = (size, now)
            victims: list[str] = []
            moved: list[tuple[float, str, int]] = []  # (real mtime, path, size), oldest first
            while self.total_bytes > self.max_bytes and (self._index or moved):
                head = next(iter(self._index.items()), None)
                if moved and (head is None or moved[0][0] <= head[1][1]):
                    _, victim, vsize = moved.pop(0)
                else:
                    victim, (vsize, seen) = self._index.popitem(last=False)
                    used = _mtime(victim) if victim != path else None
                    if used is not None and used > seen:
                        bisect.insort(moved, (min(used, now), victim, vsize))
                        continue
                self.total_bytes -= vsize
                victims.append(victim)
            if moved:  # the survivors go back just before the file just written (its mtime is
                # the newest), oldest first: O(moved), where a full re-sort would be O(files)
                last = self._index.pop(path, None)
                for used, p, sz in moved:
                    self._index[p] = (sz, used)
                if last is not None:
                    self._index[path] = last
        for victim in victims:
            _unlink(victim)

    def _forget(self, path: str) -> None:
        with self._lock:
            entry = self._index.pop(path, None)
            if entry is not None:
                self.total_bytes -= entry[0]

    def path_of(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    @property
    def num_files(self) -> int:
        return len(self._index)

    # ------------------------------------------------------------------ KVStore
    def contains(self, block_hash: bytes) -> bool:
        """Whether the block's file exists now (one stat): the index may still list a file that
        another process evicted or someone deleted, which must then be saved again."""
        path = self.path_of(block_hash)
        if path.exists():
            return True
        self._forget(str(path))
        return False

    def get(self, block_hash: bytes) -> memoryview | None:
        path = self.path_of(block_hash)
        key = str(path)
        data, problem = None, None
        try:
            # O_NONBLOCK: a FIFO planted under a block's name would block the open forever.
            with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    problem = "not a regular file"
                elif self.payload_bytes is not None and st.st_size != HEADER.size + self.payload_bytes:
                    problem = f"{st.st_size} bytes, where a block file has {HEADER.size + self.payload_bytes}"
                else:
                    size = st.st_size
                    data = self.buffers.take(size)
                    n = f.readinto(data)
                    if n != size:  # shrank while we read: a torn view, never used
                        data = data[:n]
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            logger.warning("KV store: cannot read %s: %s", path, e)
            return None
        if problem is None:
            problem = check_block_file(data, self.fingerprint, block_hash)
        if problem is not None:
            if data is not None:
                self.buffers.give(data)
            logger.warning("KV store: ignoring %s (%s); its tokens are recomputed", path, problem)
            self.stats.update(num_rejected_blocks=1)
            self._forget(key)
            _unlink(key)
            return None
        try:
            os.utime(path)  # recency for LRU, visible to replicas and after a restart
        except OSError:
            pass
        self._remember(key, len(data))
        return memoryview(data)[HEADER.size :]

    def release(self, payload: memoryview) -> None:
        self.buffers.give_view(payload)

    def put(self, block_hash: bytes, payload: memoryview) -> bool:
        path = self.path_of(block_hash)
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        header = encode_header(self.fingerprint, block_hash, payload)
        try:
            f = open(tmp, "xb")  # (nothing to clean up if this fails, e.g. on a read-only disk)
        except FileExistsError:
            return False
        try:
            with f:
                f.write(header)
                f.write(payload)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the whole file or none
        except BaseException:
            _unlink(str(tmp))
            raise
        self._remember(str(path), len(header) + len(payload))
        return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("KV store: cannot delete %s: %s", path, e)


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None
