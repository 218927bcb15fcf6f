"""The connector's worker side: payloads into the KV pool before the forward, newly full
blocks out of it after, written to the store by a background thread.

A block's payload is its bytes in every block-indexed KV tensor of the runner (keys and
values of every layer slot, and their scales when the cache is quantized), in the runner's
order, concatenated; the fingerprint's ``block_layout`` names that order and those shapes.

Saving never stalls the step: the runner's thread only copies the blocks' bytes out (one
gather per tensor) and queues them; the thread does the file work. A backlog past
``max_backlog_bytes`` drops new saves (counted) rather than wait or grow without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from pagedllm.kv_connector.base import KVConnectorMetadata, KVStore, StatsBox
from pagedllm.kv_connector.buffers import BufferPool

logger = logging.getLogger("pagedllm.kv_connector")

DEFAULT_MAX_BACKLOG_BYTES = 1 << 30


def block_views(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each block-indexed tensor as [num_blocks, bytes per block] uint8 (a view: no copy)."""
    views = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("KV connector: the KV tensors must be contiguous")
        views.append(t.view(torch.uint8).view(t.shape[0], -1))
    return views


def block_layout(tensors: Sequence[torch.Tensor]) -> str:
    """The payload's parts, for the fingerprint."""
    return ";".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape[1:])}" for t in tensors)


