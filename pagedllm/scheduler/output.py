"""What the scheduler decided for one step: the contract between scheduler and model runner.

Plain data only - ids, token ids, block ids, counts, sampling params - so a runner can live
in another process (tensor parallel) and never reads the scheduler's ``Request`` objects.
The runner keeps its own state per request, built from ``NewRequestData`` the first time it
sees one, extended with the tokens it samples, and dropped when the id shows up in
``finished_req_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.kv_connector.base import KVConnectorMetadata
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen, or must relearn (resumed after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before a preemption; [] for a new request
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]]
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class ScheduledRequest:
    """Run tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of ``req_id``."""

    req_id: str
    num_new_tokens: int
    num_computed_tokens: int
    block_ids: list[int]  # the request's whole block table after this step's allocation (KV group 0)
    samples: bool  # the chunk reaches the end of the known tokens, so a new token is due
    new: NewRequestData | None = None  # set when the runner must (re)learn the request
    # The tables of KV-cache groups 1.. (models with sliding-window layers; kv_cache/groups.py).
    group_block_ids: tuple[list[int], ...] = ()
    # Draft tokens run after the known ones (counted in num_new_tokens), verified by the runner.
    spec_token_ids: list[int] = field(default_factory=list)

    def num_accepted(self, drawn: list[int]) -> int | None:
        """Draft tokens accepted, given the tokens the step drew for this request (the accepted
        drafts and one more); None when it ran no drafts."""
        return len(drawn) - 1 if self.spec_token_ids and drawn else None


@dataclass
class GrammarBitmask:
    """Next-token masks of the step's grammar-constrained rows (structured outputs).

    Row ``rows[req_id]`` of ``bitmask`` allows token t when bit t % 32 of word t // 32 is set;
    the sampler masks every other token before sampling.
    """

    rows: dict[str, int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32

    def __reduce__(self) -> tuple:
        # To TP/PP workers as a numpy array: torch's own pickling of the tensor took ~10x as long.
        return _bitmask_from_numpy, (self.rows, self.bitmask.numpy())


def _bitmask_from_numpy(rows: dict[str, int], bitmask: Any) -> GrammarBitmask:
    return GrammarBitmask(rows, torch.from_numpy(bitmask))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that ended or were preempted since the previous step: the runner forgets them
    # (before it learns this step's new requests, so a resumed request starts afresh).
    finished_req_ids: set[str] = field(default_factory=set)
    # Copy-on-write block copies (src, dst) to apply before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Swap preemption: (primary, swap) block copies to save, then (swap, primary) to restore.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Prefix cache, in tokens, for requests admitted for the first time this step.
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_uncacheable_tokens: int = 0  # beyond the last cacheable full block
    # Token masks for requests under a grammar that sample this step (engine-filled).
    grammar: GrammarBitmask | None = None
    # KV connector: blocks to load before the forward, blocks to save after it (kv_connector/).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Per scheduled request (in ``SchedulerOutput.scheduled`` order): the tokens drawn (none
    mid-prompt, else one, or with drafts the accepted ones plus one) and their log-probabilities;
    prompt log-probabilities by request; draft tokens proposed for the next step."""

    req_ids: list[str]
    sampled: list[list[int]]
    logprobs: list[list]  # per request: a RowLogprobs (or None) per drawn token
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)  # (first position, entries)
    spec_token_ids: list[list[int]] = field(default_factory=list)  # empty, or one list per request
