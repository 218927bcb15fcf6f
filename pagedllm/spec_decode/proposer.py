"""Which requests get drafts, and from which proposer (the runner's one seam for drafting)."""

from __future__ import annotations

from typing import Protocol

from pagedllm.sampling_params import SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import NgramProposer


class _State(Protocol):
    sampling_params: SamplingParams
    token_ids: list[int]
    bad_words_token_ids: list[list[int]]


def can_speculate(params: SamplingParams, bad_words: list[list[int]]) -> bool:
    """Whether drafts are verified exactly for these params. Penalties, bans before min_tokens,
    bad words and grammars change a position's distribution with the tokens before it, which
    verify_drafts does not model: such requests decode one token at a time."""
    return not (params.needs_penalties or params.min_tokens > 0 or bad_words or params.structured_outputs is not None)


class Proposer:
    """Drafts for the step's requests that just sampled, unless the batch is too big to gain."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, states: list[_State], sampled: list[bool]) -> list[list[int]]:
        if len(states) >= self.config.disable_by_batch_size:
            return [[] for _ in states]
        wanted = [i for i, (s, did) in enumerate(zip(states, sampled))
                  if did and can_speculate(s.sampling_params, s.bad_words_token_ids)]  # fmt: skip
        drafts: list[list[int]] = [[] for _ in states]
        for i, d in zip(wanted, self._ngram.propose([states[i].token_ids for i in wanted])):
            drafts[i] = d
        return drafts


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    return None if config is None else Proposer(config)
