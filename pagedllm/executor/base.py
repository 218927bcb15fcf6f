"""The seam between the engine core and the model workers.

The engine core (scheduler, KV manager bookkeeping, output processing) stays single and
unaware of parallelism: each step it hands the executor the step as plain data and gets the
sampled tokens back. ``UniProcExecutor`` runs the one ModelRunner in the engine's process
(the default; nothing added per step), ``MultiprocExecutor`` worker processes holding the
shards of a tensor / pipeline parallel model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.scheduler.output import ModelRunnerOutput, SchedulerOutput


class WorkerDeadError(RuntimeError):
    """A worker process is gone (or its connection is): nothing more can run. The engine
    turns it into its EngineDeadError."""


class Executor(ABC):
    """Contract: ``update_states`` then ``execute`` for every step, in the scheduler's order;
    ``execute`` may be called again over a subset of the step's requests (the engine's fault
    isolation), so workers must only write the scheduled tokens' own K/V slots. A worker
    that is gone raises ``WorkerDeadError`` from either, never hangs."""

    #: the ModelRunner when it lives in this process (None with worker processes)
    runner = None
    #: what the workers reported at startup (weight bytes, RSS, ...), one dict per rank
    worker_reports: list[dict] = []

    @abstractmethod
    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's diff (new, finished, preempted requests; block moves)."""

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step's forward and sampling; the sampled tokens per scheduled request."""

    #: batches the engine may keep in flight (pipeline parallel: one per stage); with more than
    #: one it uses ``submit`` / ``collect`` instead of ``execute``
    max_concurrent_batches: int = 1

    def submit(self, out: SchedulerOutput) -> None:
        """Start a step without waiting for it (``max_concurrent_batches`` > 1 only)."""
        raise NotImplementedError

    def collect(self) -> ModelRunnerOutput:
        """The result of the oldest step submitted and not collected yet."""
        raise NotImplementedError

    def collective_stats(self) -> tuple[int, float]:
        """(model steps, seconds spent in tensor-parallel collectives) so far: (0, 0.0)
        without workers. Per step the slowest rank's time counts; it includes waiting for
        the other ranks to arrive at the collective."""
        return 0, 0.0

    def check_alive(self) -> None:
        """Raise WorkerDeadError if a worker is gone (the engine asks while idle, so a death
        is known within a second, not at the next request)."""

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
