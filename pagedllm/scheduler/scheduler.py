"""Continuous batching: which requests run this step, and with how many tokens.

Each step: running requests first (oldest first), each given the tokens it still lacks
(``num_tokens - num_computed_tokens``) within the step's token budget; then waiting requests
are admitted while ``max_num_seqs``, the token budget and free KV blocks allow. A long
prompt that does not fit the budget runs in chunks over several steps (chunked prefill).

A request starting out first adopts the longest chain of prefix-cached blocks matching its
tokens, so only the rest counts against the budget (with a KV connector, then the blocks its
store supplies: kv_connector/). ``long_prefill_token_threshold`` caps one
request's chunk per step so that several long prompts progress together.

With LoRA (``max_loras`` > 0), the running requests use at most ``max_loras`` distinct adapters
(the runner has that many slots); a waiting request whose adapter would be one more is passed
over this step, keeping its place, and the requests behind it may still be admitted.

When a running request cannot get a block, a victim chosen by the policy (fcfs: the most
recently admitted) is preempted: its blocks are freed and it goes back to the waiting
queue, to be recomputed from its prompt and the tokens it already generated (outputs do not
change; with prefix caching most of its blocks come back as cache hits).

At DEBUG (logger ``pagedllm.scheduler``) every ``schedule()`` logs one line starting with
``step N:``; at INFO the cost is one ``isEnabledFor`` test per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedllm.request import Request, RequestStatus
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager, abbrev
from pagedllm.kv_connector.scheduler_side import SchedulerConnector
from pagedllm.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput
from pagedllm.scheduler.policy import WaitingQueue, outranks, pick_victim

logger = logging.getLogger("pagedllm.scheduler")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"  # or "swap"
    # LoRA: most distinct adapters among running requests (one slot each); 0 = LoRA off.
    max_loras: int = 0
    num_speculative_tokens: int = 0  # drafts a step may verify after a request's known tokens

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request runs in a step (what a sliding-window group's blocks
        grow with): a chunk of at most long_prefill_token_threshold, then its drafts."""
        return max_request_tokens(self.max_num_batched_tokens, self.long_prefill_token_threshold, self.num_speculative_tokens)


