"""A fault pinned on one request fails that request only; an unattributable one ends the engine."""

from __future__ import annotations

import asyncio
import math

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.errors import EngineDeadError, EngineOverloadedError, check_queue_room
from pagedllm.engine.faults import FaultInjector
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import INT64_MAX, StructuredOutputsParams

MARK = 77
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=1e9)


@pytest.fixture()
def faulty(llm):
    engine = llm.llm_engine
    saved = engine.faults
    engine.faults = FaultInjector(f"request_token={MARK}")
    yield llm
    engine.faults = saved


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_model_step_fault_fails_only_its_request(faulty):
    good = [{"prompt_token_ids": [3, 4, 5, 6]}, {"prompt_token_ids": [9, 8, 7] * 5}]
    alone = [_tokens(faulty, [p])[0] for p in good]
    bad = {"prompt_token_ids": [10, MARK, 11]}
    outs = faulty.generate([good[0], bad, good[1]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == alone
    assert outs[1].finished and outs[1].outputs[0].finish_reason == "error"
    assert "injected" in outs[1].error
    engine = faulty.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.usage() == 0.0


def test_fault_in_a_parallel_sampling_request_fails_all_its_samples(faulty):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6)
    outs = faulty.generate([{"prompt_token_ids": [MARK, 5, 6]}, {"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
    assert [c.finish_reason for c in outs[0].outputs] == ["error"] * 3
    assert all(c.finish_reason == "length" for c in outs[1].outputs)
    assert faulty.llm_engine.kv_cache_manager.usage() == 0.0


def test_a_failed_beam_search_ends_with_its_error_not_as_an_abort(faulty):
    """Found by an adversarial session: a beam search the engine failed came back as an abort
    (finish_reason "abort", no error), so the server answered 200 with empty text."""
    beams = SamplingParams(temperature=0, max_tokens=6, use_beam_search=True, best_of=2, ignore_eos=True)
    outs = faulty.generate([{"prompt_token_ids": [10, MARK, 11]}, {"prompt_token_ids": [5, 6, 7]}], beams, use_tqdm=False)
    assert [c.finish_reason for c in outs[0].outputs] == ["error"] and "injected" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 6 and outs[1].error is None
    assert faulty.llm_engine.kv_cache_manager.usage() == 0.0


def test_a_fault_every_request_hits_on_its_own_is_the_engines(faulty):
    prompts = [{"prompt_token_ids": [MARK, i]} for i in range(3, 6)]
    with pytest.raises(EngineDeadError):
        faulty.generate(prompts, GREEDY, use_tqdm=False)


def test_a_failing_detokenizer_fails_only_its_request(llm, monkeypatch):
    processor = llm.llm_engine.output_processor
    real = processor.on_new_tokens

    def flaky(req, num_new):
        if req.prompt_token_ids[0] == 42:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, num_new)

    monkeypatch.setattr(processor, "on_new_tokens", flaky)
    outs = llm.generate([{"prompt_token_ids": [42, 5]}, {"prompt_token_ids": [5, 42]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[1].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 12


def test_async_engine_death_fails_pending_and_new_requests(tiny_llama, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FAULT_INJECTION", f"engine_token={MARK}")
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64), log_stats_interval=1e9)
    deaths: list[BaseException] = []
    llm.on_dead.append(deaths.append)

    async def scenario() -> None:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        pending = await llm.add_request({"prompt_token_ids": [5, 6]}, params)
        first = await pending.__anext__()  # it runs
        assert first.outputs[0].token_ids
        await llm.add_request({"prompt_token_ids": [MARK]}, params)
        with pytest.raises(EngineDeadError):
            async for _ in pending:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request({"prompt_token_ids": [5]}, params)

    try:
        asyncio.run(scenario())
        llm._thread.join(timeout=10)  # the engine thread ends once it has told everyone
        assert len(deaths) == 1 and isinstance(llm.dead, EngineDeadError)
        assert "InjectedFault" in str(llm.dead)
    finally:
        llm.shutdown()


def test_queue_room_tells_overload_from_a_request_that_never_fits():
    check_queue_room(waiting=0, adding=2, cap=2)
    check_queue_room(waiting=10**6, adding=5, cap=None)
    with pytest.raises(EngineOverloadedError, match="retry later"):
        check_queue_room(waiting=1, adding=2, cap=2)
    with pytest.raises(ValueError, match="max_waiting_requests"):
        check_queue_room(waiting=0, adding=3, cap=2)


def test_waiting_cap_refuses_a_whole_batch(tiny_llama):
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64), log_stats_interval=1e9,
                   max_waiting_requests=2)  # fmt: skip

    async def scenario() -> None:
        params = SamplingParams(max_tokens=2)
        # More prompts than the queue ever holds: the request's fault (400), not overload (503:
        # "retry later" would never succeed).
        with pytest.raises(ValueError, match="max_waiting_requests"):
            await llm.add_requests([{"prompt_token_ids": [5]}] * 3, params, ["a", "b", "c"])
        streams = await llm.add_requests([{"prompt_token_ids": [5]}] * 2, params, ["d", "e"])
        for s in streams:
            assert [o async for o in s][-1].finished
        # The queue counts samples (the waiting gauge does): one prompt of n = 3 is 3 requests.
        with pytest.raises(ValueError, match="makes 3 requests to queue"):
            await llm.add_request({"prompt_token_ids": [5]}, SamplingParams(max_tokens=2, n=3), "f")
        with pytest.raises(ValueError, match="makes 3 requests to queue"):
            await llm.add_request({"prompt_token_ids": [5]}, SamplingParams(max_tokens=2, n=1, best_of=3), "g")
        s = await llm.add_request({"prompt_token_ids": [5]}, SamplingParams(max_tokens=2, n=2), "h")
        outs = [o async for o in s]
        assert outs[-1].finished and {c.index for o in outs for c in o.outputs} == {0, 1}

    try:
        asyncio.run(scenario())
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan),
        ("presence_penalty", math.inf), ("frequency_penalty", math.nan), ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan), ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**70),
        ("max_tokens", 2**64), ("min_tokens", 2**64), ("logit_bias", {5: math.nan}), ("stop", ["s"] * 65),
        ("stop", ["x" * 1025]), ("stop_token_ids", [1] * 1025), ("bad_words", ["w"] * 129),
        ("logit_bias", {i: 1.0 for i in range(4097)}), ("allowed_token_ids", [1] * ((1 << 18) + 1)),
    ],
)  # fmt: skip
def test_sampling_params_refuse_out_of_range_values(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert str(err.value).startswith(field)


def test_sampling_params_accept_the_edges():
    SamplingParams(seed=INT64_MAX, top_k=-1, temperature=0, stop=["s"] * 64, logit_bias={1: -100, 2: 100})


def test_n_is_checked_before_anything_is_built(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="^n "):
        engine.add_request({"prompt_token_ids": [5]}, SamplingParams(n=10**8))
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request({"prompt_token_ids": [5]}, SamplingParams(top_k=10**6))


def test_the_runner_refuses_indices_outside_the_pool(llm):
    """The kernels trust their indices; the runner checks each step's before calling them."""
    from pagedllm.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput

    runner = llm.llm_engine.runner
    new = NewRequestData("bad", [5, 6, 7], [], SamplingParams(max_tokens=2), frozenset(), [])
    for block_ids, match in (([10**6], "outside the pool"), ([-1], "outside the pool"), ([], "outside the pool")):
        out = SchedulerOutput(scheduled=[ScheduledRequest("bad", 3, 0, block_ids, True, new)])
        runner.update_states(out)
        with pytest.raises(ValueError, match=match):
            runner.execute(out)
    # Token counts that disagree with the step's size: more drafts than new positions, or more
    # new positions than the request has tokens (found in review: the step's lists would then
    # have told the kernels of positions and slots that the token tensor lacks, or vice versa).
    for num_new, drafts in ((1, [8, 9, 10]), (6, []), (-1, [])):
        out = SchedulerOutput(scheduled=[ScheduledRequest("bad", num_new, 0, [1], True, new, (), drafts)])
        runner.update_states(out)
        with pytest.raises(ValueError, match="tokens for a step of"):
            runner.execute(out)
    runner.update_states(SchedulerOutput(finished_req_ids={"bad"}))
    assert "bad" not in runner.requests


def test_a_fault_in_an_n_request_without_prefix_caching_fails_only_it(tiny_llama):
    """Its samples run side by side (no prefix cache to wait for) and all fail on the same
    data: that is one request's fault, not the engine's, alone in a step or not."""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False, log_stats_interval=1e9)
    llm.llm_engine.faults = FaultInjector(f"request_token={MARK}")
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6)
    (alone,) = llm.generate([{"prompt_token_ids": [MARK, 9]}], params, use_tqdm=False)
    assert [c.finish_reason for c in alone.outputs] == ["error", "error"]
    mixed = llm.generate([{"prompt_token_ids": [MARK, 9]}, {"prompt_token_ids": [4, 9]}], params, use_tqdm=False)
    assert [c.finish_reason for c in mixed[0].outputs] == ["error", "error"]
    assert [c.finish_reason for c in mixed[1].outputs] == ["length", "length"]
    assert llm.llm_engine.kv_cache_manager.usage() == 0.0


