"""Today's engine: the one ModelRunner in the engine's own process."""

from __future__ import annotations

import os

import torch

from pagedllm.executor.base import Executor
from pagedllm.executor.worker import model_weight_bytes, rss_bytes
from pagedllm.runner.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """Calls go straight to the runner's bound methods: no extra frame per step."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        a = runner.model.arch
        self.worker_reports = [{
            "rank": 0, "tp_rank": 0, "pp_rank": 0, "weight_bytes": model_weight_bytes(runner.model),
            "rss_bytes": rss_bytes(), "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
            "num_layers": a.num_layers, "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)),
        }]  # fmt: skip
        self.update_states = runner.update_states  # type: ignore[method-assign]
        self.execute = runner.execute  # type: ignore[method-assign]

    def update_states(self, out):  # replaced per instance by the runner's own
        self.runner.update_states(out)

    def execute(self, out):  # replaced per instance by the runner's own
        return self.runner.execute(out)
