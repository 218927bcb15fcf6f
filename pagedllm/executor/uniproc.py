"""Today's engine: the one ModelRunner in the engine's own process."""

from __future__ import annotations

from pagedllm.executor.base import Executor
from pagedllm.runner.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """Calls go straight to the runner's bound methods: no extra frame per step."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.update_states = runner.update_states  # type: ignore[method-assign]
        self.execute = runner.execute  # type: ignore[method-assign]

    def update_states(self, out):  # replaced per instance by the runner's own
        self.runner.update_states(out)

    def execute(self, out):  # replaced per instance by the runner's own
        return self.runner.execute(out)
