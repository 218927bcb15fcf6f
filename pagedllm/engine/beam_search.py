"""Beam search on shared KV blocks, with transformers' semantics.

The scheduler, the KV manager and the runner only ever see single-sequence requests; this
module turns a beam search into a series of them. Each step every live beam is one request
whose job is to compute its newest token and report the top-K log-probabilities after it
(``logprobs=K``). After the step the request is retired and its block table is kept under a
*holder* id (``KVCacheManager.fork``: the blocks are shared by reference count, nothing is
copied). Once every beam of the group has reported, the group picks the next beams exactly as
transformers' ``generate(num_beams=W, do_sample=False)`` does, and each new beam (parent,
token) becomes a request forked from its parent's holder: it shares all the parent's blocks
and the runner computes only the new token; the first write into the shared, partly filled
last block copies it (copy-on-write, ``SchedulerOutput.block_copies``). Holders whose beams
died are freed at once, so a search holds the prompt's blocks once plus each live beam's tail.
All beams of all requests run in the engine's one flattened batch, between other requests.

Why fork rather than the prefix cache (vLLM v1 runs each beam step as a new request that finds
its prefix by content hash): the prefix cache shares full blocks only, so every beam would
recompute its partly filled last block each step (up to block_size - 1 tokens; 7.5 on average
with 16-token blocks, i.e. ~8x the work of a decode step), and it needs prefix caching on. A
fork shares the partial block too and copies it only on write.

Why a request per step rather than long-lived beam requests: the runner keeps each request's
tokens and appends what it samples, and beams of one group must advance in lockstep (a beam
that reported must not run on while a sibling waits for the budget or was preempted). A retired
request cannot run ahead, and a holder keeps its blocks until the group is ready.

transformers' rules, mirrored here (``generation/utils.py``, ``_beam_search``): candidates are the
top K = max(2, 1 + #eos) * W of (beam score + log p(token)) over all beams; a candidate "hits"
when its token is an EOS or it reaches ``max_tokens``; the top W candidates that do not hit are
the next beams; hits ranked within the first W enter the finished set (best W kept) with score
``cum_logprob / generated_len ** length_penalty`` (generated tokens, EOS included);
``early_stopping``: True stops once W are finished, False stops when the best running beam at
its current length cannot beat the worst finished one, "never" bounds it at ``max_tokens`` when
length_penalty > 0. The search returns the finished set, best first.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedllm.checks import check_bools, is_int, is_number
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, RowLogprobs
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedllm.scheduler.scheduler import Scheduler

logger = logging.getLogger("pagedllm.engine")

# |length_penalty| past this overflows length ** penalty for long outputs (8,192 ** 50 ~ 1e195).
MAX_LENGTH_PENALTY = 50


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (plus transformers' ``early_stopping``). Only deterministic
    beam search: ``temperature`` must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0 for beam search (deterministic), got {self.temperature!r}")
        check_bools(self, ("ignore_eos", "include_stop_str_in_output"))
        lp = self.length_penalty
        if not is_number(lp) or abs(lp) > MAX_LENGTH_PENALTY:
            # (length ** 1e308 overflows in the middle of a search)
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got {lp!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):  # (1.0 == True: not a bool)
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's shape): ``tokens`` are prompt + generated tokens (the EOS only
    with ``include_stop_str_in_output``), ``text`` their text; ``cum_logprob`` sums the
    generated tokens' log-probabilities (EOS included), ``score`` is the length-penalized
    value the beams were ranked by."""

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    stop_reason: int | None = None
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    tokens: list[int]  # generated so far; the last one is what this step's request computes
    cum_logprob: float
    # KV table id holding its blocks once its request retired: a tuple, so no request id (a
    # string, whatever a caller chose) can ever name the same table.
    holder: tuple[str, str] | None = None
    row: RowLogprobs | None = None  # what its request reported this step


