"""A request's state as the engine and the scheduler see it (the runner gets plain data instead)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RowLogprobs
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks freed, to be recomputed
    SWAPPED = "swapped"  # back in the waiting queue, blocks copied to the swap pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while running this request (and only it)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
)


@dataclass(eq=False)
class Request:
    """Token ids so far plus how many of them have K/V in the cache.

    The scheduler's single invariant: each step, give the request tokens so that
    ``num_computed_tokens`` catches up with ``num_tokens``. A prompt is "prefill" only in the
    sense that many tokens are uncomputed; a decode step is one uncomputed token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first under the "priority" policy
    # Parallel sampling (n > 1) fans out into n requests of one parent (engine/parallel_sampling.py);
    # ``index`` is the sample's place in the parent's outputs.
    parent_id: str | None = None
    index: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None  # what failed, with FINISHED_ERROR (logged; servers do not show it)
    # The error is the request's own: an invalid input only the engine could find (e.g. a
    # constraint that admits no output). Servers answer it as a bad request, with `error`.
    rejected: bool = False
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Raw log-probabilities, filled only when the sampling params ask for them.
    logprobs: list[RowLogprobs] = field(default_factory=list)
    prompt_logprobs: list[RowLogprobs] = field(default_factory=list)  # for prompt tokens 1..n-1
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_prompt_tokens_run: int = 0  # high-water mark, so recomputation is not counted twice
    # Token ids of each of ``sampling_params.bad_words`` (tokenized when the request is added).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Draft tokens (speculative decoding) for the next step to verify; never in all_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter this request runs with (None: the base model)
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.parent_id is None:
            self.parent_id = self.request_id

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def cache_keys(self) -> tuple:
        """Extra keys of this request's prefix-cache block hashes (its adapter and salt, if any)."""
        keys = self.lora_request.cache_key if self.lora_request is not None else ()
        return keys if self.cache_salt is None else (*keys, "cache_salt", self.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_tokens(self) -> int:
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_output_tail(self, n: int) -> None:
        """Forget the last ``n`` output tokens (and their logprobs): a stop string ended the text
        inside a step that emitted several tokens (accepted drafts), so the ones after it were
        never part of the output."""
        if n <= 0:
            return
        del self.output_token_ids[-n:], self.all_token_ids[-n:]
        if self.sampling_params.logprobs is not None:
            for lp in self.logprobs[-n:]:
                self.cumulative_logprob -= lp.token_logprob
            del self.logprobs[-n:]

    def check_stop(self) -> RequestStatus | None:
        """The finished status the last generated token causes, if any."""
        last = self.output_token_ids[-1]
        params = self.sampling_params
        if len(self.output_token_ids) > params.min_tokens:  # EOS/stop ids are banned before
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
