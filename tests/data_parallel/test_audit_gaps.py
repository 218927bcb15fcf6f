"""DP routing, accounting and death, and the executor's step collection, pinned with fakes (no
processes): which replica an abort / a LoRA load / a shutdown reaches, the balancer's counts
of each replica's requests, the merged gauges, death failing every pending request, and the
balancer's prefix memory. Each was left open by the process-level tests (found by mutation)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from pagedllm import SamplingParams
from pagedllm.data_parallel.client import DPAsyncLLM
from pagedllm.data_parallel.core_proc import ReplicaReport
from pagedllm.data_parallel.cpu_share import replica_cpu_share
from pagedllm.data_parallel.load_balancer import BalancerConfig, LoadBalancer
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.input_processor import ProcessedRequest
from pagedllm.engine.stats import StepStats
from pagedllm.executor.base import WorkerDeadError
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from tests.conftest import within

BS = 4


class _Replica:
    """Records what is sent to it; answers "add" and "call" as a replica would (from another
    thread, once the client has released its lock)."""

    def __init__(self, llm: DPAsyncLLM, rank: int):
        self.llm, self.rank, self.sent, self._threads, self.pid = llm, rank, [], [], 1000 + rank

    def send(self, cmd: tuple) -> None:
        self.sent.append(cmd)
        if cmd[0] in ("add", "call"):
            t = threading.Thread(target=self.llm._on_message, args=(self.rank, ("reply", cmd[1], True, None)))
            t.start()
            self._threads.append(t)

    def kinds(self) -> list[tuple]:
        return [c for c in self.sent if c[0] != "add"]


def _llm(size: int = 2) -> DPAsyncLLM:
    """A DPAsyncLLM with fake replicas and a processor that takes token ids as they are."""
    llm = object.__new__(DPAsyncLLM)
    llm.data_parallel_size = size
    llm.max_waiting_requests = None
    llm.dead = None
    llm.on_dead, llm.output_hooks, llm.request_hooks, llm._stat_loggers = [], [], [], []
    llm._lock = threading.Lock()
    llm._streams, llm._calls = {}, {}
    llm._call_ids = itertools.count()
    llm._stopped = False
    llm._death_reason, llm._lora_counts = {}, {}
    llm.reports = [ReplicaReport(0, 0, 0.0) for _ in range(size)]
    llm.balancer = LoadBalancer(size, BalancerConfig(block_size=BS))
    llm.replicas = [_Replica(llm, r) for r in range(size)]
    llm._workers = ThreadPoolExecutor(1)
    process = lambda p, sp, prio: ProcessedRequest(None, list(p["prompt_token_ids"]), sp, prio)  # noqa: E731
    llm.engine = SimpleNamespace(processor=SimpleNamespace(process=process))
    return llm


def _out(rid: str, finished: bool) -> RequestOutput:
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", [1], finish_reason="length" if finished else None)], finished)


SP = SamplingParams(max_tokens=4)


def _add(llm: DPAsyncLLM, prompts: list[list[int]], ids: list[str], lora: LoRARequest | None = None):
    return llm.add_requests([{"prompt_token_ids": p} for p in prompts], SP, ids, lora_request=lora)


def test_abort_reaches_the_replica_that_owns_the_request():
    """An abort (a client that left) must reach the replica running the request, else the
    request keeps running there and holds its blocks."""
    llm = _llm()
    llm.balancer.loads[0].kv_cache_usage = 0.9  # replica 1 is the least loaded

    async def main() -> None:
        await _add(llm, [[1, 2, 3]], ["a"])
        llm.abort("a")

    asyncio.run(main())
    assert llm._streams["a"][0] == 1
    assert llm.replicas[1].kinds() == [("abort", "a")] and llm.replicas[0].sent == []


def test_each_replica_counts_its_own_requests_until_they_finish():
    """A batch of k prompts adds k to its replica's count, and each finished request takes one
    off that replica (not another): the counts steer the balancer and are the per-replica gauge."""
    llm = _llm()
    llm.balancer.loads[0].kv_cache_usage = 0.9

    async def main() -> list:
        streams = await _add(llm, [[1], [2], [3]], ["a", "b", "c"])
        assert [n for n, _ in llm.replica_loads()] == [0, 3]
        llm._deliver([_out("a", False)])  # not finished: still in flight
        assert llm.num_in_flight() == 3 and [n for n, _ in llm.replica_loads()] == [0, 3]
        llm._deliver([_out("a", True), _out("b", True), _out("c", True)])
        finished = []
        for s in streams:
            finished.append([o.finished async for o in s])
        return finished

    assert asyncio.run(main()) == [[False, True], [True], [True]]
    assert llm.num_in_flight() == 0 and [n for n, _ in llm.replica_loads()] == [0, 0]


def test_duplicate_ids_in_one_batch_are_refused():
    """Two prompts with one id would share one stream entry: one request's outputs lost and its
    replica's count never back to zero."""
    llm = _llm()
    with pytest.raises(ValueError, match="already in use"):
        asyncio.run(_add(llm, [[1], [2]], ["x", "x"]))
    assert llm.num_in_flight() == 0 and all(r.sent == [] for r in llm.replicas)