@dataclass
class _Group:
    group_id: str
    params: BeamSearchParams
    prompt: str | None
    prompt_token_ids: list[int]
    eos: frozenset[int]
    priority: int
    beams: list[_Beam]  # running, best first
    num_return: int  # how many of the best finished beams the output carries
    cache_salt: str | None = None  # the search's prefix-cache salt, for all its step requests
    lora_request: LoRARequest | None = None  # the adapter all its step requests run with
    requests: dict[str, _Beam] = field(default_factory=dict)  # live request id -> its beam
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, tokens, cum)
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # when the first beams were chosen

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time, time.monotonic())


class BeamSearch:
    """Runs beam-search groups through the scheduler (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, detokenize: Any | None = None,
                 id_in_use: Callable[[str], bool] = lambda request_id: False):  # fmt: skip
        """``id_in_use``: whether the engine knows a request id (a step request's id skips it)."""
        self.scheduler = scheduler
        self.id_in_use = id_in_use
        self.kv = kv
        self.detokenize = detokenize  # token ids -> text, or None
        self.groups: dict[str, _Group] = {}
        self._by_request: dict[str, str] = {}  # live request id -> group id
        self._ids = itertools.count()
        self._ready: list[RequestOutput] = []
        # Each running search reserves the most blocks it could hold at once; a search whose
        # reservation does not fit beside the running ones waits here (FIFO) until one ends.
        # Without this, two searches that each fit alone could fill the pool with their
        # holders (beams that reported wait for their siblings) and both wait forever.
        self._reserved: dict[str, int] = {}
        self._waiting: list[tuple[_Group, Request, int]] = []
        # The most blocks the pool held in use at once while beam searches ran (for tests/logs).
        self.peak_used_blocks = 0
        # False: share through the prefix cache instead (a new beam adopts its parent's cached
        # full blocks and recomputes the rest), vLLM v1's way; kept to measure the choice
        # (docs/beam_search.md).
        self.share_by_fork = True

    # ------------------------------------------------------------------ lifecycle
    def num_candidates(self, params: BeamSearchParams, eos: frozenset[int]) -> int:
        return max(2, 1 + (0 if params.ignore_eos else len(eos))) * params.beam_width

    def add(self, group_id: str, prompt: str | None, prompt_token_ids: list[int], params: BeamSearchParams,
            eos: frozenset[int], max_model_len: int, priority: int = 0, num_return: int | None = None,
            cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:  # fmt: skip
        """Queue a search (ValueError, changing nothing, if it could never run)."""
        if group_id in self.groups:
            raise ValueError(f"request_id {group_id!r} is already in use")
        k = self.num_candidates(params, eos)
        if k > MAX_LOGPROBS:
            raise ValueError(f"beam_width {params.beam_width} needs the top {k} log-probabilities per beam; at most {MAX_LOGPROBS} are available")
        if len(prompt_token_ids) + params.max_tokens > max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({max_model_len})"
            )
        if num_return is not None and not 1 <= num_return <= params.beam_width:
            raise ValueError(f"n ({num_return}) must be between 1 and the beam width ({params.beam_width})")
        group = _Group(group_id, params, prompt, list(prompt_token_ids), frozenset() if params.ignore_eos else eos, priority,
                       [], num_return or params.beam_width, cache_salt=cache_salt, lora_request=lora_request)  # fmt: skip
        first = _Beam([], 0.0)
        req = self._request(group, first, list(prompt_token_ids), 0, first=True)
        # What the whole search could hold at once must fit: refuse now rather than wait forever
        # (beams that reported keep their blocks until their siblings have).
        self.scheduler.check_request(replace_max_tokens(req, params.max_tokens))
        need = self.worst_case_blocks(len(prompt_token_ids), params.beam_width, params.max_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"beam_width {params.beam_width} x max_tokens {params.max_tokens} may need {need} KV blocks but the pool "
                f"holds only {self.kv.num_blocks}; raise kv_cache_space/num_kv_blocks or lower max_tokens"
            )
        group.beams = [first]
        self.groups[group_id] = group
        self._waiting.append((group, req, need))
        self._start_waiting()

    def worst_case_blocks(self, prompt_len: int, width: int, max_tokens: int) -> int:
        """The most KV blocks a search can hold at once, in every KV-cache group: the prompt
        and one beam's tokens, and each other beam's own tokens plus the block it shares at the
        fork; a sliding-window group no more than each beam's window and step chunk take. (One
        table's count for all groups let Gemma 3's six groups start searches that could never
        finish: the engine spun forever.)"""
        bs = self.kv.block_size
        full = -(-(prompt_len + max_tokens) // bs) + (width - 1) * (-(-max_tokens // bs) + 1)
        chunk = self.scheduler.config.max_request_tokens
        return sum(full if w is None else min(full, width * (-(-(w - 1 + chunk) // bs) + 1)) for w in self.kv.windows)

    def longest_fit(self, prompt_len: int, width: int, max_tokens: int) -> int:
        """The largest max_tokens (at most ``max_tokens``) whose worst case fits the pool (1
        when none does: the search is then refused with the reason)."""
        lo, hi = 1, max_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.worst_case_blocks(prompt_len, width, mid) <= self.kv.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _start_waiting(self) -> None:
        """Start the waiting searches, in order, while their reservations fit."""
        while self._waiting:
            group, req, need = self._waiting[0]
            if sum(self._reserved.values()) + need > self.kv.num_blocks:
                return
            self._waiting.pop(0)
            self._reserved[group.group_id] = need
            self._submit(group, group.beams[0], req)

    def _request(self, group: _Group, beam: _Beam, token_ids: list[int], num_computed: int, first: bool = False) -> Request:
        rid = f"{group.group_id}-beam{next(self._ids)}"
        while self.id_in_use(rid) or rid in self.scheduler.requests:  # a caller's own id of that form
            rid = f"{group.group_id}-beam{next(self._ids)}"
        k = self.num_candidates(group.params, group.eos)
        # max_tokens=2: the request samples once and is retired before it could sample again.
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=k, detokenize=False)
        req = Request(rid, None, token_ids, params, group.eos, priority=group.priority, parent_id=group.group_id,
                      index=0 if first else 1, arrival_time=group.arrival_time, cache_salt=group.cache_salt,
                      lora_request=group.lora_request)  # fmt: skip
        req.num_computed_tokens = num_computed
        if not first:  # a continuation: not a new prompt for the prompt-token stats
            req.num_prompt_tokens_run = req.num_prompt_tokens
            if num_computed:  # forked: nor for the prefix cache's hit rate
                req.first_scheduled_time = time.monotonic()
        return req

    def _submit(self, group: _Group, beam: _Beam, req: Request) -> None:
        group.requests[req.request_id] = beam
        self._by_request[req.request_id] = group.group_id
        # Checked as a whole search in add(); a step request's own max_tokens (2, see _request)
        # would overshoot max_model_len on the last step of a search that reaches it.
        self.scheduler.add_request(req, check=False)

    def tracks(self, request_id: str) -> bool:
        return request_id in self._by_request

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def held(self) -> list[Request]:
        """The first step requests of searches waiting for room in the pool (not yet queued)."""
        return [req for _, req, _ in list(self._waiting)]  # (a copy: the metrics thread reads it too)

    def between_steps(self) -> list[str]:
        """Step requests of searches past their first step that wait in the scheduler's queue:
        a search re-queues its beams after every step, so these belong to a running search, not
        to the waiting line (gauges, dashboard, the waiting cap). (Copies: other threads read it.)"""
        requests = self.scheduler.requests
        return [rid for g in list(self.groups.values()) if g.first_token_time is not None for rid in list(g.requests)
                if (r := requests.get(rid)) is not None and r.status is RequestStatus.WAITING]  # fmt: skip

    def holder_rows(self) -> list[tuple[tuple[str, str], int, int, int]]:
        """Beams that reported and hold their blocks until their siblings do (a live view):
        (holder table id, prompt tokens, output tokens, most tokens the search may reach)."""
        return [(beam.holder, len(g.prompt_token_ids), len(beam.tokens), len(g.prompt_token_ids) + g.params.max_tokens)
                for g in self.groups.values() for beam in g.beams if beam.holder is not None]  # fmt: skip

    # ------------------------------------------------------------------ after each step
    def after_step(self, scheduled: list[Request], logprobs: list[list]) -> None:
        """Collect the beams' reports (the step's requests in order, their logprob rows), retire
        their requests into holders, and advance every group whose beams have all reported."""
        self.peak_used_blocks = max(self.peak_used_blocks, self.kv.block_pool.num_used_blocks)
        touched: set[str] = set()
        for req, rows in zip(scheduled, logprobs):
            gid = self._by_request.get(req.request_id)
            if gid is None or not rows or rows[-1] is None:
                continue
            group = self.groups[gid]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = req.first_scheduled_time
            beam = group.requests.pop(req.request_id)
            del self._by_request[req.request_id]
            beam.row = rows[-1]
            beam.holder = ("beam-holder", req.request_id)
            self.kv.fork(req.request_id, beam.holder)
            if not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            touched.add(gid)
        for gid in touched:
            group = self.groups[gid]
            if not group.requests:  # every beam reported
                try:
                    self._advance(group)
                except Exception as e:  # a fault in one search ends that search, not the engine
                    logger.error("beam search %s failed: %s: %s", gid, type(e).__name__, e, exc_info=e)
                    self.abort(gid, error=f"{type(e).__name__}: {e}")

    def _advance(self, group: _Group) -> None:
        if group.first_token_time is None:
            group.first_token_time = time.monotonic()
        p, w = group.params, group.params.beam_width
        k = self.num_candidates(p, group.eos)
        cands = []  # (accumulated logprob, beam index, token)
        for bi, beam in enumerate(group.beams):
            row = beam.row
            assert row is not None
            for tok, lp in zip(row.top_ids[:k], row.top_logprobs[:k]):
                cands.append((beam.cum_logprob + lp, bi, tok))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))  # torch.topk over [beams x vocab], ties by index
        cands = cands[:k]
        new_len = len(group.beams[0].tokens) + 1  # generated tokens after this step
        hits = [tok in group.eos or new_len >= p.max_tokens for _, _, tok in cands]
        # Finished hypotheses: hits among the first W candidates.
        full = len(group.finished) >= w and p.early_stopping is True
        if group.improvable and not full:
            for rank, ((score, bi, tok), hit) in enumerate(zip(cands, hits)):
                if rank < w and hit:
                    tokens = group.beams[bi].tokens + [tok]
                    group.finished.append((score / new_len**p.length_penalty, tokens, score))
            group.finished.sort(key=lambda f: -f[0])
            del group.finished[w:]
        nxt = [(score, bi, tok) for (score, bi, tok), hit in zip(cands, hits) if not hit][:w]
        # The stop rules, after the step (transformers' cur_len + 1).
        if nxt:
            best_len = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else new_len
            best_possible = nxt[0][0] / best_len**p.length_penalty
            worst = group.finished[-1][0] if len(group.finished) >= w else float("-inf")
            group.improvable = group.improvable and (len(group.finished) < w or best_possible > worst)
        stop = not group.improvable or (len(group.finished) >= w and p.early_stopping is True) or all(hits)
        old = group.beams
        if stop:
            self._release(old)
            self._finish(group)
            return
        children: list[tuple[_Beam, Request]] = []
        try:
            for score, bi, tok in nxt:  # fork the new beams first, then free the old holders
                parent = old[bi]
                beam = _Beam(parent.tokens + [tok], score)
                ids = group.prompt_token_ids + beam.tokens
                if self.share_by_fork:
                    req = self._request(group, beam, ids, len(ids) - 1)
                    self.kv.fork(parent.holder, req.request_id)
                else:
                    req = self._request(group, beam, ids, 0)
                children.append((beam, req))
        except BaseException:  # the old beams still hold their blocks (abort frees them): free the forks
            for _, req in children:
                self.kv.free(req.request_id)
            raise
        group.beams = [beam for beam, _ in children]
        self._release(old)
        for beam, req in children:
            self._submit(group, beam, req)

    def _release(self, beams: list[_Beam]) -> None:
        for beam in beams:
            if beam.holder is not None:
                self.kv.free(beam.holder)
                beam.holder = None

    def _finish(self, group: _Group) -> None:
        del self.groups[group.group_id]
        self._reserved.pop(group.group_id, None)
        self._start_waiting()
        p = group.params
        outputs = []
        n = len(group.prompt_token_ids)
        for i, (score, tokens, cum) in enumerate(group.finished[: group.num_return]):
            stopped = bool(tokens) and tokens[-1] in group.eos
            shown = tokens if (not stopped or p.include_stop_str_in_output) else tokens[:-1]
            text = self.detokenize(shown) if self.detokenize is not None else ""
            out = CompletionOutput(i, text, shown, cumulative_logprob=cum,
                                   finish_reason="stop" if stopped else "length",
                                   stop_reason=tokens[-1] if stopped else None)  # fmt: skip
            out.score = score  # type: ignore[attr-defined]  # the length-penalized ranking value
            outputs.append(out)
        self._ready.append(RequestOutput(group.group_id, group.prompt, group.prompt_token_ids, outputs, finished=True,
                                         metrics=group.metrics(), lora_request=group.lora_request))  # fmt: skip

    def abort(self, group_id: str, error: str | None = None) -> RequestOutput | None:
        """End a search now (its requests and holders freed); returns its final output
        (finish_reason "error" with ``error``, else "abort")."""
        group = self.groups.pop(group_id, None)
        if group is None:
            return None
        self._waiting = [w for w in self._waiting if w[0] is not group]
        self._reserved.pop(group_id, None)
        for rid in list(group.requests):
            self._by_request.pop(rid, None)
            self.scheduler.end(rid, RequestStatus.FINISHED_ABORTED)
        self._release(group.beams)
        self._start_waiting()
        out = RequestOutput(group_id, group.prompt, group.prompt_token_ids,
                            [CompletionOutput(0, "", [], finish_reason="abort" if error is None else "error")],
                            finished=True, metrics=group.metrics(), error=error, lora_request=group.lora_request)  # fmt: skip
        self._ready.append(out)
        return out

    def take_outputs(self) -> list[RequestOutput]:
        out, self._ready = self._ready, []
        return out


def beam_params_from(params: SamplingParams) -> BeamSearchParams:
    """The beam search a ``SamplingParams(use_beam_search=True)`` asks for (the server's path):
    width ``best_of`` (or ``n``); what a beam search cannot honour is refused."""
    for name in ("stop", "stop_token_ids", "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(params, name):
            raise ValueError(f"{name} is not supported with use_beam_search")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("logprobs is not supported with use_beam_search")
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1.0), ("min_tokens", 0),
                          ("detokenize", True)):  # fmt: skip
        if getattr(params, name) != neutral:  # (the error's first word is the field the server reports)
            raise ValueError(f"{name} is not supported with use_beam_search")
    return BeamSearchParams(params.best_of or params.n, params.max_tokens, params.ignore_eos, 0.0, params.length_penalty,
                            params.include_stop_str_in_output, params.early_stopping)  # fmt: skip


def replace_max_tokens(req: Request, max_tokens: int) -> Request:
    """A copy of ``req`` asking for ``max_tokens`` (for the admission check of a whole search)."""
    from dataclasses import replace

    return replace(req, sampling_params=replace(req.sampling_params, max_tokens=max_tokens), output_token_ids=[])


def to_beam_search_output(out: RequestOutput) -> BeamSearchOutput:
    """The engine's RequestOutput of a search as vLLM's ``BeamSearchOutput``."""
    n = len(out.prompt_token_ids)
    seqs = [
        BeamSearchSequence(list(out.prompt_token_ids) + list(o.token_ids), o.cumulative_logprob or 0.0,
                           getattr(o, "score", 0.0), o.text, o.finish_reason, o.stop_reason, n)  # fmt: skip
        for o in out.outputs
    ]
    return BeamSearchOutput(seqs)
