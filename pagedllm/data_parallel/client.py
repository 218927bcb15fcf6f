"""DPAsyncLLM: AsyncLLM's interface over N replica processes behind one load balancer.

The API process validates and tokenizes (``EngineFrontend``), picks a replica
(``LoadBalancer``: load and prefix affinity), and sends the request there; one reader thread
receives every replica's outputs and step stats and feeds the request streams, the stat
loggers (Prometheus) and the balancer's view of each replica's load.

Death: a replica that exits - a fault it could not pin on a request, a crash, a kill - is
noticed through its pipe's EOF and its process sentinel (never by waiting on it forever). The
engine is then dead as a whole, as AsyncLLM's is: every pending request fails with
EngineDeadError, new ones are refused, and the ``on_dead`` callbacks run (the server answers
503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any, AsyncIterator, Callable

from pagedllm.config import EngineConfig
from pagedllm.data_parallel.core_proc import EngineFacts, ReplicaReport
from pagedllm.data_parallel.cpu_share import share_from_env
from pagedllm.data_parallel.frontend import EngineFrontend
from pagedllm.data_parallel.load_balancer import BalancerConfig, LoadBalancer
from pagedllm.data_parallel.replica import ReplicaProcess
from pagedllm.engine.async_llm import RequestStreams, _Stream
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.input_processor import ProcessedRequest, PromptType
from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.engine.stats import StepStats
from pagedllm.logger import configure_logging
from pagedllm.lora.request import LoRARequest
from pagedllm.model.loader import resolve_model
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm.engine")

DEFAULT_STARTUP_TIMEOUT = 600.0  # seconds for every replica to load its model


class DPAsyncLLM(RequestStreams):
    """``data_parallel_size`` engine replicas in processes, used like one AsyncLLM."""

    def __init__(
        self,
        config: EngineConfig,
        log_stats_interval: float = 5.0,
        max_waiting_requests: int | None = None,
        num_input_workers: int = 2,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ):
        configure_logging()
        source = resolve_model(config.model)  # a bad model path is a ValueError before any process starts
        size = config.data_parallel_size
        self.data_parallel_size = size
        # Per replica: a replica refuses new requests while this many wait in its own queue.
        self.max_waiting_requests = max_waiting_requests
        self.dead: BaseException | None = None
        self.on_dead: list[Callable[[BaseException], None]] = []
        self.output_hooks: list[Any] = []
        self.request_hooks: list[Any] = []  # hook(request_id, ProcessedRequest) per accepted request
        self._stat_loggers: list[tuple[Any, int | None]] = []
        self._lock = threading.Lock()  # streams, calls, balancer state, death
        self._streams: dict[str, tuple[int, _Stream, ProcessedRequest]] = {}  # request id -> replica, stream, input
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._stopped = False
        self._death_reason: dict[int, str] = {}
        self._lora_counts: dict[int, tuple[dict[str, int], dict[str, int]]] = {}  # replica -> its latest
        self.reports = [ReplicaReport(0, 0, 0.0) for _ in range(size)]
        self.balancer = LoadBalancer(size, BalancerConfig(block_size=config.block_size))
        self.replicas = [ReplicaProcess(r, size, config, share_from_env(r, size), log_stats_interval) for r in range(size)]
        # Before multiprocessing's own exit hook joins the (non-daemon) replicas: stop them.
        atexit.register(self._stop_replicas)
        self._workers = ThreadPoolExecutor(max_workers=num_input_workers, thread_name_prefix="pagedllm-input")
        # The API process's tokenizer loads while the replicas load their models.
        tokenizer = self._workers.submit(load_tokenizer, source)
        try:
            facts = self._wait_ready(startup_timeout)
            self.engine = EngineFrontend(config, facts, self._add_lora_everywhere, tokenizer.result())
        except BaseException:
            self._stop_replicas()
            self._workers.shutdown(wait=False, cancel_futures=True)
            raise
        self._reader = threading.Thread(target=self._read_loop, name="pagedllm-dp-reader", daemon=True)
        self._reader.start()
        logger.info("data parallel: %d replicas ready (pids %s; %d KV blocks each)", size,
                    ", ".join(str(p) for p in self.replica_pids()), facts.num_kv_blocks)  # fmt: skip

    # ------------------------------------------------------------------ startup
    def _wait_ready(self, timeout: float) -> EngineFacts:
        facts: dict[int, EngineFacts] = {}
        deadline = time.monotonic() + timeout
        while len(facts) < len(self.replicas):
            pending = [r for r in self.replicas if r.rank not in facts]
            ready = wait([r.conn for r in pending] + [r.sentinel for r in pending], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(f"data-parallel replicas {[r.rank for r in pending]} did not start in {timeout:.0f} s")
            for r in pending:
                if r.conn in ready or r.sentinel in ready:
                    try:
                        msg = r.conn.recv()
                    except (EOFError, OSError):
                        r.process.join(timeout=5)
                        msg = ("dead", f"exited with code {r.process.exitcode} (see its log above)")
                    if msg[0] != "ready":
                        raise RuntimeError(f"data-parallel replica {r.rank} failed to start: {msg[1]}")
                    facts[r.rank] = msg[1]
        return facts[0]

    # ------------------------------------------------------------------ the AsyncLLM interface
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def replica_pids(self) -> list[int]:
        return [r.pid or 0 for r in self.replicas]

    def _new_call(self) -> tuple[int, concurrent.futures.Future]:
        call_id, fut = next(self._call_ids), concurrent.futures.Future()
        self._calls[call_id] = fut
        return call_id, fut

    async def add_requests(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams,
        request_ids: list[str],
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue several prompts on one replica in one command (all or none); their streams.

        The replica is the balancer's choice for the first prompt. Raises ValueError for bad
        input (before routing), EngineOverloadedError when that replica's waiting queue is
        full, EngineDeadError when the engine is gone. A prompt may come already validated (a
        ProcessedRequest: ``sampling_params`` and ``priority`` are then its own).
        ``output_kind``: deltas (a server's streams) or only the final output (offline use).
        """
        self._check_alive()
        processor = self.engine.processor

        def process(p: PromptType | ProcessedRequest) -> ProcessedRequest:
            return p if isinstance(p, ProcessedRequest) else processor.process(p, sampling_params, priority)

        processed = await self.run_in_worker(lambda: [process(p) for p in prompts])
        for p in processed:
            p.lora_request = lora_request
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop) for _ in prompts]
        with self._lock:
            self._check_alive()
            taken = [rid for rid in request_ids if rid in self._streams]
            if taken or len(set(request_ids)) != len(request_ids):
                raise ValueError(f"request_id {(taken or request_ids)[0]!r} is already in use")
            salt = lora_request.lora_int_id if lora_request is not None else 0
            rank = self.balancer.choose(processed[0].prompt_token_ids, salt) if processed else 0
            for rid, stream, req in zip(request_ids, streams, processed):
                self._streams[rid] = (rank, stream, req)
            self.balancer.loads[rank].num_requests += len(request_ids)
            call_id, accepted = self._new_call()
            # The hooks run on the reader thread as the replica's "added" is read, before any
            # output of these requests (a done callback runs inside set_result).
            accepted.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                       or self._run_request_hooks(request_ids, processed))  # fmt: skip
            try:
                items = list(zip(request_ids, processed))
                self.replicas[rank].send(("add", call_id, items, self.max_waiting_requests, output_kind))
            except BaseException:
                self._calls.pop(call_id, None)
                self._forget(request_ids)
                raise
        try:
            # (shielded: a cancelled wait must not cancel ``accepted``, whose answer settles the ids)
            waiting = asyncio.wrap_future(accepted)
            await asyncio.shield(waiting)
        except asyncio.CancelledError:  # the caller left while the replica was adding them
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read: never "not retrieved")
            pairs = list(zip(request_ids, streams))

            def settle(fut: concurrent.futures.Future) -> None:
                # Added: abort them. Refused: nothing reached the replica (an abort would find
                # nothing there, and no final output would ever drop the entries): forget them.
                if fut.cancelled() or fut.exception() is not None:
                    with self._lock:
                        self._forget([rid for rid, s in pairs if rid in self._streams and self._streams[rid][1] is s])
                else:
                    for rid, s in pairs:
                        self._abort_stream(rid, s)

            accepted.add_done_callback(settle)
            raise
        except BaseException:  # refused: nothing was added
            with self._lock:
                self._forget(request_ids)
            raise
        return [self._outputs(rid, stream) for rid, stream in zip(request_ids, streams)]

    def _forget(self, request_ids: list[str]) -> None:
        """Drop streams (under the lock), keeping the balancer's counts right."""
        for rid in request_ids:
            entry = self._streams.pop(rid, None)
            if entry is not None:
                self.balancer.loads[entry[0]].num_requests -= 1

    def _send_call(self, rank: int, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        with self._lock:
            self._check_alive()
            call_id, done = self._new_call()
            try:
                self.replicas[rank].send(("call", call_id, fn))
            except Exception as e:
                self._calls.pop(call_id, None)
                raise TypeError(f"with data_parallel_size > 1 the function must be picklable (a module-level "
                                f"function, functools.partial, operator.methodcaller): {e}") from e  # fmt: skip
        return done

    async def call_in_engine(self, fn: Callable[[Any], Any], replica: int = 0) -> Any:
        """Run ``fn(engine)`` in replica ``replica``'s process between two steps; its result
        (or exception) comes back pickled, so ``fn`` and the result must be picklable."""
        return await asyncio.wrap_future(self._send_call(replica, fn))

    async def call_in_all_engines(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(engine)`` in every replica (loading a LoRA adapter); the results in rank order."""
        futures = [self._send_call(r, fn) for r in range(self.data_parallel_size)]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def _add_lora_everywhere(self, lora: LoRARequest) -> None:
        from operator import methodcaller

        futures = [self._send_call(r, methodcaller("add_lora", lora)) for r in range(self.data_parallel_size)]
        for f in futures:
            f.result(timeout=300)

    def _abort_stream(self, request_id: str, stream: _Stream | None) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is None or self.dead is not None or (stream is not None and entry[1] is not stream):
                return
            self.replicas[entry[0]].send(("abort", request_id))

    def abort_all(self) -> None:
        """End every request now (shutdown): each stream gets a final 'abort' output."""
        if self.dead is None:
            for r in self.replicas:
                r.send(("abort_all",))

    def add_stat_logger(self, stat_logger: Any, replica: int | None = None) -> None:
        """``stat_logger.record(StepStats)`` after each step of ``replica`` (None: every replica)."""
        self._stat_loggers.append((stat_logger, replica))

    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.reports)

    def num_running(self) -> int:
        return sum(r.num_running for r in self.reports)

    def kv_cache_usage(self) -> float:
        """The mean of the replicas' usage (their pools are the same size)."""
        return sum(r.kv_cache_usage for r in self.reports) / len(self.reports)

    def num_in_flight(self) -> int:
        return len(self._streams)

    def _steppers_alive(self) -> bool:
        return all(r.process.is_alive() for r in self.replicas)

    def replica_loads(self) -> list[tuple[int, float]]:
        """(requests routed and unfinished, KV usage) per replica."""
        return [(load.num_requests, load.kv_cache_usage) for load in self.balancer.loads]

    def shutdown(self) -> None:
        self._stopped = True
        self._stop_replicas()
        self._reader.join(timeout=5)
        self._workers.shutdown(wait=False, cancel_futures=True)
        error = EngineDeadError("the engine shut down")
        with self._lock:
            calls, self._calls = self._calls, {}
        for done in calls.values():
            if not done.done():
                done.set_exception(error)
        self._fail_all(error)

    def _stop_replicas(self) -> None:
        self._stopped = True
        atexit.unregister(self._stop_replicas)
        for r in self.replicas:
            r.request_stop()
        for r in self.replicas:
            r.stop()

    # ------------------------------------------------------------------ reader thread
    def _read_loop(self) -> None:
        watched = {r.rank: r for r in self.replicas}
        while watched:  # until every replica has closed its pipe (died, or stopped at shutdown)
            objs = [r.conn for r in watched.values()] + [r.sentinel for r in watched.values()]
            ready = wait(objs, timeout=1.0)
            for rank, r in list(watched.items()):
                if r.conn not in ready and r.sentinel not in ready:
                    continue
                try:
                    while r.conn.poll():
                        self._on_message(rank, r.conn.recv())
                    if r.sentinel not in ready:
                        continue
                except (EOFError, OSError):
                    pass
                except Exception as e:  # a bug here must not leave requests hanging
                    logger.exception("data-parallel reader failed")
                    self._die(EngineDeadError(f"data-parallel reader failed: {type(e).__name__}: {e}"))
                    return
                del watched[rank]  # EOF or exit: this replica will say nothing more
                self._on_exit(r)

    def _on_exit(self, r: ReplicaProcess) -> None:
        if self._stopped or r.rank in self._death_reason:
            return
        r.process.join(timeout=1)  # for its exit code
        self._replica_died(r.rank, f"exited with code {r.process.exitcode}")

    def _replica_died(self, rank: int, reason: str) -> None:
        logger.critical("data-parallel replica %d (pid %s) is gone: %s", rank, self.replicas[rank].pid, reason)
        with self._lock:
            self.balancer.loads[rank].alive = False
        self._die(EngineDeadError(f"data-parallel replica {rank} died: {reason}"))

    def _on_message(self, rank: int, msg: tuple) -> None:
        kind = msg[0]
        if kind in ("step", "outputs"):
            _, outputs, step_stats, report = msg
            self.reports[rank] = report
            self.balancer.loads[rank].kv_cache_usage = report.kv_cache_usage
            for stats in step_stats:
                stats = self._merge_lora(rank, stats)
                for stat_logger, replica in self._stat_loggers:
                    if replica is None or replica == rank:
                        stat_logger.record(stats)
            self._deliver(outputs)
        elif kind == "reply":
            _, call_id, ok, value = msg
            with self._lock:
                done = self._calls.pop(call_id, None)
            if done is not None and not done.done():
                done.set_result(value) if ok else done.set_exception(value)
        elif kind == "dead":  # it says so before exiting: fail everything now, not at its exit
            self._death_reason[rank] = msg[1]
            self._replica_died(rank, msg[1])

    def _merge_lora(self, rank: int, stats: StepStats) -> StepStats:
        """A step's per-adapter request counts are its replica's; the server's LoRA gauges
        want every replica's, so the step carries the sums of each replica's latest."""
        if stats.lora is None:
            return stats
        self._lora_counts[rank] = stats.lora
        running: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        for r, w in self._lora_counts.values():
            running.update(r)
            waiting.update(w)
        return replace(stats, lora=(dict(running), dict(waiting)))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                entry = self._streams.get(out.request_id)
                if entry is not None and out.finished:
                    self._forget([out.request_id])
            if entry is not None:  # the replica leaves the prompt out (core_proc._without_prompt)
                out.prompt, out.prompt_token_ids = entry[2].prompt, entry[2].prompt_token_ids
            for hook in self.output_hooks:
                hook(out)
            if entry is not None:
                entry[1].put(out)

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = error
            calls, self._calls = self._calls, {}
        for done in calls.values():
            if not done.done():
                done.set_exception(error)
        self._fail_all(error)
        for callback in self.on_dead:
            try:
                callback(error)
            except Exception:
                logger.exception("on_dead callback failed")

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = [s for _, s, _ in self._streams.values()]
            self._forget(list(self._streams))
        for stream in streams:
            stream.put(error)
