"""One data-parallel replica: an LLMEngine stepping in its own process.

The API process sends commands over a pipe (pickled tuples) and reads messages back:

    API -> replica:  ("add", call_id, [(request_id, ProcessedRequest)], max_waiting, RequestOutputKind)
                     ("abort", request_id) | ("abort_all",) | ("call", call_id, fn) | ("stop",)
    replica -> API:  ("ready", EngineFacts) once loaded
                     ("step", [RequestOutput], [StepStats], ReplicaReport) after each step,
                     and about once a second while idle (the stats of the state alone)
                     (outputs without their prompt: the API process has it)
                     ("outputs", [RequestOutput], [StepStats], ReplicaReport) for outputs
                     between steps (an abort's stats with them)
                     ("reply", call_id, ok, value) for "add" and "call"
                     ("dead", reason) before exiting on a fault it cannot pin on a request

Inputs arrive validated and tokenized (the API process runs the InputProcessor), so a replica
only queues and steps. The replica exits when its command pipe closes: an API process that
dies never leaves replicas behind. It ignores SIGINT (a terminal's Ctrl-C reaches the whole
process group): the API process runs the graceful shutdown and then sends "stop".
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.data_parallel.cpu_share import CpuShare
from pagedllm.engine.errors import check_queue_room
from pagedllm.engine.input_processor import ProcessedRequest
from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.engine.stats import StepStats
from pagedllm.model.arch import ModelArch
from pagedllm.model.loader import ModelSource
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm.engine")


@dataclass
class EngineFacts:
    """What the API process needs to validate and tokenize without loading the weights."""

    source: ModelSource
    arch: ModelArch
    eos_token_ids: frozenset[int]
    max_model_len: int
    num_kv_blocks: int
    pid: int
    longest_context: int  # the longest prompt + output the replica's KV pool holds


@dataclass
class ReplicaReport:
    """The replica's load after a step, for the balancer and the server's gauges."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineCore:
    """The replica's loop: drain commands, step while there is work, send what came out."""

    def __init__(self, engine: Any, conn: Connection, commands: Connection):
        self.engine = engine
        self.conn = conn
        self.commands = commands
        self._send_lock = threading.Lock()  # the KV connector's saver thread may send too
        self._live: set[str] = set()  # request ids added and not finished
        self._step_stats: list[StepStats] = []
        engine.stat_loggers.append(self)

    def record(self, stats: StepStats) -> None:  # a stat logger of the engine
        self._step_stats.append(stats)

    def take_stats(self) -> list[StepStats]:
        """What the engine reported since the last message: after a step, an abort, or idling."""
        stats, self._step_stats = self._step_stats, []
        return stats

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def report(self) -> ReplicaReport:
        engine = self.engine
        return ReplicaReport(engine.num_running(), engine.num_waiting(), engine.kv_cache_manager.usage())

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if self.commands.poll(0 if busy else 1.0):
                while self.commands.poll(0):
                    cmd = pickle.loads(self.commands.recv_bytes())  # EOFError: the API process is gone
                    if cmd[0] == "stop":
                        return
                    self.handle(cmd)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self.deliver("step", outputs, self.take_stats())
            elif not busy:  # idle for a while: the state (and saves finished since) go out anyway
                engine.report_idle()
                self.deliver("step", [], self.take_stats())

    def handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, call_id, items, max_waiting, output_kind = cmd
            try:
                self.add_all(items, max_waiting, output_kind)
            except Exception as e:
                self.send(("reply", call_id, False, _picklable(e)))
                return
            self.send(("reply", call_id, True, None))
        elif kind == "call":
            _, call_id, fn = cmd
            try:
                result = fn(self.engine)
            except Exception as e:
                self.send(("reply", call_id, False, _picklable(e)))
                return
            self.send(("reply", call_id, True, result))
        elif kind == "abort":
            if cmd[1] in self._live:
                self.deliver("outputs", self.engine.abort_request(cmd[1]), self.take_stats())
        elif kind == "abort_all":
            for request_id in list(self._live):
                self.deliver("outputs", self.engine.abort_request(request_id), self.take_stats())

    def add_all(self, items: list[tuple[str, ProcessedRequest]], max_waiting: int | None,
                output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> None:  # fmt: skip
        """Add every item or none (a failure withdraws the ones already added)."""
        adding = sum(processed.queue_entries for _, processed in items)
        check_queue_room(self.engine.num_waiting(), adding, max_waiting, " in this replica")
        added: list[str] = []
        try:
            for request_id, processed in items:
                if request_id in self._live:
                    raise ValueError(f"request_id {request_id!r} is already in use")
                self.engine.add_request(processed, request_id=request_id, output_kind=output_kind)
                self._live.add(request_id)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self._live.discard(request_id)
                self.engine.abort_request(request_id)
            raise

    def deliver(self, kind: str, outputs: list[RequestOutput], stats: list[StepStats]) -> None:
        connector = self.engine.kv_connector
        now: list[RequestOutput] = []
        for out in map(_without_prompt, outputs):
            if out.finished:
                self._live.discard(out.request_id)
            if out.finished and connector is not None and connector.config.holds_outputs:
                # A producer answers once the request's blocks are in the store.
                connector.when_saved(lambda o=out: self.send(("outputs", [o], [], self.report())))
            else:
                now.append(out)
        if now or stats:
            self.send((kind, now, stats, self.report()))


def _without_prompt(out: RequestOutput) -> RequestOutput:
    """The output without its prompt, which every delta repeats: the API process has it and puts
    it back (DPAsyncLLM._deliver), so a long prompt does not cross the pipe every step."""
    return replace(out, prompt=None, prompt_token_ids=[])


def run_replica(rank: int, size: int, config: EngineConfig, share: CpuShare, conn: Connection,
                commands: Connection, log_stats_interval: float) -> None:  # fmt: skip
    """The replica process's entry point (multiprocessing spawn)."""
    # Ctrl-C reaches the whole process group; the API process decides how to shut down (grace
    # period, then "stop"), so a replica must not die of it and look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["PAGEDLLM_NUM_THREADS"] = str(share.num_threads)
    if share.cpus is not None:
        os.sched_setaffinity(0, share.cpus)
    from pagedllm.logger import configure_logging
    from pagedllm.threads import configure_threads

    configure_logging()
    for handler in logging.getLogger("pagedllm").handlers:  # tell the replicas' log lines apart
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s [dp{rank}] [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S"))
    configure_threads()
    try:
        from pagedllm.engine.llm_engine import LLMEngine
        from pagedllm.executor.worker import own_swap_path

        if config.swap_path is not None:  # one file per replica (its ranks add their own suffix)
            config = replace(config, swap_path=own_swap_path(config.swap_path, f"dp{rank}"))
        engine = LLMEngine(config, log_stats_interval=log_stats_interval)
        facts = EngineFacts(engine.source, engine.arch, engine.eos_token_ids, engine.max_model_len,
                            engine.kv_cache_manager.num_blocks, os.getpid(), engine.processor.longest_context)  # fmt: skip
        conn.send(("ready", facts))
        logger.info("data-parallel replica %d/%d ready (pid %d, %d threads%s)", rank, size, os.getpid(),
                    share.num_threads, f", cores {list(share.cpus)}" if share.cpus else "")  # fmt: skip
        EngineCore(engine, conn, commands).run()
    except (EOFError, BrokenPipeError):  # the API process is gone
        sys.exit(0)
    except BaseException as e:  # startup failed, or a fault the engine could not pin on a request
        logger.critical("data-parallel replica %d died: %s: %s", rank, type(e).__name__, e, exc_info=e)
        try:
            conn.send(("dead", f"{type(e).__name__}: {e}"))
        except Exception:
            pass
        sys.exit(1)
    try:
        engine.close()
    finally:
        sys.exit(0)
