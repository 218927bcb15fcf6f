"""AsyncLLM behaviours a mutation audit of pagedllm/engine/async_llm.py found unpinned: a batch
refused part way, abort_all, shutdown reaching every open stream, commands queued before a death,
the liveness check, and a failing request hook."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from tests.engine.test_async_streams import _finish_reason, _until

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
GUARD = 30.0  # only a hang guard: a missing answer fails the test instead of hanging it


def _new(tiny_llama, **kwargs) -> AsyncLLM:
    return AsyncLLM(EngineConfig(model=str(tiny_llama), num_kv_blocks=64), log_stats_interval=1e9, **kwargs)


@pytest.fixture()
def llm(tiny_llama):
    engine = _new(tiny_llama)
    yield engine
    engine.shutdown()


def test_a_batch_refused_part_way_withdraws_the_requests_already_added(llm):
    """add_requests is all or none: the second "dup" is refused after the first was added to the
    engine, so the first must be aborted there too, not left running with no stream to read it."""

    async def main() -> bool:
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_requests([{"prompt_token_ids": [5, 6]}] * 2, LONG, ["dup", "dup"])
        return await asyncio.wait_for(llm.call_in_engine(lambda e: e.has_unfinished_requests()), GUARD)

    assert asyncio.run(main()) is False
    assert llm.num_in_flight() == 0


def test_abort_all_ends_every_open_stream_with_abort(llm):
    """abort_all (the server's shutdown grace) ends every running request now with finish reason
    "abort" rather than letting each run to max_tokens."""

    async def main() -> list[str]:
        streams = [llm.generate({"prompt_token_ids": [5 + i, 6]}, LONG, request_id=f"r{i}") for i in range(3)]
        for s in streams:
            await s.__anext__()  # each is running
        llm.abort_all()
        reasons = await asyncio.wait_for(asyncio.gather(*(_finish_reason(s) for s in streams)), GUARD)
        await _until(lambda: llm.num_in_flight() == 0)  # (a stream is dropped just after its last put)
        assert not await asyncio.wait_for(llm.call_in_engine(lambda e: e.has_unfinished_requests()), GUARD)
        return reasons

    assert asyncio.run(main()) == ["abort"] * 3


def test_shutdown_fails_every_stream_already_streaming(tiny_llama):
    """Every caller mid-stream when the engine shuts down gets EngineDeadError, not only the
    first one (the others would wait forever for an output that never comes)."""
    llm = _new(tiny_llama)

    async def one(stream) -> str:
        try:
            async for _ in stream:
                pass
            return "finished"
        except EngineDeadError:
            return "EngineDeadError"

    async def main() -> list[str]:
        streams = [llm.generate({"prompt_token_ids": [5 + i, 6]}, LONG, request_id=f"s{i}") for i in range(3)]
        for s in streams:
            await s.__anext__()  # each is accepted and running
        llm.shutdown()
        return await asyncio.wait_for(asyncio.gather(*(one(s) for s in streams)), GUARD)

    assert asyncio.run(main()) == ["EngineDeadError"] * 3


def test_an_add_queued_while_the_engine_dies_gets_engine_dead(tiny_llama, monkeypatch):
    """An add that passed the liveness check and was queued while the fatal step ran is answered
    with EngineDeadError by the dying engine thread; nothing else would ever answer it."""
    real_step = LLMEngine.step
    entered, release, armed = threading.Event(), threading.Event(), threading.Event()

    def step(self):
        if armed.is_set():
            entered.set()
            release.wait(GUARD)
            raise RuntimeError("boom")
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    llm = _new(tiny_llama)

    async def main() -> None:
        running = llm.generate({"prompt_token_ids": [5, 6]}, LONG, request_id="running")
        await running.__anext__()
        armed.set()
        await _until(entered.is_set)  # the engine thread is inside the fatal step
        late = asyncio.ensure_future(llm.add_request({"prompt_token_ids": [7]}, LONG, request_id="late"))
        await _until(lambda: llm._commands.qsize() == 1)  # queued behind the step, before the death
        release.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(late, GUARD)
        with pytest.raises(EngineDeadError):  # (after the outputs it had before the death)
            await asyncio.wait_for(_finish_reason(running), GUARD)

    try:
        asyncio.run(main())
    finally:
        release.set()
        llm.shutdown()


def test_healthy_is_false_once_the_engine_thread_is_gone(tiny_llama, monkeypatch):
    """/health checks the engine thread itself: a thread that ended before any death was
    recorded (dead still None, not shut down) must already read as unhealthy."""
    monkeypatch.setattr(AsyncLLM, "_loop", lambda self: None)  # the thread ends right after the build
    llm = _new(tiny_llama)
    try:
        llm._thread.join(timeout=GUARD)
        assert not llm._thread.is_alive()
        assert llm.dead is None and not llm._stopped
        assert not llm.healthy()
    finally:
        llm.shutdown()


def test_a_failing_request_hook_neither_fails_the_request_nor_kills_the_engine(llm):
    """A request hook (the metrics' parameters) that raises is logged: its request still streams
    to the end and the engine stays up for the next one."""

    def broken(request_id, processed):
        raise RuntimeError("metrics bug")

    llm.request_hooks.append(broken)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main() -> list[str]:
        return [await asyncio.wait_for(_finish_reason(llm.generate({"prompt_token_ids": p}, params)), GUARD)
                for p in ([5, 6], [7])]  # fmt: skip

    assert asyncio.run(main()) == ["length", "length"]
    assert llm.healthy()


def test_output_hooks_have_seen_an_output_before_its_caller_gets_it(llm):
    """Output hooks (the per-token metrics) run before the output is handed to the caller: a
    client that scrapes /metrics right after its response ended must find it counted. A slow
    hook makes a hand-off ahead of the hooks visible."""
    seen: list[tuple[str, bool]] = []

    def slow_hook(out) -> None:
        time.sleep(0.02)
        seen.append((out.request_id, out.finished))

    llm.output_hooks.append(slow_hook)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main() -> None:
        received = 0
        async for out in llm.generate({"prompt_token_ids": [5, 6]}, params, request_id="hooked"):
            received += 1
            assert len(seen) >= received  # (the engine may already be a step further)
        assert seen[-1] == ("hooked", True)

    asyncio.run(main())
