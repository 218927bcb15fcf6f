"""memory.py: what loading leaves resident for nothing goes back to the OS."""

from __future__ import annotations

import platform
import time
import re
from pathlib import Path

import numpy as np
import pytest

from pagedllm.executor.worker import rss_bytes
from pagedllm.memory import drop_file_pages, trim_heap

linux_glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim and Linux's madvise")


def _mapped_rss_mib(path: Path) -> float:
    """Resident MiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    target, total, current = str(path.resolve()), 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
            current = head[5] if len(head) > 5 else None
        elif head[0] == "Rss:" and current == target:
            total += int(head[1])
    return total / 1024


@linux_glibc
def test_dropped_file_pages_leave_the_rss_and_read_back_the_same(tmp_path):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page read
    assert _mapped_rss_mib(path) > 12
    assert drop_file_pages([path]) >= 16 << 20
    assert _mapped_rss_mib(path) < 1
    assert np.array_equal(mapped[::4096], data[::4096])  # still mapped: faulted back from the file
    assert drop_file_pages([tmp_path / "not-mapped.bin"]) == 0


@linux_glibc
def test_trim_heap_returns_freed_heap_memory():
    chunks = [bytearray(100_000) for _ in range(1000)]  # below the mmap threshold: on the heap
    for c in chunks:
        c[::4096] = b"\1" * len(c[::4096])
    pin = bytearray(100_000)  # keeps the freed chunks below the heap's top
    before = rss_bytes() / 2**20
    del chunks
    assert trim_heap()
    assert before - rss_bytes() / 2**20 > 50
    del pin


@linux_glibc
@pytest.mark.slow
def test_a_loaded_engine_holds_no_model_file_pages():
    """The loader reads the GGUF file through a memory map and copies what it keeps: the pages
    it read (93 MiB for the default model) do not stay in the RSS."""
    from pagedllm import LLM
    from pagedllm.model.loader import default_model_path

    llm = LLM(log_stats_interval=1e9)
    assert _mapped_rss_mib(default_model_path()) < 8
    out = llm.generate(["The capital of France is"], use_tqdm=False)  # embedding rows read back in
    assert out[0].outputs[0].token_ids
    llm.shutdown()


def test_the_engine_thread_trims_the_heap_when_aborts_leave_it_idle(tiny_llama, monkeypatch):
    """Going idle returns freed memory whichever way the last request ended: a soak session
    saw an idle server keep ~80 MiB more after an aborted burst than after a finished one."""
    import asyncio

    from pagedllm.config import EngineConfig
    from pagedllm.engine import async_llm
    from pagedllm.sampling_params import SamplingParams

    calls: list[float] = []
    monkeypatch.setattr(async_llm, "trim_heap", lambda: calls.append(time.monotonic()) or 0)
    llm = async_llm.AsyncLLM(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9)

    async def scenario() -> float:
        stream = await llm.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=400, ignore_eos=True), "r")
        async for _ in stream:  # the first output: the request runs
            break
        await stream.aclose()  # aborts the request
        aborted = time.monotonic()
        for _ in range(100):
            if not llm.engine.has_unfinished_requests() and calls and calls[-1] >= aborted:
                break
            await asyncio.sleep(0.02)
        return aborted

    try:
        aborted = asyncio.run(scenario())
        assert calls and calls[-1] >= aborted, "no trim after the abort left the engine idle"
    finally:
        llm.shutdown()
