"""Reused staging buffers for block payloads.

Fresh memory costs a page fault per 4 KiB on first touch: staging a 2,000-token prompt's
blocks of the default model (100 MiB) in new buffers took longer than reading them from the
page cache. So payload buffers (read from the store, copied out for a save) are handed back
after use and reused, up to ``max_cached_bytes`` kept.
"""

from __future__ import annotations

import threading

DEFAULT_MAX_CACHED_BYTES = 512 << 20


class BufferPool:
    """Thread-safe free lists of bytearrays by exact size."""

    def __init__(self, max_cached_bytes: int = DEFAULT_MAX_CACHED_BYTES):
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._cached = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._cached -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        """Hand a buffer back; nothing may use it afterwards."""
        with self._lock:
            if self._cached + len(buf) <= self.max_cached_bytes:
                self._free.setdefault(len(buf), []).append(buf)
                self._cached += len(buf)

    def give_view(self, view: memoryview) -> None:
        """Hand back the bytearray under a payload view (a no-op for other objects)."""
        if isinstance(view, memoryview) and isinstance(view.obj, bytearray):
            self.give(view.obj)
