"""Parallel sampling (``n > 1``): one parent request fanned out into n independent requests.

The scheduler, the KV manager and the runner only ever see single-sequence requests. The
prompt's blocks are shared through the prefix cache: sample 0 runs first and samples
1..n-1 are held back until sample 0 has computed its prompt, so they adopt its cached full
blocks and compute only the rest (the tokens after the last full block that precedes the
last prompt token, which is always recomputed for its logits). Without prefix caching the
samples start together and each computes the prompt, as in vLLM v1.
"""

from __future__ import annotations

from dataclasses import replace

from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.scheduler.scheduler import Scheduler


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s own params: n=1, and a seed of its own derived from the request's."""
    seed = params.seed
    if seed is not None and index > 0:
        seed = hash((seed, index)) & (2**63 - 1)  # ints hash the same in every process
    return replace(params, n=1, seed=seed)


class ParallelSampling:
    def __init__(self, scheduler: Scheduler, share_prompt: bool):
        self.scheduler = scheduler
        self.share_prompt = share_prompt
        self._leaders: dict[str, Request] = {}  # parent id -> sample 0, while others are held
        self._held: dict[str, list[Request]] = {}  # parent id -> samples 1..n-1 not yet queued

    def add(self, samples: list[Request]) -> None:
        """Queue a parent's samples (sample 0 at once; the rest when its prompt is computed)."""
        self.scheduler.add_request(samples[0])
        if len(samples) == 1:
            return
        if not self.share_prompt:
            for req in samples[1:]:
                self.scheduler.add_request(req)
            return
        self._leaders[samples[0].parent_id] = samples[0]
        self._held[samples[0].parent_id] = samples[1:]

    def held(self) -> list[Request]:
        """Samples waiting for their sample 0's prompt (not yet queued)."""
        return [req for samples in list(self._held.values()) for req in samples]  # (a copy: the metrics thread reads it too)

    def is_held(self, req: Request) -> bool:
        return req in self._held.get(req.parent_id, ())

    def release_ready(self) -> None:
        """After a step: queue the held samples of every leader whose prompt is now cached
        (or that ended early, so its siblings run on their own)."""
        for parent_id, leader in list(self._leaders.items()):
            if leader.status.finished or leader.num_computed_tokens >= leader.num_prompt_tokens:
                del self._leaders[parent_id]
                for req in self._held.pop(parent_id):
                    self.scheduler.add_request(req)

    def drop(self, parent_id: str) -> list[Request]:
        """Forget a parent's held samples (it was aborted or failed); returns them."""
        self._leaders.pop(parent_id, None)
        return self._held.pop(parent_id, [])
