"""DPAsyncLLM's streams: a clean-up touches only its own request, and a cancelled request the
replica refused leaves nothing behind (each found by an adversarial session)."""

from __future__ import annotations

import asyncio
import time

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.data_parallel.client import DPAsyncLLM


async def _until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_stream_clean_up_and_cancelled_refusals_touch_only_their_own_request(tiny_llama, monkeypatch):
    real_on_message = DPAsyncLLM._on_message

    def slow_replies(self, rank: int, msg: tuple) -> None:
        if msg[0] == "reply":
            time.sleep(0.2)  # (the caller gives up before the replica's answer is heard)
        real_on_message(self, rank, msg)

    monkeypatch.setattr(DPAsyncLLM, "_on_message", slow_replies)
    llm = DPAsyncLLM(EngineConfig(model=str(tiny_llama), data_parallel_size=2, num_kv_blocks=64),
                     log_stats_interval=1e9, max_waiting_requests=1)  # fmt: skip

    async def finish_reason(stream) -> str:
        reason = None
        async for out in stream:
            reason = out.outputs[0].finish_reason
        return reason

    async def main() -> str:
        # 1. A request the replica refuses (n=2 makes two waiting entries; the cap is one),
        # cancelled while the replica decides: its entry stayed for good (the id in use, the
        # replica's load counted).
        refused = asyncio.ensure_future(llm.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(n=2, max_tokens=4), "late"))
        await _until(lambda: "late" in llm._streams)
        refused.cancel()
        await _until(lambda: llm.num_in_flight() == 0)
        assert [load for load, _ in llm.replica_loads()] == [0, 0]
        # 2. A stream left behind (its request finished, the last outputs unread) does not abort
        # a later request holding the same id.
        first = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, ignore_eos=True), request_id="late")
        await first.__anext__()
        await _until(lambda: llm.num_in_flight() == 0)
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        second = asyncio.ensure_future(finish_reason(llm.generate({"prompt_token_ids": [8, 9]}, long, request_id="late")))
        await _until(lambda: llm.num_in_flight() == 1)
        await first.aclose()
        return await second

    try:
        assert asyncio.run(main()) == "length"
    finally:
        llm.shutdown()
