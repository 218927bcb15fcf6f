"""One worker process: its model shard, its KV-cache shard and a ModelRunner, driven by the
engine over one control connection.

Protocol (pickled tuples over a ``multiprocessing.connection``, in order):

    worker -> ("hello", rank)             engine -> ("init", WorkerInit)
    worker -> ("ready", report)           engine -> ("update", SchedulerOutput)   no reply
    engine -> ("execute", SchedulerOutput)    worker -> ("ok", ModelRunnerOutput | None, allreduce_s)
                                                        or ("error", message)
    engine -> ("accept", req_ids, sampled)    no reply (stages before the last)
    engine -> ("shutdown",)

Only the last rank sends its ModelRunnerOutput back (the others send None). A connection
that closes (the engine is gone) ends the worker; an error outside ``execute`` ends it with
status 1, which the engine sees as a dead worker.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Client, Connection

import torch

from pagedllm.config import EngineConfig
from pagedllm.logger import configure_logging

logger = logging.getLogger("pagedllm.worker")


@dataclass
class WorkerInit:
    """What the engine decided that every worker must agree on."""

    config: EngineConfig
    num_blocks: int
    num_swap_blocks: int
    max_model_len: int
    dist_addr: str
    dist_port: int
    load_model: Callable  # engine/startup.py's load_model(config, shard=..., tokenizer=False, trim=...)


def no_delay(conn: Connection) -> Connection:
    """Turn off Nagle's algorithm on a control connection. Each step is one small message each
    way; with Nagle on, a small write waiting for the peer's delayed ACK (up to 40 ms on Linux)
    made a one-token TP=2 step take 90 ms instead of a few."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket: options are shared
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(address: tuple[str, int], authkey: bytes, timeout: float) -> Connection:
    """The engine's control channel; a worker node may start before the engine listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return no_delay(Client(address, authkey=authkey))
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight form the model holds (dense, panels, GGUF blocks), each storage once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or t.device.type == "meta":
            return
        key = t.data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for module in model.modules():
        for p in module.parameters(recurse=False):
            add(p)
        for attr in ("panels", "packed"):
            add(getattr(module, attr, None))
        for seg in getattr(module, "quant", None) or []:
            add(seg.data)
        qweight = getattr(module, "qweight", None)
        if qweight is not None:
            add(qweight.data)
    return total


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_worker(rank: int, address: tuple[str, int], authkey: bytes, num_threads: int, cpus: list[int] | None,
               connect_timeout: float = 600.0) -> None:  # fmt: skip
    """The worker process's main (a spawn target)."""
    configure_logging(f"[rank {rank}] ")
    # Ctrl-C reaches the whole process group: the engine decides when workers stop (they also
    # stop when its connection closes), so a graceful server shutdown is not a "dead worker".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The engine's process gone (SIGKILL, OOM killer) while this rank hangs, or waits in a
    # collective for one that does: no control message ever ends it, so its parent's end must.
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True, name="pagedllm-parent-watch").start()
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.environ["PAGEDLLM_NUM_THREADS"] = str(num_threads)
    from pagedllm.threads import configure_threads

    configure_threads()
    conn = connect(address, authkey, connect_timeout)
    try:
        conn.send(("hello", rank))
        kind, init = conn.recv()
        assert kind == "init", kind
        runner, ctx, report = _build(rank, init)
        conn.send(("ready", report))
        _serve(conn, runner, ctx, rank == init.config.world_size - 1, injected_fault(rank))
    except EOFError:  # the engine is gone
        pass
    except BaseException:
        logger.exception("worker %d failed", rank)
        sys.exit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def own_swap_path(path: str | None, suffix: str) -> str | None:
    """A process's own swap file: ranks (and data-parallel replicas) mapping one file wrote
    over each other's swapped blocks (found by an adversarial session: wrong tokens, no error)."""
    return None if path is None else f"{path}.{suffix}"


