"""Tensor and pipeline parallel on tiny random models: greedy tokens equal the one-process
engine's, GQA with uneven head splits, a dead worker ends the engine instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.throughput import parallel_line, parallel_stats
from pagedllm.engine.errors import EngineDeadError
from tests.conftest import save_tiny_model
from tests.parity import assert_engines_agree

ENGINE = dict(num_kv_blocks=64, log_stats_interval=1e9, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def uneven_gqa(tmp_path_factory):
    """6 query heads in 3 KV groups of 2: at TP=2, rank 0 gets KV heads {0, 1}, rank 1 {2}."""
    return save_tiny_model(tmp_path_factory.mktemp("gqa"), hidden_size=96, num_attention_heads=6,
                           num_key_value_heads=3, intermediate_size=160, seed=2)  # fmt: skip


def _prompts(n=(1, 5, 17, 40)) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 256, (k,), generator=g).tolist()} for k in n]


def one_process_and_tp2(path, prompts, sp: SamplingParams, engine: dict = ENGINE, inspect=lambda llm: None) -> tuple[list, list]:
    """Each prompt's first sample from the one-process engine and from TP=2 (``inspect`` sees
    the TP engine before it closes)."""
    ref = [o.outputs[0] for o in LLM(str(path), **engine).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(path), tensor_parallel_size=2, **engine)
    try:
        got = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
        inspect(llm)
    finally:
        llm.llm_engine.close()
    return ref, got


def _greedy(llm: LLM, prompts, max_tokens: int = 8) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_an_engine_on_a_worker_node_is_refused_not_left_waiting(uneven_gqa):
    """LLM(nnodes=2, node_rank=1) waited 900 s for ranks that never come (found by an
    adversarial session); only the CLI refused it."""
    with pytest.raises(ValueError, match="node_rank 1: only node 0 runs the engine"):
        LLM(str(uneven_gqa), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29999, **ENGINE)


def test_a_master_port_in_use_is_named_before_any_worker_starts(uneven_gqa):
    """Found by an adversarial session: a worker's rendezvous traceback, then WorkerDeadError."""
    import socket

    from pagedllm.executor.multiproc import bind_error

    for offset, match in ((0, "master_port .* cannot be used on 127.0.0.1"), (1, r"control channel cannot listen .*\(master_port \+ 1\)")):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1] - offset
            if offset:
                assert bind_error("127.0.0.1", port) is None  # the port below the busy one (else the first check fires)
            with pytest.raises(ValueError, match=match):
                LLM(str(uneven_gqa), tensor_parallel_size=2, master_port=port, **ENGINE)


