"""Structured outputs in the engine: grammars compiled off the engine thread, one matcher per
sequence, one token bitmask per step for all constrained rows.

    add(group)      -> the constraint compiles in a worker thread; the group is held here
    take_ready()    -> groups whose grammar is ready (or failed) go on to the scheduler
    bitmask(step)   -> masks of the step's sampling rows that have a matcher
    accept(id, ts)  -> the matcher advances on the sampled tokens; True when the grammar ended

Matchers live with the engine's requests, not in the runner: a preempted request keeps its
generated tokens and so its matcher state; only its K/V is recomputed.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait, FIRST_COMPLETED
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.request import Request
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.scheduler.output import GrammarBitmask, ScheduledRequest
from pagedllm.threads import single_thread
from pagedllm.structured_output import backend as xgrammar_backend

logger = logging.getLogger("pagedllm.structured_output")

JSON_KINDS = ("json", "json_object")  # constraints whose masks also drop JSON-illegal control characters

# Constraints longer than this (as text) compile on their own thread: a 16 KiB choice list
# compiles in ~0.1 s here, 64 KiB in ~0.9 s, 1 MiB in minutes (AMD EPYC Zen 4).
SMALL_CONSTRAINT_CHARS = 16 << 10


@dataclass
class _Held:
    future: Future
    samples: list[Request]


class StructuredOutputManager:
    def __init__(self, tokenizer: Any | None, vocab_size: int, stop_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._backend: xgrammar_backend.XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        # Two compiler threads: constraints up to SMALL_CONSTRAINT_CHARS (nearly all: ~0.1 s at
        # most) never wait behind a big one (a 1 MiB choice list compiles for minutes, and a
        # compile cannot be stopped once started, even when its request is aborted).
        self._pools: dict[bool, ThreadPoolExecutor] = {}
        self._compiling: dict[tuple, Future] = {}  # constraint key -> its compile, while it runs
        self._held: dict[str, _Held] = {}  # parent request id -> samples waiting for the grammar
        self._matchers: dict[str, Any] = {}  # request id -> its GrammarMatcher
        self._owners: dict[str, Request] = {}  # request id -> the request its matcher is for
        self.num_compiled = 0

    # ------------------------------------------------------------------ before queueing
    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError naming the problem for an invalid constraint (a cheap parse, no compile)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this model has none")
        try:
            xgrammar_backend.parse(params)
        except ImportError as e:
            raise ValueError("structured_outputs need xgrammar, which is not installed "
                             "(pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi)") from e  # fmt: skip

    def backend(self) -> xgrammar_backend.XgrammarBackend:
        """Built on first use (importing xgrammar and reading the vocabulary takes a moment)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = xgrammar_backend.XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backend

    def _pool_for(self, spec: str) -> ThreadPoolExecutor:
        """The compiler thread for a constraint of this text (``params.spec``), made on first use.
        Its torch ops run single-threaded: only the engine's thread may run OpenMP teams
        (pagedllm/threads.py). Not a daemon thread: Python would end it at exit inside xgrammar's
        C++ code, which aborts the process; so exit waits for a compile still running."""
        big = len(spec) > SMALL_CONSTRAINT_CHARS
        if big not in self._pools:
            name = "pagedllm-grammar-big" if big else "pagedllm-grammar"
            self._pools[big] = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=single_thread)
        return self._pools[big]

    def _compile(self, params: StructuredOutputsParams) -> Future:
        key = params.key  # (kind, spec, ...): the spec is written out once
        future = self._compiling.get(key)
        if future is None:  # identical constraints arriving together compile once
            future = self._pool_for(key[1]).submit(lambda: self.backend().compile(params))
            self._compiling[key] = future
            future.add_done_callback(lambda _f: self._compiling.pop(key, None))
        return future

    def add(self, samples: list[Request]) -> None:
        """Hold a request's samples until their grammar is compiled."""
        params = samples[0].sampling_params.structured_outputs
        assert params is not None
        self._held[samples[0].parent_id] = _Held(self._compile(params), samples)

    @property
    def has_held(self) -> bool:
        return bool(self._held)

    def held(self) -> list[Request]:
        """Samples waiting for their grammar (not yet queued)."""
        return [req for h in list(self._held.values()) for req in h.samples]  # (a copy: the metrics thread reads it too)

    def wait_for_any(self, timeout: float) -> None:
        """Block until a held grammar is ready (when nothing else is to be done)."""
        if self._held:
            wait([h.future for h in self._held.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def take_ready(self) -> list[tuple[list[Request], BaseException | None]]:
        """Held requests whose grammar is done: (samples, None) with a matcher each, or
        (samples, the error) when compiling failed (a ValueError: the constraint is invalid)."""
        ready = []
        for parent_id, held in list(self._held.items()):
            if not held.future.done():
                continue
            del self._held[parent_id]
            error = held.future.exception()
            if error is not None:
                ready.append((held.samples, error))
                continue
            compiled = held.future.result()
            backend = self.backend()
            for req in held.samples:
                self._matchers[req.request_id] = backend.matcher(compiled)
                self._owners[req.request_id] = req
            self.num_compiled += 1
            ready.append((held.samples, None))
        return ready

    def drop(self, parent_id: str) -> list[Request]:
        """Forget a held request (aborted before its grammar was ready); returns its samples.
        Its compile is cancelled if it has not started and no other held request waits for it."""
        held = self._held.pop(parent_id, None)
        if held is None:
            return []
        if all(h.future is not held.future for h in self._held.values()):
            held.future.cancel()  # (False once running: a compile cannot be stopped)
        return held.samples

    # ------------------------------------------------------------------ each step
    def bitmask(self, scheduled: list[ScheduledRequest]) -> GrammarBitmask | None:
        """The masks of the step's rows that sample under a grammar (None when there are none)."""
        if not self._matchers:
            return None
        ids = [s.req_id for s in scheduled if s.samples and s.req_id in self._matchers]
        if not ids:
            return None
        backend = self.backend()
        mask = torch.empty(len(ids), backend.bitmask_width, dtype=torch.int32)
        kinds = [self._owners[req_id].sampling_params.structured_outputs.kind for req_id in ids]
        json_rows = [row for row, kind in enumerate(kinds) if kind in JSON_KINDS]
        tag_rows = [row for row, kind in enumerate(kinds) if kind == "structural_tag"]
        backend.fill_bitmask([self._matchers[i] for i in ids], mask, json_rows, tag_rows)
        # xgrammar takes UTF-8-encoded surrogates (ED A0-BF ..) as characters; they are not
        # UTF-8, decode to three U+FFFD and so break maxLength (found by a test's random model).
        after_ed = [row for row, req_id in enumerate(ids) if backend.ends_in_ed(self._owners[req_id].output_token_ids)]
        if after_ed:
            mask[after_ed] &= backend.no_surrogate_tail
        return GrammarBitmask({req_id: row for row, req_id in enumerate(ids)}, mask)

    def under_json(self, req_id: str) -> bool:
        """Whether the request with this id samples under a JSON constraint (json, json_object)."""
        return self._owners[req_id].sampling_params.structured_outputs.kind in JSON_KINDS

    def tracks(self, req_id: str) -> bool:
        return req_id in self._matchers

    def accept(self, req_id: str, tokens: list[int]) -> bool:
        """Advance ``req_id``'s matcher; True once its grammar is complete (nothing may follow).

        A token the grammar refuses (it was masked, so only a bug or a conflicting setting such
        as min_tokens banning the only allowed token gets here) raises ValueError.
        """
        matcher = self._matchers[req_id]
        for token in tokens:
            if not matcher.accept_token(token):
                raise ValueError(f"token {token} does not fit the request's structured_outputs constraint")
        return bool(matcher.is_terminated())

    def forget(self, req_ids: set[str] | list[str]) -> None:
        """Drop the matchers of ended requests. An id whose matcher belongs to a live request
        was reused: the ended request's step reports it after the new one was admitted."""
        for req_id in req_ids:
            owner = self._owners.get(req_id)
            if owner is not None and not owner.status.finished:
                continue
            self._matchers.pop(req_id, None)
            self._owners.pop(req_id, None)

    def shutdown(self) -> None:
        """Cancel the queued compiles and let the compiler threads end after the one running
        (if any: a compile cannot be stopped)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()
