"""The standard benchmark workloads (shared/WORKLOADS.md): random token-id prompts, greedy, EOS ignored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    num_prompts: int
    input_len: int
    output_len: int

    def prompts(self) -> list[list[int]]:
        rng = np.random.default_rng(seed=self.seed)
        return rng.integers(1000, 40000, size=(self.num_prompts, self.input_len)).tolist()


WORKLOADS = {
    "W1": Workload("W1", seed=0, num_prompts=64, input_len=256, output_len=128),
    "W2": Workload("W2", seed=1, num_prompts=1, input_len=128, output_len=128),
    "W3": Workload("W3", seed=0, num_prompts=256, input_len=256, output_len=128),
}