def max_request_tokens(max_num_batched_tokens: int, long_prefill_token_threshold: int, num_speculative_tokens: int) -> int:
    if long_prefill_token_threshold <= 0:
        return max_num_batched_tokens
    return min(max_num_batched_tokens, long_prefill_token_threshold + num_speculative_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.num_steps = 0  # schedule() calls; numbers the DEBUG step lines
        self._finished_ids: set[str] = set()  # ended since the last step (the runner forgets them)
        # KV counters (allocated, freed, cached hits) when the last step line was logged, and its step.
        self._log_marks: tuple[int, int, int] = (0, 0, 0)
        self._log_marks_step = -1
        self.kv_connector: SchedulerConnector | None = None  # set by the engine (kv_transfer_config)

    # ----------------------------------------------------------------- admission
    def check_request(self, request: Request) -> None:
        """Reject up front what could never run, instead of leaving it waiting forever."""
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.config.max_model_len})"
            )
        needed = self.kv.max_blocks_held(total, self.config.max_request_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"max_tokens ({request.max_tokens}) with the prompt ({request.num_prompt_tokens} tokens) needs {needed} KV "
                f"blocks but the pool holds only {self.kv.num_blocks}; lower max_tokens or raise kv_cache_space/num_kv_blocks"
            )

    def add_request(self, request: Request, check: bool = True) -> None:
        """Queue a request (ValueError, changing nothing, if it could never run). ``check=False``:
        the caller has checked what it will run (a beam search's step requests)."""
        if check:
            self.check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one step
    def _chunk(self, req: Request, num_computed: int, budget: int) -> int:
        n = min(req.num_tokens - num_computed, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def schedule(self, in_flight: frozenset[str] | set[str] = frozenset(), max_batch_seqs: int | None = None) -> SchedulerOutput:
        """The next step. Pipeline parallel engines keep several batches in flight: requests in
        ``in_flight`` (scheduled, results not back yet) are neither scheduled again nor
        preempted, and ``max_batch_seqs`` caps this batch's requests so the running ones form
        one cohort per batch in flight. Both default to the one-batch behaviour."""
        out = SchedulerOutput()
        cap = max_batch_seqs if max_batch_seqs is not None else self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        policy = self.config.scheduling_policy
        now = time.monotonic()
        self.num_steps += 1
        debug = logger.isEnabledFor(logging.DEBUG)
        if debug:
            # Block counts since the previous step line (so frees of requests that finished
            # after it count too), or since this call began when the previous step was not logged.
            marks = self._log_marks if self._log_marks_step == self.num_steps - 1 else self._kv_marks()

        # 1. Running requests, oldest first, each with the tokens it lacks.
        for req in list(self.running):
            if budget <= 0 or len(out.scheduled) >= cap:
                break
            if req.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED):  # a victim earlier in this loop
                continue
            if req.request_id in in_flight:
                continue
            n = self._chunk(req, req.num_computed_tokens, budget)
            spec = self._spec_tokens(req, n, budget - n)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens, n + len(spec)):
                if spec:  # drafts are optional: verify none this step rather than preempt for them
                    spec = []
                    continue
                victim = self._victim(policy, in_flight)
                if victim is None or (in_flight and victim is req):
                    # Only requests in flight could give blocks: wait for them to come back
                    # rather than throw away this request's computed KV.
                    break
                budget += self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, n, spec=spec))
                budget -= n + len(spec)

        # 2. Waiting requests; under fcfs not in a step that had to preempt for blocks. A request
        # whose LoRA adapter would exceed max_loras waits, without holding up those behind it;
        # so does one that lacks blocks while nothing runs (``_blocked_by_idle_holders``).
        loras = self._running_loras()
        skipped: list[Request] = []
        while self.waiting and budget > 0 and not (out.preempted_ids and policy == "fcfs") and len(out.scheduled) < cap:
            req = self.waiting.peek()
            if loras is not None and req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                skipped.append(self.waiting.pop())
                continue
            if len(self.running) >= self.config.max_num_seqs:
                refund = self._preempt_for(req, out, in_flight)
                if refund is None:
                    break
                budget += refund
                continue
            swapped = req.status is RequestStatus.SWAPPED
            # Prompt logprobs need every prompt position computed: no cache hits for them.
            wants_prompt_logprobs = req.sampling_params.prompt_logprobs is not None
            hits = (
                self.kv.get_computed_blocks(req.request_id, req.all_token_ids, req.cache_keys)
                if req.num_computed_tokens == 0 and not wants_prompt_logprobs
                else []
            )
            num_computed = req.num_computed_tokens + len(hits) * self.kv.block_size
            # Tokens after the local hits whose KV the connector's store supplies (loaded, not run).
            starting = self.kv_connector is not None and req.num_computed_tokens == 0 and not wants_prompt_logprobs
            num_external = self.kv_connector.lookup(req, num_computed, self.kv) if starting else 0
            n = self._chunk(req, num_computed + num_external, budget)
            fits = self.kv.swap_in(req.request_id, num_computed + n) if swapped else True
            if fits and not self.kv.allocate_slots(req.request_id, num_computed, num_external + n, hits):
                assert not swapped  # swap_in reserved room for these tokens
                fits = False
            if not fits:
                refund = self._preempt_for(req, out, in_flight)
                if refund is None:
                    if self._blocked_by_idle_holders():
                        skipped.append(self.waiting.pop())
                        continue
                    break
                budget += refund
                continue
            self.waiting.pop()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = num_computed + num_external
                if self.kv.enable_caching and not wants_prompt_logprobs:  # the prefix cache was looked up
                    bs = self.kv.block_size
                    out.num_prefix_queries += req.num_tokens
                    out.num_prefix_hits += num_computed
                    out.num_uncacheable_tokens += req.num_tokens - (req.num_tokens - 1) // bs * bs
            req.num_computed_tokens = num_computed + num_external
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if loras is not None and req.lora_int_id:
                loras.add(req.lora_int_id)
            out.scheduled.append(self._scheduled(req, n, new=True))
            if self.kv_connector is not None:
                self.kv_connector.on_allocated(req.request_id, out.scheduled[-1].block_ids)
            budget -= n

        self.waiting.prepend(skipped)
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        out.block_copies = self.kv.take_pending_copies()
        out.swap_out, out.swap_in = self.kv.take_pending_swaps()
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_meta(out, self.requests, self.kv)
        assert len(self.running) <= self.config.max_num_seqs
        assert budget == self.config.max_num_batched_tokens - out.num_scheduled_tokens >= 0
        if debug:
            self._log_step(out, marks)
        return out

    def _blocked_by_idle_holders(self) -> bool:
        """Whether the waiting queue's head lacks blocks while nothing runs: what holds them then
        is not a running request (a beam search's holders, kept until its step requests run),
        so waiting for a finish would wait forever. The head keeps its place; the requests
        behind it may run (those step requests among them) until something runs again."""
        return not self.running

    def _running_loras(self) -> set[int] | None:
        """The adapters of the running requests (None with LoRA off)."""
        if not self.config.max_loras:
            return None
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _kv_marks(self) -> tuple[int, int, int]:
        kv = self.kv
        return kv.num_allocated_total, kv.num_freed_total, kv.num_cached_hits_total

    def _log_step(self, out: SchedulerOutput, marks: tuple[int, int, int]) -> None:
        """One DEBUG line for this step: what runs, what was preempted, what the KV pool did."""
        now_marks = self._kv_marks()
        allocated, freed, hits = (a - b for a, b in zip(now_marks, marks))
        self._log_marks, self._log_marks_step = now_marks, self.num_steps
        num_decode = sum(
            1 for s in out.scheduled if s.num_new_tokens == 1 and s.num_computed_tokens >= self.requests[s.req_id].num_prompt_tokens
        )
        logger.debug(
            "step %d: scheduled=%d (prefill=%d decode=%d) tokens=%d reqs=%s waiting=%d running=%d preempted=%s "
            "blocks: allocated=%d freed=%d cached_hits=%d free=%d/%d copies=%d swap_out=%d swap_in=%d",
            self.num_steps,
            len(out.scheduled),
            len(out.scheduled) - num_decode,
            num_decode,
            out.num_scheduled_tokens,
            abbrev(f"{s.req_id}:{s.num_new_tokens}" for s in out.scheduled),
            len(self.waiting),
            len(self.running),
            abbrev(out.preempted_ids),
            allocated,
            freed,
            hits,
            self.kv.num_free_blocks,
            self.kv.num_blocks,
            len(out.block_copies),
            len(out.swap_out),
            len(out.swap_in),
        )

    def _victim(self, policy: str, in_flight: frozenset[str] | set[str]) -> Request | None:
        """The running request to preempt, never one in flight (None when all are)."""
        running = [r for r in self.running if r.request_id not in in_flight] if in_flight else self.running
        return pick_victim(running, policy) if running else None

    def _preempt_for(self, req: Request, out: SchedulerOutput, in_flight: frozenset[str] | set[str] = frozenset()) -> int | None:
        """Priority policy: preempt the lowest-priority running request if ``req`` outranks it.

        Returns the budget given back, or None when nobody may be preempted.
        """
        if self.config.scheduling_policy != "priority" or not self.running:
            return None
        victim = self._victim("priority", in_flight)
        if victim is None or not outranks(req, victim):
            return None
        return self._preempt(victim, out)

    def _spec_tokens(self, req: Request, n: int, budget: int) -> list[int]:
        """The draft tokens to verify after ``req``'s last known token this step: only when the
        chunk reaches that token, within the budget, the model length and max_tokens."""
        if not req.spec_token_ids or req.num_computed_tokens + n != req.num_tokens:
            return []
        room = min(budget, self.config.max_model_len - req.num_tokens, req.max_tokens - len(req.output_token_ids) - 1)
        return req.spec_token_ids[: max(0, room)]

    def _scheduled(self, req: Request, n: int, new: bool = False, spec: list[int] | None = None) -> ScheduledRequest:
        """The step's plain-data entry for ``req``; ``new`` when it was just admitted (fresh or
        resumed), so the runner gets everything it needs to know about it. ``spec``: draft
        tokens run after the ``n`` known ones."""
        data = None
        if new:
            data = NewRequestData(
                req_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids),
                sampling_params=req.sampling_params,
                eos_token_ids=req.eos_token_ids,
                bad_words_token_ids=req.bad_words_token_ids,
                lora_request=req.lora_request,
            )
        samples = req.num_computed_tokens + n == req.num_tokens
        block_ids, *other_groups = self.kv.get_group_block_ids(req.request_id)
        return ScheduledRequest(req.request_id, n + len(spec or ()), req.num_computed_tokens, block_ids, samples, data,
                                tuple(other_groups), list(spec or ()))  # fmt: skip

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free a running request's blocks and requeue it; returns the budget it gave back."""
        self.running.remove(req)
        refund = 0
        for k, s in enumerate(out.scheduled):
            if s.req_id == req.request_id:  # already scheduled this step: withdraw it
                refund = s.num_new_tokens
                del out.scheduled[k]
                break
        if self.config.preemption_mode == "swap" and self.kv.swap_out(req.request_id):
            req.status = RequestStatus.SWAPPED  # keeps num_computed_tokens: nothing to recompute
        else:  # recompute (also the fallback when the swap pool is full)
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        # (The runner forgets its tokens through preempted_ids and relearns them when it resumes;
        # a seeded request's generator lives on, so its random stream continues.)
        self.waiting.add_preempted(req)
        out.preempted_ids.append(req.request_id)
        return refund

    def snapshot(self, held: list[Request] = ()) -> list[dict]:
        """Running then waiting requests as plain data (a live view; the engine thread calls it).
        ``held``: requests accepted but not queued yet (the engine's), shown as waiting."""
        rows = []
        for queue, reqs in (("running", self.running), ("waiting", [*self.waiting, *held])):
            for req in reqs:
                rows.append({
                    "request_id": req.request_id, "queue": queue, "status": req.status.name.lower(),
                    "num_computed_tokens": req.num_computed_tokens, "num_tokens": req.num_tokens,
                    "num_prompt_tokens": req.num_prompt_tokens, "num_output_tokens": len(req.output_token_ids),
                    "max_tokens": req.num_prompt_tokens + req.max_tokens, "num_preemptions": req.num_preemptions,
                    "num_blocks": self.kv.num_held_blocks(req.request_id),
                })  # fmt: skip
        return rows

    # ----------------------------------------------------------------- after the forward
    def update_from_output(
        self, out: SchedulerOutput, sampled: list[list[int]], drafts: list[list[int]] | None = None
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.

        ``sampled[i]`` holds the tokens drawn for ``out.scheduled[i]``: none mid-prompt, else
        one; after k draft tokens, the a accepted ones and one more. The K/V of the k - a
        rejected drafts is not counted as computed (their slots are written again next step,
        and blocks are registered in the prefix cache only up to verified tokens).
        ``drafts[i]``, when given, are the request's draft tokens for the next step.
        A stop (EOS, a stop token id, max_tokens) inside ``sampled[i]`` ends the request there:
        the tokens drawn after it (accepted drafts run past it) are dropped from ``sampled[i]``
        itself, so every later consumer of the step sees only the tokens that were output.
        """
        finished: list[Request] = []
        now = time.monotonic()
        for i, (sched, tokens) in enumerate(zip(out.scheduled, sampled, strict=True)):
            req = self.requests[sched.req_id]
            accepted = sched.num_accepted(tokens)
            rejected = 0 if accepted is None else len(sched.spec_token_ids) - accepted
            req.num_computed_tokens += sched.num_new_tokens - rejected
            req.spec_token_ids = drafts[i] if drafts else []
            self.kv.cache_blocks(req.request_id, min(req.num_computed_tokens, req.num_tokens), req.all_token_ids, req.cache_keys)
            self.kv.remove_skipped_blocks(req.request_id, req.num_computed_tokens)  # e.g. behind a sliding window
            for n, token in enumerate(tokens, 1):
                req.append_output_token(token)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = req.check_stop()
                if status is not None:
                    self.finish(req, status)
                    finished.append(req)
                    del tokens[n:]
                    break
        return finished

    def abort(self, request_id: str) -> Request | None:
        return self.end(request_id, RequestStatus.FINISHED_ABORTED)

    def end(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a live request from outside the step (abort, or a fault pinned on it)."""
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return None
        self.finish(req, status)
        return req

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Retire a request now (also used by the engine for stop strings); frees its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        req.finished_time = time.monotonic()
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)
