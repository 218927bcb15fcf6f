"""Giving the OS back the memory the engine no longer uses, so its RSS tracks what it holds.

Two kinds of pages stay resident for nothing once a model is loaded:
- the C heap's free chunks: the loader's temporary fp32 copies and the first steps' buffers are
  freed into the heap, and glibc returns only the heap's top to the OS unless asked to trim;
- the pages of the weight files read through their memory maps. They are clean and file
  backed, so dropping them loses nothing: a later read (an embedding row) faults its page back
  in from the page cache.

Linux and glibc only; elsewhere these calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from pathlib import Path

MADV_DONTNEED = 4  # Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def physical_memory_bytes() -> int | None:
    """The machine's RAM (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim``); False where there is none."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def drop_file_pages(paths: list[Path]) -> int:
    """Drop this process's resident pages of every read-only mapping of ``paths`` (the mappings
    stay: a later read faults its page back in). Returns the bytes of the mappings advised."""
    libc = _libc()
    targets = {os.path.realpath(p) for p in paths}
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    if libc is None or not targets:
        return 0
    advised = 0
    for line in maps:
        fields = line.split(maxsplit=5)
        # Written pages of a private mapping would be lost: only read-only mappings are dropped.
        if len(fields) < 6 or fields[5] not in targets or "w" in fields[1]:
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0:
            advised += hi - lo
    return advised
