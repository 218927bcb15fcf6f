"""The API process's handle on one replica process: spawn it, send it commands, stop it.

Commands are pickled on the caller's thread (an unpicklable one fails there, at once) and
written by a sender thread, so the event loop never blocks on a pipe the replica is not
reading while it steps. Messages from the replica are read by the client's reader thread
(``conn``), which also watches ``sentinel`` to notice the process's exit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import queue
import threading
from multiprocessing.connection import Connection

from pagedllm.config import EngineConfig
from pagedllm.data_parallel.core_proc import run_replica
from pagedllm.data_parallel.cpu_share import CpuShare

logger = logging.getLogger("pagedllm.engine")


class ReplicaProcess:
    def __init__(self, rank: int, size: int, config: EngineConfig, share: CpuShare, log_stats_interval: float):
        self.rank = rank
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch or OpenMP state
        self.conn, child_conn = ctx.Pipe(duplex=False)  # replica -> API
        child_commands, self._commands = ctx.Pipe(duplex=False)  # API -> replica
        self.process = ctx.Process(
            target=run_replica,
            args=(rank, size, config, share, child_conn, child_commands, log_stats_interval),
            name=f"pagedllm-dp{rank}",
            # Not a daemon: a replica may start processes of its own (tensor / pipeline parallel
            # workers), which daemons may not. It still never outlives us: it exits when its
            # command pipe closes, and DPAsyncLLM stops it at exit.
            daemon=False,
        )
        self.process.start()
        # Only the replica holds these ends now: its exit (or ours) shows as EOF on the other side.
        child_conn.close()
        child_commands.close()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name=f"pagedllm-dp{rank}-send", daemon=True)
        self._sender.start()

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, cmd: tuple) -> None:
        """Queue a command; raises (pickle's error) if it cannot be sent to another process."""
        self._outbox.put(pickle.dumps(cmd))

    def _send_loop(self) -> None:
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self._commands.send_bytes(data)
            except (OSError, ValueError):  # the replica is gone; the reader reports its death
                return

    def request_stop(self) -> None:
        """Ask the replica to finish (it ends its current step first)."""
        if self.process.is_alive():
            self.send(("stop",))
        self._outbox.put(None)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the replica to finish, then make sure it is gone."""
        self.request_stop()
        self._sender.join(timeout=timeout)
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            logger.warning("data-parallel replica %d did not stop; killing it", self.rank)
            self.process.kill()
            self.process.join(timeout=5)
        self._commands.close()
