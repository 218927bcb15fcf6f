"""Continuous batching: which requests run this step, and with how many tokens.

Each step: running requests first (oldest first), each given the tokens it still lacks
(``num_tokens - num_computed_tokens``) within the step's token budget; then waiting requests
are admitted while ``max_num_seqs``, the token budget and free KV blocks allow. A long
prompt that does not fit the budget runs in chunks over several steps (chunked prefill).

When a running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed from its prompt and the tokens it already generated (outputs do not change).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagedllm.engine.request import Request, RequestStatus
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------- admission
    def check_request(self, request: Request) -> None:
        """Reject up front what could never run, instead of leaving it waiting forever."""
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.config.max_model_len})"
            )
        # Parallel samples share the prompt's blocks; each needs its own tail (+1 for a
        # copied partial block).
        n = request.num_samples_due
        needed = self.kv.num_blocks_for(total)
        if n > 1:
            needed = max(needed, self.kv.num_blocks_for(request.num_prompt_tokens) + n * (self.kv.num_blocks_for(request.max_tokens) + 1))
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks for {total} tokens"
                + (f" x {n} samples" if n > 1 else "")
                + f" but the pool holds only {self.kv.num_blocks}; raise kv_cache_space/num_kv_blocks or lower max_tokens"
            )
        if n > self.config.max_num_seqs:
            raise ValueError(f"n ({n}) exceeds max_num_seqs ({self.config.max_num_seqs})")

    def add_request(self, request: Request) -> None:
        """Queue a request; its ``pending_forks`` (parallel samples) are registered with it."""
        self.check_request(request)
        ids = [request.request_id] + [f.request_id for f in request.pending_forks]
        for rid in ids:
            if rid in self.requests:
                raise ValueError(f"request_id {rid!r} is already in use")
        self.requests[request.request_id] = request
        for fork in request.pending_forks:
            fork.fork_parent = request
            self.requests[fork.request_id] = fork
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, n))
                budget -= n
                i += 1

        # Admit waiting requests, unless someone was just preempted for lack of blocks.
        while self.waiting and not out.preempted_ids and budget > 0:
            req = self.waiting[0]
            if len(self.running) + req.num_samples_due > self.config.max_num_seqs:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n

        out.block_copies = self.kv.take_pending_copies()
        assert budget >= 0 and len(self.running) <= self.config.max_num_seqs
        return out

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, req.num_computed_tokens, self.kv.get_block_ids(req.request_id))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    # ----------------------------------------------------------------- after the forward
    def update_from_output(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.

        ``sampled[i]`` holds the tokens drawn for ``out.scheduled[i]``: none mid-prompt, else
        one for the request followed by one for each of its pending forks, which now take
        the request's blocks by reference and join the running queue.
        """
        finished: list[Request] = []
        now = time.monotonic()
        for sched, tokens in zip(out.scheduled, sampled):
            req = sched.request
            req.num_computed_tokens += sched.num_new_tokens
            if not tokens:
                continue
            forks, req.pending_forks = req.pending_forks, []
            for fork in forks:
                self.kv.fork(req.request_id, fork.request_id)
                fork.num_computed_tokens = req.num_computed_tokens
                fork.status = RequestStatus.RUNNING
                fork.first_scheduled_time = req.first_scheduled_time
                fork.fork_parent = None
                self.running.append(fork)
            for target, token in zip([req, *forks], tokens):
                target.append_output_token(token)
                if target.first_token_time is None:
                    target.first_token_time = now
                status = target.check_stop()
                if status is not None:
                    self.finish(target, status)
                    finished.append(target)
        return finished

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Retire a request now (also used by the engine for stop strings); frees its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req.fork_parent is not None:  # a parallel sample not yet forked
            req.fork_parent.pending_forks.remove(req)
            req.fork_parent = None
        for fork in list(req.pending_forks):
            # Sample 0 ends before its prompt is done: its forks start on their own.
            fork.fork_parent = None
            self.waiting.append(fork)
        req.pending_forks = []
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
