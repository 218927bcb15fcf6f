"""Worker processes for tensor / pipeline parallel models, started and watched by the engine.

Every rank is a separate process; the engine's process holds no weights and joins no
collective. That keeps the engine loop free to notice a dead worker: it only ever waits on
its control connections, together with the local workers' process sentinels, one second at
a time, so a worker that dies (killed, out of memory, crashed) turns into WorkerDeadError
within a second instead of a collective that never returns. (vLLM keeps rank 0 in the
engine's process to save one copy of the step; here the step is a small pickle, and a
uniform set of workers also serves a multi-node world the same way.)

Control channel: the engine listens on one TCP address (``multiprocessing.connection``, with
an authkey: random on one node, ``PAGEDLLM_DIST_AUTHKEY`` across nodes); local workers and those of
headless nodes connect to it and say their rank. Each step the engine sends the
SchedulerOutput to every rank; the tensors the ranks exchange go over torch.distributed (gloo).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait

import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.envs import env_flag
from pagedllm.executor.base import Executor, WorkerDeadError
from pagedllm.executor.worker import WorkerInit, no_delay, run_worker
from pagedllm.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagedllm.executor")

POLL_SECONDS = 1.0  # how often a waiting engine checks its workers are alive
STUCK_SECONDS = 10.0  # how long the other ranks may take to answer after one failed a step


def authkey(config: EngineConfig) -> bytes:
    """The control channel's key: a fresh random one on one node (handed to the workers it
    spawns), ``PAGEDLLM_DIST_AUTHKEY`` across nodes (the same secret on every node: whoever
    holds it can talk to the engine, and messages are pickles)."""
    env = os.environ.get("PAGEDLLM_DIST_AUTHKEY")
    if env:
        return env.encode()
    if config.nnodes == 1:
        return os.urandom(32)
    logger.warning("PAGEDLLM_DIST_AUTHKEY is not set: the nodes use a well-known key (set a shared secret)")
    return b"pagedllm"


def bind_error(host: str, port: int) -> OSError | None:
    """Why nothing could listen on host:port now (a ``socket.gaierror`` for the host), or None:
    a socket is bound there and released at once, so the caller can name its flag before
    starting what would bind it later."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a port in TIME_WAIT is free)
            s.bind(addr)
    except OSError as e:
        return e
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def control_address(config: EngineConfig) -> tuple[str, int]:
    """Where the engine's control channel listens: master_port + 1 on the master's address."""
    return config.master_addr, config.master_port + 1


def rank_threads(local_world: int, local_rank: int) -> tuple[int, list[int] | None]:
    """A rank's intra-op threads (``PAGEDLLM_NUM_THREADS`` each, else its share of the usable
    cores) and, with ``PAGEDLLM_PIN_THREADS=1``, the cores it is pinned to (its own slice)."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // local_world)
    env = os.environ.get("PAGEDLLM_NUM_THREADS")
    threads = int(env) if env else share
    cpus = None
    if env_flag("PAGEDLLM_PIN_THREADS", False):
        start = (local_rank * share) % len(cores)
        cpus = cores[start : start + share] or cores
    return threads, cpus


def _closed(conns: list[Connection]) -> list[Connection]:
    """The connections whose peer has closed them (readable, and a peek reads nothing); a
    message waiting to be read is left where it is."""
    closed = []
    for conn in wait(conns, timeout=0):
        try:
            with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    closed.append(conn)
        except BlockingIOError:
            pass
        except OSError:
            closed.append(conn)
    return closed


def start_local_workers(config: EngineConfig, address: tuple[str, int], key: bytes) -> list:
    """Spawn this node's workers (ranks node_rank * local .. + local - 1)."""
    local = config.world_size // config.nnodes
    ctx = mp.get_context("spawn")
    procs = []
    for local_rank in range(local):
        rank = config.node_rank * local + local_rank
        threads, cpus = rank_threads(local, local_rank)
        p = ctx.Process(target=run_worker, args=(rank, address, key, threads, cpus), daemon=True,
                        name=f"pagedllm-worker-{rank}")  # fmt: skip
        p.start()
        procs.append(p)
    return procs


