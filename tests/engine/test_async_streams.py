"""AsyncLLM used directly from Python: a stream's clean-up touches only its own request, and a
shutdown ends every caller with EngineDeadError (each found by an adversarial session)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.errors import EngineDeadError

LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture()
def llm(tiny_llama):
    engine = AsyncLLM(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9)
    yield engine
    engine.shutdown()


async def _finish_reason(stream) -> str:
    reason = None
    async for out in stream:
        reason = out.outputs[0].finish_reason
    return reason


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_stream_left_behind_does_not_abort_a_later_request_with_its_id(llm):
    """The first "x" finished in the engine, its last outputs unread; the second "x" was then
    accepted. Closing the first stream aborted the second (by its id)."""

    async def main() -> str:
        first = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, ignore_eos=True), request_id="x")
        await first.__anext__()
        await _until(lambda: llm.num_in_flight() == 0)  # finished in the engine, unread here
        second = asyncio.ensure_future(_finish_reason(llm.generate({"prompt_token_ids": [8, 9]}, LONG, request_id="x")))
        await _until(lambda: llm.num_in_flight() == 1)
        await first.aclose()
        return await second

    assert asyncio.run(main()) == "length"


def test_cancelling_a_refused_duplicate_leaves_the_original_running(llm, monkeypatch):
    """A second "X" was cancelled while the engine was refusing it as a duplicate: its clean-up
    aborted the first "X"."""
    real = AsyncLLM._add_all

    def slow_add(self, items):
        if items[0][0] == "X" and "X" in self._streams:
            time.sleep(0.3)  # (the duplicate's caller gives up meanwhile)
        return real(self, items)

    monkeypatch.setattr(AsyncLLM, "_add_all", slow_add)

    async def main() -> str:
        original = llm.generate({"prompt_token_ids": [5, 6, 7]}, LONG, request_id="X")
        await original.__anext__()
        with pytest.raises((asyncio.TimeoutError, ValueError)):
            await asyncio.wait_for(_finish_reason(llm.generate({"prompt_token_ids": [9]}, LONG, request_id="X")), 0.1)
        return await _finish_reason(original)

    assert asyncio.run(main()) == "length"


def test_a_caller_cancelled_while_the_engine_adds_its_request_leaves_nothing_running(llm, monkeypatch):
    """The caller gives up while the engine thread is still adding its request: the request,
    accepted after all, is aborted rather than left to run to max_tokens with no one reading
    (a mutation audit removed that abort and no test failed)."""
    real = AsyncLLM._add_all

    def slow_add(self, items):
        time.sleep(0.3)  # (the caller gives up meanwhile)
        return real(self, items)

    monkeypatch.setattr(AsyncLLM, "_add_all", slow_add)
    from pagedllm.engine.llm_engine import LLMEngine

    aborted = []
    real_abort = LLMEngine.abort_request

    def recording_abort(self, request_id):
        aborted.append(request_id)
        return real_abort(self, request_id)

    monkeypatch.setattr(LLMEngine, "abort_request", recording_abort)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(llm.add_request({"prompt_token_ids": [5, 6, 7]}, long, request_id="Y"), 0.1)
        await _until(lambda: aborted == ["Y"], timeout=5.0)  # right after the add, not 400 tokens later
        await _until(lambda: llm.num_in_flight() == 0 and llm.num_running() == 0, timeout=5.0)

    asyncio.run(main())


def test_automatic_ids_never_collide_with_a_callers_own(llm):
    async def main() -> list[str]:
        mine = await llm.add_request({"prompt_token_ids": [5, 6]}, LONG, request_id="req-1")
        auto = await _finish_reason(llm.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=3, ignore_eos=True)))
        return [auto, await _finish_reason(mine)]

    assert asyncio.run(main()) == ["length", "length"]


def test_shutdown_ends_every_caller_with_engine_dead_not_a_stray_cancel(tiny_llama):
    """Requests still in the input workers' queue had their futures cancelled by shutdown: the
    callers got CancelledError though nobody cancelled them."""
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9)

    async def one(i: int) -> str:
        try:
            async for _ in llm.generate({"prompt_token_ids": [5 + i] * 30}, SamplingParams(max_tokens=5)):
                pass
            return "finished"
        except asyncio.CancelledError:
            return "CancelledError"
        except EngineDeadError:
            return "EngineDeadError"

    async def main() -> list[str]:
        tasks = [asyncio.ensure_future(one(i)) for i in range(60)]
        await asyncio.sleep(0)
        llm.shutdown()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert "CancelledError" not in results and "EngineDeadError" in results, results


def test_request_hooks_run_before_any_output_of_their_request(llm):
    """The metrics' request hook (a request's parameters) ran when the caller's task resumed; a
    one-token request could finish before that, and its parameters were never observed (a CI
    run saw request_params_n_count 9 of 10). A busy event loop makes that certain here."""
    events: list[tuple[str, str]] = []
    llm.request_hooks.append(lambda rid, req: events.append(("request", rid)))
    llm.output_hooks.append(lambda out: events.append(("output", out.request_id)))

    async def main() -> None:
        async def hog() -> None:  # another task holding the loop: the caller resumes late
            while True:
                time.sleep(0.05)
                await asyncio.sleep(0)

        busy = asyncio.ensure_future(hog())
        ids = [f"one-token-{i}" for i in range(5)]
        for rid in ids:
            await _finish_reason(llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1), request_id=rid))
        busy.cancel()

    asyncio.run(main())
    for rid in (f"one-token-{i}" for i in range(5)):
        mine = [kind for kind, r in events if r == rid]
        assert mine and mine[0] == "request", (rid, mine)