def test_a_fault_on_the_last_token_still_reports_the_error(llm, monkeypatch):
    """The request finished by length on this very token; its detokenizer then failed."""
    processor = llm.llm_engine.output_processor
    real = processor.on_new_tokens

    def fails_at_the_end(req, num_new):
        if req.prompt_token_ids[0] == 43 and len(req.output_token_ids) == req.max_tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, num_new)

    monkeypatch.setattr(processor, "on_new_tokens", fails_at_the_end)
    (out,) = llm.generate([{"prompt_token_ids": [43, 5]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and "injected" in out.error and not out.rejected


def test_a_fault_while_building_one_output_ends_only_that_request(llm, monkeypatch):
    """Building a request's output is request-local too: a fault there ends that request with
    an error output, and the others finish as alone. (A bug there, since fixed, once killed the
    whole engine: an IndexError from logprobs the output did not match.)"""
    processor = llm.llm_engine.output_processor
    real = processor._output

    def fails_for_44(parent, finished):
        if parent.samples[0].request.prompt_token_ids[0] == 44 and len(parent.samples[0].request.output_token_ids) >= 2:
            raise IndexError("injected")
        return real(parent, finished)

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (alone,) = llm.generate([{"prompt_token_ids": [45, 9]}], params, use_tqdm=False)
    monkeypatch.setattr(processor, "_output", fails_for_44)
    bad, good = llm.generate([{"prompt_token_ids": [44, 9]}, {"prompt_token_ids": [45, 9]}], params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "injected" in bad.error and bad.finished
    assert good.outputs[0].token_ids == alone.outputs[0].token_ids and good.outputs[0].finish_reason == "length"
    assert llm.llm_engine.kv_cache_manager.usage() == 0.0 and not llm.llm_engine.has_unfinished_requests()


def test_seeded_samples_do_not_change_with_preemption(tiny_llama):
    """A preempted request's generator outlives the preemption: its random stream goes on."""
    prompts = [{"prompt_token_ids": [3 + i, 7, 11, 13]} for i in range(6)]
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=20, ignore_eos=True)
    outs = {}
    for blocks in (64, 8):
        llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=blocks, block_size=4, log_stats_interval=1e9)
        outs[blocks] = llm.generate(prompts, params, use_tqdm=False)
    assert any(o.num_preemptions for o in outs[8]), "the small pool did not preempt"
    assert [o.outputs[0].token_ids for o in outs[8]] == [o.outputs[0].token_ids for o in outs[64]]


def test_async_engine_is_built_and_run_on_its_own_thread(tiny_llama, monkeypatch):
    """One thread runs every OpenMP team: the engine thread builds the engine (a model loaded
    on the main thread gave OpenMP a second team and made every decode step 2.3x slower), and
    a constructor error still reaches the caller."""
    import threading

    from pagedllm.engine import async_llm

    built_on: list[str] = []
    real = async_llm.LLMEngine

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_llm, "LLMEngine", recording)
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64), log_stats_interval=1e9)
    try:
        assert built_on == ["pagedllm-engine"] and llm.engine is not None

        async def one() -> list[int]:
            tokens: list[int] = []
            async for out in await llm.add_request({"prompt_token_ids": [5, 6]}, GREEDY):  # deltas
                tokens += out.outputs[0].token_ids
            return tokens

        assert len(asyncio.run(one())) == GREEDY.max_tokens
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLM(EngineConfig(model=str(tiny_llama / "missing"), dtype="float32"), log_stats_interval=1e9)
    assert built_on[-1] == "pagedllm-engine"