def test_lora_requests_get_no_affinity_from_base_model_prefixes():
    """The adapter's id salts the prefix hashes: a LoRA request does not follow a base-model
    request with the same prompt to its replica (their KV blocks differ)."""
    llm = _llm()
    prompt = list(range(10, 10 + 2 * BS))

    async def main() -> None:
        await _add(llm, [prompt], ["base"])  # -> 0, which now counts one request
        await _add(llm, [prompt], ["lora"], LoRARequest("ad", 1, "/nowhere"))

    asyncio.run(main())
    assert (llm._streams["base"][0], llm._streams["lora"][0]) == (0, 1)


def test_replica_reports_merge_into_the_gauges_and_the_balancer():
    """Running / waiting are summed over the replicas, KV usage is their mean, and each report
    is its own replica's (also the balancer's view of that replica's KV usage)."""
    llm = _llm()
    llm._on_message(0, ("step", [], [], ReplicaReport(1, 1, 0.25)))
    llm._on_message(1, ("step", [], [], ReplicaReport(2, 3, 0.75)))
    assert (llm.num_running(), llm.num_waiting(), llm.kv_cache_usage()) == (3, 4, 0.5)
    assert [u for _, u in llm.replica_loads()] == [0.25, 0.75]


def test_a_replicas_stat_logger_sees_only_that_replicas_steps():
    llm = _llm()
    every, one = [], []
    llm.add_stat_logger(SimpleNamespace(record=every.append))
    llm.add_stat_logger(SimpleNamespace(record=one.append), replica=1)
    stats = [StepStats(i, 0, 0, 0, 0.0, 0) for i in range(2)]
    for rank in (0, 1):
        llm._on_message(rank, ("step", [], [stats[rank]], ReplicaReport(0, 0, 0.0)))
    assert every == stats and one == [stats[1]]


def test_a_dead_replica_fails_every_pending_request_and_call():
    """A replica reporting its death: every stream (on any replica) ends with EngineDeadError
    instead of waiting forever, pending calls fail, counts go back to zero, on_dead runs."""
    llm = _llm()
    llm.balancer.loads[0].kv_cache_usage = 0.9
    seen = []
    llm.on_dead.append(seen.append)

    async def main() -> list:
        await _add(llm, [[1]], ["on1"])
        llm.balancer.loads[0].kv_cache_usage = 0.0
        llm.balancer.loads[1].kv_cache_usage = 0.9
        await _add(llm, [[2]], ["on0"])
        assert [llm._streams[rid][0] for rid in ("on1", "on0")] == [1, 0]
        queues = [llm._streams[rid][1].queue for rid in ("on1", "on0")]
        _, pending = llm._new_call()
        llm._on_message(1, ("dead", "boom"))
        assert isinstance(pending.exception(timeout=0), EngineDeadError)
        await asyncio.sleep(0)  # (the streams' puts are scheduled on this loop)
        return [q.get_nowait() if not q.empty() else None for q in queues]

    ends = asyncio.run(main())
    assert all(isinstance(e, EngineDeadError) and "replica 1 died: boom" in str(e) for e in ends), ends
    assert llm.num_in_flight() == 0 and [n for n, _ in llm.replica_loads()] == [0, 0]
    assert len(seen) == 1 and not llm.balancer.loads[1].alive and llm.balancer.loads[0].alive
    with pytest.raises(EngineDeadError):
        asyncio.run(_add(llm, [[3]], ["late"]))


def test_abort_all_and_lora_loads_reach_every_replica():
    llm = _llm(3)
    llm.abort_all()
    lora = LoRARequest("ad", 1, "/nowhere")
    llm._add_lora_everywhere(lora)
    for r in llm.replicas:
        assert r.kinds()[0] == ("abort_all",)
        engine = SimpleNamespace(add_lora=lambda req: ("loaded", req))
        assert [c[2](engine) for c in r.kinds()[1:]] == [("loaded", lora)]


# ---------------------------------------------------------------- the balancer's prefix memory
def _lb(n: int = 2, **kw) -> LoadBalancer:
    return LoadBalancer(n, BalancerConfig(block_size=BS, **kw))


def test_every_block_of_a_served_prefix_is_remembered():
    """a+b on 0, then a+c spread to 1: a+b's longer chain still says 0 (its blocks are cached
    there), though the shared first block was last served by 1."""
    lb = _lb(2, affinity_margin=4)
    a, b, c = [1] * BS, [2] * BS, [3] * BS
    assert lb.choose(a + b) == 0
    lb.loads[0].num_requests = 5  # beyond the margin: a+c goes elsewhere
    assert lb.choose(a + c) == 1
    lb.loads[0].num_requests = 1
    assert lb.choose(a + b + [9]) == 0