class BlockSaver:
    """A thread writing queued (hash, payload) pairs to the store, in order."""

    def __init__(self, store: KVStore, stats: StatsBox, max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES):
        self.store = store
        self.stats = stats
        self.max_backlog_bytes = max_backlog_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._backlog = 0
        self._queued = 0  # sequence number of the last batch queued
        self._done = 0  # ... and of the last one written
        self._waiters: list[tuple[int, Callable[[], None]]] = []
        # Hashes queued and not yet written (a count each: two requests may queue one block).
        self._pending: dict[bytes, int] = {}
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-saver", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[bytes, memoryview]], buffer: bytearray | None = None, pool: BufferPool | None = None) -> bool:
        """Queue payloads (views the caller no longer writes to); once written, ``buffer`` (under
        them all) goes back to ``pool``. False when the backlog is full (nothing queued)."""
        nbytes = sum(len(p) for _, p in items)
        with self._cond:
            if self._backlog + nbytes > self.max_backlog_bytes:
                self.stats.update(num_dropped_saves=len(items))
                return False
            self._backlog += nbytes
            self._queued += 1
            seq = self._queued
            for block_hash, _ in items:
                self._pending[block_hash] = self._pending.get(block_hash, 0) + 1
        self._queue.put((seq, (items, buffer, pool), nbytes))
        return True

    def is_pending(self, block_hash: bytes) -> bool:
        """Whether the block is queued and not yet written: the scheduler must not queue it
        again just because its file does not exist yet."""
        with self._cond:
            return block_hash in self._pending

    def when_saved(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the saver thread, or now) once everything queued so far is written."""
        with self._cond:
            if self._done >= self._queued:
                ready = True
            else:
                ready = False
                self._waiters.append((self._queued, callback))
        if ready:
            callback()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def _run(self) -> None:
        while True:
            seq, batch, nbytes = self._queue.get()
            if seq is None:
                return
            items, buffer, pool = batch
            hashes = [block_hash for block_hash, _ in items]
            saved = saved_bytes = failed = 0
            try:
                for block_hash, payload in items:
                    try:
                        if self.store.put(block_hash, payload):
                            saved += 1
                            saved_bytes += len(payload)
                    except Exception as e:  # a full disk must not take the engine down
                        if not failed:  # one line a batch, not one a block
                            logger.warning("KV store: saving a block failed: %s: %s", type(e).__name__, e)
                        failed += 1
                del items
                if buffer is not None and pool is not None:
                    pool.give(buffer)
                self.stats.update(num_saved_blocks=saved, num_saved_bytes=saved_bytes, num_dropped_saves=failed)
            except BaseException:  # whatever happens, the batch counts as done: held answers go out
                logger.exception("KV saver: a batch failed")
            with self._cond:
                self._backlog -= nbytes
                self._done = seq
                for block_hash in hashes:
                    left = self._pending.pop(block_hash) - 1
                    if left:
                        self._pending[block_hash] = left
                ready = [cb for s, cb in self._waiters if s <= seq]
                self._waiters = [(s, cb) for s, cb in self._waiters if s > seq]
                self._cond.notify_all()
            for callback in ready:
                try:
                    callback()
                except Exception:
                    logger.exception("KV saver: a completion callback failed")

    def close(self, timeout: float = 30.0) -> None:
        if not self.flush(timeout):
            logger.warning("KV store: %d bytes of blocks not saved at shutdown", self._backlog)
        self._queue.put((None, None, 0))
        self._thread.join(timeout=1.0)


class WorkerConnector:
    def __init__(self, saver: BlockSaver | None, stats: StatsBox, store: KVStore, buffers: BufferPool | None = None):
        self.saver = saver
        self.stats = stats
        self.store = store  # loaded payloads go back to it (their buffers are reused)
        self.buffers = buffers or BufferPool()  # copy-out buffers, back from the saver once written

    def load(self, meta: KVConnectorMetadata | None, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the step's payloads into their blocks (before anything reads them)."""
        if meta is None or not meta.loads:
            return
        views = block_views(tensors)
        width = sum(v.shape[1] for v in views)
        on_cpu = all(v.device.type == "cpu" for v in views)
        for rl in meta.loads:
            t0 = time.perf_counter()
            if any(len(p) != width for p in rl.payloads):  # the scheduler side checked; never load a misfit
                raise ValueError(f"KV connector: a payload is not {width} bytes long")
            if on_cpu:
                # Straight from each payload into each tensor's block: plain memcpys, no staging
                # copy and no torch indexing kernel (uint8 index_copy_ runs ~40x slower).
                dst = [v.numpy() for v in views]
                for block_id, payload in zip(rl.block_ids, rl.payloads):
                    src = np.frombuffer(payload, dtype=np.uint8)
                    offset = 0
                    for d in dst:
                        w = d.shape[1]
                        d[block_id] = src[offset : offset + w]
                        offset += w
            else:
                blob = torch.from_numpy(np.stack([np.frombuffer(p, dtype=np.uint8) for p in rl.payloads]))
                ids = torch.tensor(rl.block_ids, dtype=torch.int64)
                offset = 0
                for v in views:
                    w = v.shape[1]
                    v.index_copy_(0, ids.to(v.device), blob[:, offset : offset + w].to(v.device))
                    offset += w
            for payload in rl.payloads:
                self.store.release(payload)
            rl.payloads = []
            self.stats.update(num_loaded_blocks=len(rl.block_ids), num_loaded_bytes=width * len(rl.block_ids))
            self.stats.observe_load(rl.read_seconds + time.perf_counter() - t0)

    def save(self, meta: KVConnectorMetadata | None, req_ids: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Copy out the blocks of ``req_ids`` this step filled (their K/V is written) and queue them."""
        if meta is None or not meta.saves or self.saver is None:
            return
        wanted = set(req_ids)
        saves = [s for s in meta.saves if s.req_id in wanted]
        if not saves:
            return
        views = block_views(tensors)
        width = sum(v.shape[1] for v in views)
        buffer = self.buffers.take(len(saves) * width)  # the copy out, into reused memory
        rows = np.frombuffer(buffer, dtype=np.uint8).reshape(len(saves), width)
        ids = np.array([s.block_id for s in saves], dtype=np.int64)
        offset = 0
        for v in views:
            w = v.shape[1]
            if v.device.type == "cpu":  # straight into the buffer (no temporary: fresh memory faults)
                np.take(v.numpy(), ids, axis=0, out=rows[:, offset : offset + w], mode="clip")
            else:
                rows[:, offset : offset + w] = v[torch.from_numpy(ids).to(v.device)].cpu().numpy()
            offset += w
        whole = memoryview(buffer)
        items = [(s.block_hash, whole[i * width : (i + 1) * width]) for i, s in enumerate(saves)]
        if not self.saver.submit(items, buffer, self.buffers):
            self.buffers.give(buffer)
