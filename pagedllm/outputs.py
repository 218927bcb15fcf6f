"""What a request gives back, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class RowLogprobs:
    """Raw log-probabilities of one sampled row, as the sampler returns them (decoded into
    ``PositionLogprobs`` by the output processor)."""

    token_logprob: float
    token_rank: int  # 1-based rank of the sampled token in the raw distribution
    top_ids: list[int]
    top_logprobs: list[float]


# One position's entries: the chosen token plus the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    With streaming (delta) outputs, ``text``, ``token_ids`` and ``logprobs`` hold only what
    is new since the previous output of the request.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Set when the engine failed this request (finish_reason "error"): the cause, for logs.
    error: str | None = None
    # With `error`: the request itself was invalid (found in the engine, not when it was
    # added), so `error` is the user's to read, like a ValueError's message.
    rejected: bool = False
    # The LoRARequest the request ran with (None: the base model), as vLLM's RequestOutput.
    lora_request: Any = None