def _build(rank: int, init: WorkerInit):
    from pagedllm.distributed import pipeline, tensor_parallel
    from pagedllm.distributed.parallel_state import RankInfo, init_parallel
    from pagedllm.distributed.sharding import shard_state, vocab_range
    from pagedllm.runner.model_runner import ModelRunner

    config = init.config
    info = RankInfo(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    ctx = init_parallel(info, init.dist_addr, init.dist_port)
    shard = partial(shard_state, tp_rank=info.tp_rank, tp=info.tp, pp_rank=info.pp_rank, pp=info.pp)
    trim = partial(pipeline.release_unused, info=info) if info.pp > 1 else None
    loaded = init.load_model(config, shard=shard, tokenizer=False, trim=trim)
    model = loaded.model
    if info.tp > 1:
        tensor_parallel.install(model, ctx, vocab_range(loaded.arch.vocab_size, info.tp_rank, info.tp)[0], loaded.arch.vocab_size)
    if info.pp > 1:
        pipeline.install(model, ctx)
    runner = ModelRunner(
        model, num_blocks=init.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_model_len=init.max_model_len, dtype=config.torch_dtype, attention_backend=config.attention_backend,
        seed=config.seed, num_swap_blocks=init.num_swap_blocks, swap_path=own_swap_path(config.swap_path, f"rank{rank}"),
        kv_cache_dtype=config.kv_cache_dtype,
    )  # fmt: skip
    runner.samples = info.is_last_stage
    a = model.arch
    report = {
        "rank": rank, "tp_rank": info.tp_rank, "pp_rank": info.pp_rank, "weight_bytes": model_weight_bytes(model),
        "rss_bytes": rss_bytes(), "dense_copy": loaded.dense_copy, "num_heads": a.num_heads,
        "num_kv_heads": a.num_kv_heads, "num_layers": a.num_layers, "threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }  # fmt: skip
    logger.info("rank %d (tp %d, pp %d): %d query / %d KV heads, %d layers, weights %.1f MiB, RSS %.1f MiB, "
                "%d threads on cpus %s", rank, info.tp_rank, info.pp_rank, a.num_heads, a.num_kv_heads, a.num_layers,
                report["weight_bytes"] / 2**20, report["rss_bytes"] / 2**20, report["threads"], report["cpus"])  # fmt: skip
    return runner, ctx, report


def injected_fault(rank: int) -> tuple[int, str] | None:
    """Tests only: ``PAGEDLLM_WORKER_FAULT=R[,R...]:T[:MODE]`` makes ranks R fail every step
    that runs a prompt containing token T (the others go on into their collectives), as a
    fault on those ranks would: MODE ``raise`` (the default) or ``sleep`` (hang for ever).
    Unset: None, and the step pays one ``is None`` test."""
    spec = os.environ.get("PAGEDLLM_WORKER_FAULT")
    if not spec:
        return None
    fault_ranks, token, *mode = spec.split(":")
    return (int(token), mode[0] if mode else "raise") if str(rank) in fault_ranks.split(",") else None


def _serve(conn: Connection, runner, ctx, returns_output: bool, fault: tuple[int, str] | None = None) -> None:
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "update":
            runner.update_states(msg[1])
        elif kind == "execute":
            ctx.allreduce_seconds = 0.0
            try:
                if fault is not None and any(fault[0] in runner.requests[x.req_id].prompt_token_ids for x in msg[1].scheduled):
                    if fault[1] == "sleep":
                        time.sleep(10**6)
                    raise RuntimeError("injected fault (PAGEDLLM_WORKER_FAULT)")
                result = runner.execute(msg[1])
            except Exception as e:  # the engine isolates it (every rank saw the same step)
                logger.warning("step failed: %s: %s", type(e).__name__, e)
                conn.send(("error", f"{type(e).__name__}: {e}"))
                continue
            conn.send(("ok", result if returns_output else None, ctx.allreduce_seconds))
        elif kind == "accept":
            runner.accept(msg[1], msg[2])
        elif kind == "shutdown":
            return
        else:
            raise ValueError(f"unknown command {kind!r}")