def test_config_refuses_what_does_not_shard(uneven_gqa):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(uneven_gqa), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(uneven_gqa), tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(uneven_gqa), tensor_parallel_size=2, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="tensor_parallel_size"):  # 3 KV heads over 4 ranks
        LLM(str(uneven_gqa), tensor_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(str(uneven_gqa), pipeline_parallel_size=3, **ENGINE)  # 2 layers


def test_one_process_executor_adds_no_call(uneven_gqa):
    """The default UniProcExecutor hands out the runner's own bound methods."""
    engine = LLM(str(uneven_gqa), **ENGINE).llm_engine
    assert engine.executor.execute == engine.runner.execute
    assert engine.executor.update_states == engine.runner.update_states


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_greedy_tokens_equal_one_process(uneven_gqa, tp, pp):
    prompts = _prompts()
    ref = _greedy(LLM(str(uneven_gqa), **ENGINE), prompts)
    llm = LLM(str(uneven_gqa), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        assert llm.llm_engine.runner is None and len(llm.llm_engine.executor.worker_reports) == tp * pp
        assert _greedy(llm, prompts) == ref
        steps, seconds = llm.llm_engine.executor.collective_stats()  # what the benchmarks print
        assert steps > 0 and (seconds > 0) == (tp > 1)
        line = parallel_line(parallel_stats(llm.llm_engine, (0, 0.0)))
        assert f"TP={tp} PP={pp}" in line and "ms per step" in line
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_four_ranks_sum_with_gloos_all_reduce(tmp_path, kv_heads):
    """TP=4: the partial sums take gloo's all_reduce (two ranks swap theirs directly), and with
    fewer KV heads than ranks each is replicated on the ranks of its query heads."""
    path = save_tiny_model(tmp_path / "tp4", hidden_size=128, num_attention_heads=8, num_key_value_heads=kv_heads,
                           intermediate_size=192, seed=6)  # fmt: skip
    prompts = _prompts((2, 19, 33))
    ref = _greedy(LLM(str(path), **ENGINE), prompts)
    llm = LLM(str(path), tensor_parallel_size=4, **ENGINE)
    try:
        reports = llm.llm_engine.executor.worker_reports
        assert [r["num_heads"] for r in reports] == [2] * 4
        assert [r["num_kv_heads"] for r in reports] == [1] * 4
        assert _greedy(llm, prompts) == ref
    finally:
        llm.llm_engine.close()


def test_mqa_replicates_the_kv_head(tmp_path):
    path = save_tiny_model(tmp_path / "mqa", num_attention_heads=4, num_key_value_heads=1, seed=4)
    prompts = _prompts((3, 20))
    ref = _greedy(LLM(str(path), **ENGINE), prompts)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        assert [r["num_kv_heads"] for r in llm.llm_engine.executor.worker_reports] == [1, 1]
        assert _greedy(llm, prompts) == ref
    finally:
        llm.llm_engine.close()


def test_a_dead_worker_ends_the_engine(uneven_gqa):
    llm = LLM(str(uneven_gqa), tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.executor
    try:
        _greedy(llm, _prompts((4,)), max_tokens=2)
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker"):
            _greedy(llm, _prompts(), max_tokens=50)
        assert time.monotonic() - start < 30
        with pytest.raises(EngineDeadError):  # and it stays dead
            _greedy(llm, _prompts((2,)), max_tokens=2)
        time.sleep(0.5)
        assert not any(p.is_alive() for p in executor.procs)  # the survivor was stopped too
    finally:
        llm.llm_engine.close()


def test_a_request_fault_is_isolated_over_workers(uneven_gqa):
    """The engine re-runs a failing step over halves of its requests; with worker processes
    every re-run goes to all ranks, which stay in step: only the faulty request fails."""
    from pagedllm.engine.faults import FaultInjector

    mark = 77
    good = [{"prompt_token_ids": [3, 4, 5, 6]}, {"prompt_token_ids": [9, 8, 7] * 5}]
    bad = {"prompt_token_ids": [10, mark, 11]}
    ref = _greedy(LLM(str(uneven_gqa), **ENGINE), good)
    for tp, pp in ((2, 1), (1, 2)):
        llm = LLM(str(uneven_gqa), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
        try:
            llm.llm_engine.faults = FaultInjector(f"request_token={mark}")
            sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            outs = llm.generate([good[0], bad, good[1]], sp, use_tqdm=False)
            assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == ref
            assert outs[1].outputs[0].finish_reason == "error"
            assert _greedy(llm, good) == ref  # and the workers carry on
        finally:
            llm.llm_engine.close()


def test_pipeline_keeps_one_batch_per_stage_in_flight(uneven_gqa):
    """PP=2: two disjoint cohorts alternate, one batch per stage; aborting a request whose
    batch is in flight drops its result; the greedy tokens are the one-process engine's."""
    prompts = _prompts((1, 5, 17, 40, 9, 3))
    ref = _greedy(LLM(str(uneven_gqa), **ENGINE), prompts, max_tokens=12)
    llm = LLM(str(uneven_gqa), pipeline_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    submitted: list[set[str]] = []
    depth = []
    submit = engine.executor.submit

    def spy(out):
        in_flight = {s.req_id for b in engine._batch_queue for s in b.scheduled}
        submitted.append(in_flight & {s.req_id for s in out.scheduled})  # must stay empty
        depth.append(len(engine._batch_queue) + 1)
        submit(out)

    engine.executor.submit = spy
    try:
        assert engine.executor.max_concurrent_batches == 2
        assert _greedy(llm, prompts, max_tokens=12) == ref
        assert max(depth) == 2
        assert not any(submitted)  # batches in flight together are disjoint
        # Abort a request while its batch is in flight; the others are unharmed.
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ids = [engine.add_request(p, sp) for p in prompts]
        engine.step()
        in_flight = {s.req_id for b in engine._batch_queue for s in b.scheduled}
        victim = next(iter(in_flight))
        done = {out.request_id: out for out in engine.abort_request(victim)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        assert done[victim].outputs[0].finish_reason == "abort"
        assert [done[i].outputs[0].token_ids for i in ids if i != victim] == [r for i, r in zip(ids, ref) if i != victim]
        assert engine.kv_cache_manager.usage() == 0.0
        assert _greedy(llm, prompts, max_tokens=12) == ref  # no stale answers left in the pipes
    finally:
        engine.close()


@pytest.mark.parametrize("variant, model_type, overrides", [
    ("qwen2-bias", "qwen2", {}),
    ("qwen3-qk-norm", "qwen3", {"head_dim": 16}),
    ("llama-tied", "llama", {"tie_word_embeddings": True, "vocab_size": 257}),  # uneven vocabulary split (129 + 128)
    ("gemma3", "gemma3_text", {"head_dim": 16, "num_hidden_layers": 6, "sliding_window": 24, "query_pre_attn_scalar": 24}),
])  # fmt: skip
def test_tensor_parallel_architectures(tmp_path, variant, model_type, overrides):
    path = save_tiny_model(tmp_path / variant, model_type, seed=5, **overrides)
    prompts = _prompts((3, 30))
    ref = _greedy(LLM(str(path), **ENGINE), prompts)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        assert _greedy(llm, prompts) == ref
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("variant, model_type, overrides", [
    ("phi3-fused", "phi3", {"sliding_window": 40, "pad_token_id": 0}),  # fused qkv_proj and gate_up_proj
    ("phi3-q8_0-gguf-blocks", "phi3", {"sliding_window": 40, "pad_token_id": 0}),  # the fused rows as Q8_0 blocks
    ("qwen3-moe", "qwen3_moe", {"head_dim": 16, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}),
])  # fmt: skip
def test_tensor_parallel_fused_and_moe(tmp_path, variant, model_type, overrides):
    """Phi-3's fused weights cut part by part (also as GGUF blocks run on every step), and a
    mixture of experts (router replicated, experts cut by width, one all-reduce per MoE block;
    layer 1 dense): TP=2 greedy tokens are the one-process engine's, or a near tie flipped by
    the all-reduce's summation order."""
    path = save_tiny_model(tmp_path / variant, model_type, seed=5, **overrides)
    engine = dict(ENGINE)
    if "gguf" in variant:
        from tests.model.test_gguf_archs import write_gguf

        (tmp_path / "gguf").mkdir()
        path = write_gguf(path, tmp_path / "gguf" / "phi3.gguf", "phi3", "Q8_0")
        engine.update(dtype="float32", dense_weights="no")
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    reports = []
    ref, outs = one_process_and_tp2(path, _prompts((3, 30)), sp, engine,
                                    inspect=lambda llm: reports.extend(llm.llm_engine.executor.worker_reports))  # fmt: skip
    exact = [assert_engines_agree(f"{variant} prompt {i}", mine, r) for i, (mine, r) in enumerate(zip(outs, ref))]
    assert sum(exact) >= len(exact) - 1  # at most one near-tie flip
    assert [r["num_heads"] for r in reports] == [2, 2]


def test_ranks_pinned_to_their_own_cores(uneven_gqa, monkeypatch):
    """PAGEDLLM_PIN_THREADS=1: each rank gets its share of the cores, pinned, one thread per core."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    monkeypatch.setenv("PAGEDLLM_PIN_THREADS", "1")
    monkeypatch.delenv("PAGEDLLM_NUM_THREADS", raising=False)
    llm = LLM(str(uneven_gqa), tensor_parallel_size=2, **ENGINE)
    try:
        reports = llm.llm_engine.executor.worker_reports
        cpus = [set(r["cpus"]) for r in reports]
        assert not (cpus[0] & cpus[1]) and all(r["threads"] == len(r["cpus"]) for r in reports)
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_fault_on_one_rank_ends_the_engine_without_hanging(uneven_gqa, monkeypatch, rank):
    """One rank alone fails a step; the other waits in its all-reduce for it: the engine gives
    it 10 s (STUCK_SECONDS), then stops, instead of waiting on a collective forever. (With the
    fault on rank 1, the engine read rank 0's answer first, with no deadline: it hung.)"""
    mark = 77
    monkeypatch.setenv("PAGEDLLM_WORKER_FAULT", f"{rank}:{mark}")
    llm = LLM(str(uneven_gqa), tensor_parallel_size=2, **ENGINE)
    try:
        assert len(_greedy(llm, _prompts((4,)), max_tokens=2)) == 1  # no mark: runs
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="did not answer|workers only"):
            _greedy(llm, [{"prompt_token_ids": [10, mark, 11]}], max_tokens=2)
        assert time.monotonic() - start < 30
    finally:
        llm.llm_engine.close()


def test_tensor_and_pipeline_parallel_together(uneven_gqa):
    """TP=2 x PP=2 (4 ranks): stage 1's ranks hold no embedding, which the tensor-parallel
    install used to wrap anyway, so no rank of stage 1 ever started (found by an adversarial
    session). Greedy tokens equal the one-process engine's."""
    prompts = _prompts()
    ref = _greedy(LLM(str(uneven_gqa), **ENGINE), prompts)
    llm = LLM(str(uneven_gqa), tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    try:
        assert _greedy(llm, prompts) == ref
    finally:
        llm.llm_engine.close()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_structured_outputs_over_workers(tiny_llama_tok, tp, pp):
    """Found by an adversarial session (2026-11-27, seventh): the step's grammar bitmask (a
    tensor) went to the ranks as a one-time shared-memory handle; the second rank could not
    open it and the engine died on the first guided request."""
    from pagedllm import StructuredOutputsParams

    guided = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=so) for so in (
        StructuredOutputsParams(choice=["yes", "no", "maybe"]), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"))]
    prompts = ["Is the sky blue?", "A code:"]
    ref = [o.outputs[0].text for o in LLM(str(tiny_llama_tok), **ENGINE).generate(prompts, guided, use_tqdm=False)]
    llm = LLM(str(tiny_llama_tok), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        got = [o.outputs[0].text for o in llm.generate(prompts, guided, use_tqdm=False)]
        assert got == ref and ref[0] in ("yes", "no", "maybe") and len(ref[1]) == 6
    finally:
        llm.llm_engine.close()


def test_each_rank_swaps_into_its_own_file(uneven_gqa, tmp_path):
    """Found by an adversarial session: with swap_path every rank mapped the same file and wrote
    over the others' swapped blocks, so preempted requests came back with wrong tokens."""
    prompts = _prompts((20, 21, 22, 23, 24, 25))
    swap = dict(ENGINE, num_kv_blocks=12, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    ref = _greedy(LLM(str(uneven_gqa), **swap), prompts, max_tokens=40)
    llm = LLM(str(uneven_gqa), tensor_parallel_size=2, swap_path=str(tmp_path / "swap"), **swap)
    try:
        assert _greedy(llm, prompts, max_tokens=40) == ref
        assert llm.llm_engine.num_preemptions_total > 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["swap.rank0", "swap.rank1"]
    finally:
        llm.llm_engine.close()


def test_an_idle_engine_notices_a_closed_worker_connection():
    """A worker on another node has no local process to watch: an adversarial session killed one
    while the server was idle and /health answered 200 until the next request. The idle check
    now peeks at every rank's connection; a message waiting there is left unread."""
    from multiprocessing.connection import Client, Listener

    from pagedllm.executor.multiproc import _closed

    with Listener(("127.0.0.1", 0)) as listener:
        clients, conns = [], []
        for _ in range(3):
            clients.append(Client(listener.address))
            conns.append(listener.accept())
        assert _closed(conns) == []  # idle and open
        clients[1].send(("result", 1))
        clients[2].close()
        assert _closed(conns) == [conns[2]]
        assert conns[1].recv() == ("result", 1)  # (peeked, not consumed)
        clients[0].close()
        assert _closed(conns) == [conns[0], conns[2]]
