"""Which requests get drafts, and from which proposer (the runner's one seam for drafting)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.kv_cache_dtype import KVCacheSpec
from pagedllm.sampling_params import SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import DEFAULT_EAGLE, EagleHead, EagleProposer
from pagedllm.spec_decode.medusa import DEFAULT_MEDUSA, MedusaHeads, MedusaProposer
from pagedllm.spec_decode.ngram import NgramProposer


class _State(Protocol):
    req_id: str
    sampling_params: SamplingParams
    token_ids: list[int]
    output_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    spec_backoff: int  # steps to wait after the next wholly rejected draft (0: none yet)
    spec_skip: int  # steps left without drafts


def can_speculate(params: SamplingParams, bad_words: list[list[int]]) -> bool:
    """Whether drafts are verified exactly for these params. Penalties, bans before min_tokens,
    bad words and grammars change a position's distribution with the tokens before it, which
    verify_drafts does not model: such requests decode one token at a time."""
    return not (params.needs_penalties or params.min_tokens > 0 or bad_words or params.structured_outputs is not None)


MAX_BACKOFF = 16


class Proposer:
    """Drafts for the step's requests that just sampled, unless the batch is too big to gain.

    A wholly rejected draft costs a step k extra rows for nothing, so a request whose draft
    was all rejected waits 1, 2, 4, ... (at most 16) steps before its next draft; any accepted
    token resets the wait. On text that never repeats, drafting then all but stops."""

    def __init__(self, config: SpeculativeConfig, drafter: Any = None):
        """``drafter``: the model-based proposer of the method (e.g. ``DraftModelProposer``)
        with ``propose(req_ids, token_ids)`` and ``forget(req_id)``; None for n-gram."""
        self.config = config
        self._ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.drafter = drafter

    def forget(self, req_id: str) -> None:
        """The request ended or was preempted (a drafter frees whatever it kept for it)."""
        if self.drafter is not None:
            self.drafter.forget(req_id)

    @property
    def needs_hidden(self) -> bool:
        """Whether ``propose`` wants each request's last hidden state (Medusa heads do)."""
        return getattr(self.drafter, "needs_hidden", False)

    @property
    def needs_features(self) -> bool:
        """Whether ``propose`` wants the hidden states of every verified position (EAGLE does)."""
        return getattr(self.drafter, "needs_features", False)

    def propose(
        self, states: list[_State], sampled: list[bool], accepted: list[int | None], hidden: Any = None,
        features: list[tuple[int, Any]] | None = None,
    ) -> list[list[int]]:
        """``accepted[i]``: how many of state i's draft tokens this step accepted (None: it had
        none); ``hidden`` (when ``needs_hidden``): row i is state i's last hidden state;
        ``features`` (when ``needs_features``): state i's (first position, hidden states of its
        verified positions this step)."""
        for s, a in zip(states, accepted):
            if a is None:
                continue
            if a == 0:
                s.spec_skip, s.spec_backoff = s.spec_backoff, min(MAX_BACKOFF, 2 * s.spec_backoff or 1)
            else:
                s.spec_skip = s.spec_backoff = 0
        if len(states) >= self.config.disable_by_batch_size:
            return [[] for _ in states]
        if features is not None:  # unobserved steps leave a gap: the drafter then starts the context over
            for s, (position, rows) in zip(states, features):
                if can_speculate(s.sampling_params, s.bad_words_token_ids):
                    self.drafter.observe(s.req_id, position, rows)
        wanted = []
        for i, (s, did) in enumerate(zip(states, sampled)):
            if not did or not can_speculate(s.sampling_params, s.bad_words_token_ids):
                continue
            if len(s.output_token_ids) + 1 >= s.sampling_params.max_tokens:
                continue  # no room for a draft before max_tokens
            if s.spec_skip > 0:
                s.spec_skip -= 1
                continue
            wanted.append(i)
        drafts: list[list[int]] = [[] for _ in states]
        if not wanted:
            return drafts
        token_ids = [states[i].token_ids for i in wanted]
        if self.drafter is None:
            found = self._ngram.propose(token_ids)
        else:
            # At most what fits before max_tokens (the scheduler trims n-gram drafts the same way).
            limits = [states[i].sampling_params.max_tokens - len(states[i].output_token_ids) - 1 for i in wanted]
            rows = hidden[wanted] if self.needs_hidden else None
            found = self.drafter.propose([states[i].req_id for i in wanted], token_ids, limits, rows)
        for i, d in zip(wanted, found):
            drafts[i] = d
        return drafts


@dataclass
class DraftPool:
    """What a draft model's own paged KV cache is made like: the target's pool."""

    num_blocks: int
    block_size: int
    max_model_len: int
    kv_spec: KVCacheSpec
    backend: AttentionBackend
    device: torch.device


def make_proposer(config: SpeculativeConfig, target: Any, draft_model: Any, pool: DraftPool) -> Proposer:
    """The proposer of ``config.method``: n-gram; a loaded ``draft_model``; or an EAGLE head or
    Medusa heads (``config.model``, else the ones shipped for the default model) over
    ``target``'s features and LM head."""
    k = config.num_speculative_tokens
    drafter = None
    if config.method == "draft_model":
        drafter = DraftModelProposer(draft_model, k, pool.num_blocks, pool.block_size, pool.max_model_len,
                                     pool.kv_spec, pool.backend, pool.device)  # fmt: skip
    elif config.method == "eagle":
        head = EagleHead.load(Path(config.model or DEFAULT_EAGLE), target.arch.hidden_size, target.arch.vocab_size)
        drafter = EagleProposer(head, target, k, pool.num_blocks, pool.block_size, pool.max_model_len, pool.kv_spec,
                                pool.backend, pool.device)  # fmt: skip
    elif config.method == "medusa":
        heads = MedusaHeads.load(Path(config.model or DEFAULT_MEDUSA), target.arch.hidden_size, target.arch.vocab_size)
        drafter = MedusaProposer(heads, k, target.compute_logits)
    return Proposer(config, drafter)