def test_an_overloaded_owner_sends_the_prompt_to_the_least_loaded_replica():
    """The longest remembered chain decides; when its owner is too busy the prompt goes to the
    least loaded replica, not to the owner of a shorter chain."""
    lb = _lb(3, affinity_margin=4)
    a, b = [1] * BS, [2] * BS
    lb._owner[lb.prefix_hashes(a)[0]] = 2
    lb._owner[lb.prefix_hashes(a + b)[1]] = 0
    lb.loads[0].num_requests = 10
    lb.loads[2].num_requests = 1
    assert lb.choose(a + b) == 1


def test_prefix_memory_forgets_the_least_recently_used():
    lb = _lb(2, max_remembered=3)
    q = [[i] * BS for i in range(5)]
    for p in q[:3]:
        lb.choose(p)
    lb.choose(q[0])  # used again: now the most recent
    lb.choose(q[3])
    remembered = [lb.prefix_hashes(p)[0] in lb._owner for p in q[:4]]
    assert remembered == [True, False, True, True]


def test_only_full_blocks_are_hashed():
    """Like the prefix cache, which only caches full blocks."""
    assert len(_lb().prefix_hashes([1] * (BS + BS // 2))) == 1


# ---------------------------------------------------------------- cores
def test_pinned_replicas_never_share_a_core_whatever_their_thread_count():
    """PAGEDLLM_NUM_THREADS=3 with two replicas on two cores: each is still pinned to its own core."""
    shares = [replica_cpu_share(r, 2, [0, 1], num_threads=3, pin=True) for r in range(2)]
    assert [s.cpus for s in shares] == [(0,), (1,)] and all(s.num_threads == 3 for s in shares)


def test_zero_threads_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        replica_cpu_share(0, 2, [0, 1], num_threads=0)


# ---------------------------------------------------------------- the executor's step collection
def _executor(replies: list[tuple | None], world: int = 2) -> MultiprocExecutor:
    """An executor whose rank r has already sent replies[r] down its pipe (None: nothing)."""
    ex = object.__new__(MultiprocExecutor)
    ex.world, ex.pp, ex.tp = world, 1, world
    ex._dead, ex._closed, ex._ready = None, True, True  # (closed: _die's shutdown has nothing to stop)
    ex._allreduce_total, ex._num_steps = 0.0, 0
    ex._collected, ex._answered = 0, [0] * world
    ex.procs, ex.conns, ex._worker_ends = [], [], []
    for reply in replies:
        ours, theirs = Pipe()
        if reply is not None:
            theirs.send(reply)
        ex.conns.append(ours)
        ex._worker_ends.append(theirs)  # (kept open: a closed end reads as a dead worker)
    return ex


def test_collect_returns_the_last_ranks_output_and_the_slowest_all_reduce():
    ex = _executor([("ok", "rank0", 0.1), ("ok", "rank1", 0.3)])
    assert ex.collect() == "rank1"
    assert ex.collective_stats() == (1, 0.3)


def test_a_step_failed_by_every_rank_is_an_error_by_some_a_death():
    """Every rank failing the same step may be one bad request (the engine isolates it); some
    ranks only means their collectives no longer pair up: the workers are dead."""
    with pytest.raises(RuntimeError, match="bad") as e:
        _executor([("error", "bad"), ("error", "bad")]).collect()
    assert not isinstance(e.value, WorkerDeadError)
    with pytest.raises(WorkerDeadError, match="1 of 2"):
        _executor([("ok", None, 0.0), ("error", "bad")]).collect()


@pytest.mark.parametrize("failed", [0, 1])
def test_a_rank_stuck_behind_a_failed_peer_gets_a_deadline_whichever_rank_failed(monkeypatch, failed):
    """The healthy rank waits in a collective for the failed one and never answers. When the
    failed rank was not the first, the executor waited for the healthy one with no deadline."""
    import pagedllm.executor.multiproc as multiproc

    monkeypatch.setattr(multiproc, "STUCK_SECONDS", 0.2)
    replies: list[tuple | None] = [None, None]
    replies[failed] = ("error", "bad")
    with pytest.raises(WorkerDeadError, match=f"worker {1 - failed} did not answer"):
        within(10, _executor(replies).collect)


def test_a_local_worker_that_exited_is_noticed_between_steps():
    ex = _executor([])
    ex.procs = [SimpleNamespace(is_alive=lambda: True, name="w0", pid=1, exitcode=None),
                SimpleNamespace(is_alive=lambda: False, name="w1", pid=2, exitcode=-9)]  # fmt: skip
    with pytest.raises(WorkerDeadError, match="w1.*-9"):
        ex.check_alive()