class MultiprocExecutor(Executor):
    """Starts the workers, broadcasts each step, returns the last rank's output."""

    def __init__(self, config: EngineConfig, num_blocks: int, num_swap_blocks: int, max_model_len: int,
                 load_model: Callable, start_timeout: float = 900.0):  # fmt: skip
        """``load_model``: how a worker loads its shard (engine/startup.py's, handed down so
        the workers stay below the engine; pickled by reference)."""
        self.config = config
        self.world = config.world_size
        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if config.nnodes > 1:
            dist_addr, dist_port = config.master_addr, config.master_port
            listen = control_address(config)
        else:
            dist_addr = "127.0.0.1"
            dist_port = config.master_port or free_port()
            listen = ("127.0.0.1", config.master_port + 1 if config.master_port else 0)
            # (a port in use: said here, not as a worker's rendezvous traceback)
            if config.master_port and (error := bind_error(dist_addr, dist_port)) is not None:
                raise ValueError(f"master_port {dist_port} cannot be used on {dist_addr}: {error.strerror}")
        self._dead: str | None = None
        self._closed = False
        self._ready = False
        key = authkey(config)
        try:
            self._listener = Listener(listen, authkey=key)
        except OSError as e:
            raise ValueError(f"the control channel cannot listen on {listen[0]}:{listen[1]} (master_port + 1): {e.strerror}") from None
        self.procs = start_local_workers(config, self._listener.address, key)
        self.conns: list[Connection | None] = [None] * self.world
        self._allreduce_total = 0.0
        self._num_steps = 0
        # Steps collected (or abandoned: a collect interrupted, e.g. by Ctrl-C) and step answers
        # read from each rank: an abandoned step's late answers are skipped, not taken for the next's.
        self._collected = 0
        self._answered = [0] * self.world
        # Pipeline parallel: one batch per stage in flight (PAGEDLLM_PP_BATCH_QUEUE=0: one in all).
        overlap = self.pp > 1 and env_flag("PAGEDLLM_PP_BATCH_QUEUE", True)
        self.max_concurrent_batches = self.pp if overlap else 1
        try:
            self._accept_all(start_timeout)
            init = WorkerInit(config, num_blocks, num_swap_blocks, max_model_len, dist_addr, dist_port, load_model)
            self._broadcast(("init", init))
            self.worker_reports = [reply[1] for reply in self._recv_all(expect="ready")]
            self._ready = True
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._listener.close()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ liveness
    def check_alive(self) -> None:
        """Between steps: a local worker that exited, or any rank's connection closed (a
        worker on another node has no process here to watch: its death showed only at the next
        request, /health answering 200 meanwhile)."""
        if self._dead is None:
            self._check_local()
            for conn in _closed([c for c in self.conns if c is not None]):
                self._die(f"worker {self.conns.index(conn)}'s connection closed")

    def _check_local(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                hint = "" if self._ready else (" during startup (its log above says why; a script starting workers must "
                                               "guard its main: if __name__ == '__main__')")  # fmt: skip
                self._die(f"worker process {p.name} (pid {p.pid}) exited with status {p.exitcode}{hint}")

    def _die(self, reason: str) -> None:
        self._dead = reason
        logger.error("%s: the engine stops", reason)
        self.shutdown(graceful=False)
        raise WorkerDeadError(reason)

    def _accept_all(self, timeout: float) -> None:
        """Accept every rank's connection, watching the local workers meanwhile."""
        got: list[tuple[Connection, int]] = []
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                while len(got) < self.world:
                    conn = no_delay(self._listener.accept())
                    kind, rank = conn.recv()
                    got.append((conn, rank))
            except BaseException as e:  # the listener closed (startup failed)
                errors.append(e)

        t = threading.Thread(target=accept, daemon=True, name="pagedllm-accept")
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive():
            t.join(POLL_SECONDS)
            self._check_local()
            if time.monotonic() > deadline:
                self._die(f"only {len(got)} of {self.world} workers connected within {timeout:.0f} s")
        if errors:
            raise errors[0]
        for conn, rank in got:
            self.conns[rank] = conn

    def _recv_all(self, expect: str | None = None, step: int | None = None) -> list[tuple]:
        """Every rank's next message (in rank order), read as each arrives; WorkerDeadError as
        soon as a local worker dies or a connection closes. Once one rank answers "error" the
        others get STUCK_SECONDS, not forever: a rank that failed mid-step may leave its peers
        waiting for it in a collective, and those never answer (whichever rank failed: reading
        the ranks one by one waited on such a peer, with no deadline, when it came first)."""
        if self._dead is not None:
            raise WorkerDeadError(self._dead)
        replies: dict[int, tuple] = {}
        deadline: float | None = None
        sentinels = [p.sentinel for p in self.procs]
        while len(replies) < self.world:
            waiting = {self.conns[r]: r for r in range(self.world) if r not in replies}
            if deadline is not None and time.monotonic() > deadline:
                self._die(f"worker {min(waiting.values())} did not answer within {STUCK_SECONDS:.0f} s of a peer's "
                          "failure: stuck in a collective with it")  # fmt: skip
            ready = wait([*waiting, *sentinels], timeout=POLL_SECONDS)
            for conn in ready:
                if conn not in waiting:  # a sentinel: looked at once the answers are read
                    continue
                rank = waiting[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._check_local()
                    self._die(f"worker {rank}'s connection closed")
                if step is not None:
                    self._answered[rank] += 1
                    if self._answered[rank] <= step:  # an abandoned step's answer
                        continue
                if expect is not None and msg[0] != expect:
                    self._die(f"worker {rank} sent {msg[0]!r}, expected {expect!r}")
                replies[rank] = msg
                if msg[0] == "error" and deadline is None:
                    deadline = time.monotonic() + STUCK_SECONDS
            if any(x in sentinels for x in ready):
                self._check_local()
        return [replies[r] for r in range(self.world)]

    def _send(self, rank: int, data: bytes) -> None:
        if self._dead is not None:
            raise WorkerDeadError(self._dead)
        try:
            self.conns[rank].send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._check_local()
            self._die(f"worker {rank}'s connection closed")

    # ------------------------------------------------------------------ steps
    def _broadcast(self, msg: tuple, ranks: range | None = None) -> None:
        """One pickle of ``msg`` for every rank (``Connection.recv`` unpickles it). A plain
        pickle: tensors go by value. (``Connection.send``'s ForkingPickler would share a CPU
        tensor's storage through a handle that only one process can open - the step's grammar
        bitmask killed the second rank - and that no other node can open at all.)"""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for r in ranks if ranks is not None else range(self.world):
            self._send(r, data)

    def update_states(self, out: SchedulerOutput) -> None:
        self._broadcast(("update", out))

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(out)
        return self.collect()

    def submit(self, out: SchedulerOutput) -> None:
        self._broadcast(("execute", out))

    def collect(self) -> ModelRunnerOutput:
        """Every rank answers each execute in order: read the oldest one's answers."""
        step, self._collected = self._collected, self._collected + 1
        replies = self._recv_all(step=step)
        errors = [reply[1] for reply in replies if reply[0] == "error"]
        if errors and len(errors) < self.world:
            # Some ranks failed where others did not: their collectives no longer pair up.
            self._die(f"step failed on {len(errors)} of {self.world} workers only: {errors[0]}")
        if errors:  # every rank failed the same step: the engine may isolate the request
            raise RuntimeError(errors[0])
        self._allreduce_total += max(reply[2] for reply in replies)
        self._num_steps += 1
        result: ModelRunnerOutput = replies[-1][1]
        # Stages before the last learn the step's tokens (the last stage's TP ranks sampled them).
        if self.pp > 1:
            self._broadcast(("accept", result.req_ids, result.sampled), range(self.world - self.tp))
        return result

    def collective_stats(self) -> tuple[int, float]:
        return self._num_steps, self._allreduce_total

    def shutdown(self, graceful: bool = True) -> None:
        """Ask the workers to stop (``graceful``), else or after 5 s terminate them: a
        worker may be stuck in a collective with a dead peer."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            if conn is not None and graceful:
                try:
                    conn.send(("shutdown",))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (5 if graceful else 0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
        for conn in self.conns:
            if conn is not None:
                conn.close()


def run_headless(config: EngineConfig) -> int:
    """A worker node (``pagedllm serve --headless``): run this node's workers until they end
    (the engine on node 0 shuts them down, or its connection closes). Status 0 if all ended
    cleanly."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError("--headless runs the workers of a node_rank >= 1 of nnodes >= 2")
    procs = start_local_workers(config, control_address(config), authkey(config))
    logger.info("headless node %d: workers %s started", config.node_rank, [p.pid for p in procs])
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for p in procs:
            p.join()
    finally:  # SIGTERM / Ctrl-C here: the workers ignore SIGINT, so stop them
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return int(any(p.exitcode != 0 for p in procs))