def test_only_the_engine_thread_runs_torch_on_several_threads(tiny_llama):
    """A parallel torch op on any other thread would give OpenMP a second team, and OpenMP then
    sleeps and wakes its workers at every region of every step (served decoding 2.3x slower):
    the input workers and the grammar compiler run torch single-threaded (the server's event
    loop too: api_server.run_server)."""
    import threading

    import torch

    from pagedllm.threads import configure_threads

    def counts() -> tuple[str, int]:
        return threading.current_thread().name, torch.get_num_threads()

    cores = configure_threads()
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64), log_stats_interval=1e9)
    try:

        async def probe() -> list[tuple[str, int]]:
            loop, pool_for = asyncio.get_running_loop(), llm.engine.structured._pool_for
            small, big = StructuredOutputsParams(regex="a+").spec, StructuredOutputsParams(regex="a" * (1 << 15)).spec
            return [await llm.call_in_engine(lambda _engine: counts()), await llm.run_in_worker(counts),
                    await loop.run_in_executor(pool_for(small), counts), await loop.run_in_executor(pool_for(big), counts)]  # fmt: skip

        seen = asyncio.run(probe())
        assert seen[0] == ("pagedllm-engine", cores)
        assert seen[1][0].startswith("pagedllm-input") and seen[1][1] == 1
        assert seen[2][0].startswith("pagedllm-grammar") and seen[2][1] == 1
        assert seen[3][0].startswith("pagedllm-grammar-big") and seen[3][1] == 1
        assert torch.get_num_threads() == cores  # the caller's thread is left as it was
        # A parallel-sized op on a helper leaves the engine's threads as they were.
        asyncio.run(llm.run_in_worker(lambda: torch.ones(1 << 20).sum()))
        assert asyncio.run(llm.call_in_engine(lambda _engine: counts())) == ("pagedllm-engine", cores)
    finally:
        llm.shutdown()


def test_a_refused_best_of_request_leaves_nothing_behind(tiny_llama):
    """A best_of request the KV pool can never hold is refused, and its id then serves another
    request whole (its pick stayed behind and cut that request's outputs to the refused one's n;
    found by an adversarial review)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8, block_size=4, max_model_len=128), log_stats_interval=0)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request({"prompt_token_ids": list(range(10, 50))}, SamplingParams(best_of=2, n=1, max_tokens=4), "x")
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=2, max_tokens=3, seed=1, logprobs=1), "x")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert len(outs["x"].outputs) == 2 and all(c.logprobs is not None for c in outs["x"].outputs)
