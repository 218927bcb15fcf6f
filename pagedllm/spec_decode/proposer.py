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
from pagedllm.spec_decode.draft_length import VERIFY_COST_PER_TOKEN, DraftCost, DraftLengthPolicy, step_nbytes, verify_cost
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import DEFAULT_EAGLE, EagleHead, EagleProposer
from pagedllm.spec_decode.medusa import DEFAULT_MEDUSA, MedusaHeads, MedusaProposer
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.packed_linear import draft_lm_head, pack_linears


class _State(Protocol):
    req_id: str
    sampling_params: SamplingParams
    token_ids: list[int]
    output_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    spec_hits: float  # draft_length.DraftLengthPolicy's acceptance history
    spec_misses: float
    spec_backoff: int  # steps to wait before the next probe (0: none yet)
    spec_skip: int  # steps left without drafts
    spec_drafted: int  # tokens in the last draft proposed


def can_speculate(params: SamplingParams, bad_words: list[list[int]]) -> bool:
    """Whether drafts are verified exactly for these params. Penalties, bans before min_tokens,
    bad words and grammars change a position's distribution with the tokens before it, which
    verify_drafts does not model: such requests decode one token at a time."""
    return not (params.needs_penalties or params.min_tokens > 0 or bad_words or params.structured_outputs is not None)


class Proposer:
    """Drafts for the step's requests that just sampled, unless the batch is too big to gain.

    Each request drafts as many tokens as its acceptance rate pays for, given the method's cost
    (``draft_length.DraftLengthPolicy``): a request whose drafts are mostly rejected stops
    drafting and only probes now and then, so speculation never costs much more than it saves."""

    def __init__(self, config: SpeculativeConfig, drafter: Any = None, cost: DraftCost = DraftCost(),
                 verify: float = VERIFY_COST_PER_TOKEN):
        """``drafter``: the model-based proposer of the method (e.g. ``DraftModelProposer``)
        with ``propose(req_ids, token_ids, limits, hidden)`` and ``forget(req_id)``; None for
        n-gram. ``cost``: its work per draft, in plain decode steps of the target; ``verify``:
        the target's price of one more verified token (``draft_length.verify_cost``)."""
        self.config = config
        self._ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.drafter = drafter
        # Before a request's first verified draft: prompt lookup drafts only where the text
        # repeated already (a good sign), a model always drafts (trained heads are right ~1/3).
        prior = 0.5 if drafter is None else 0.3
        self.lengths = DraftLengthPolicy(config.num_speculative_tokens, cost, prior, config.auto_length, verify)

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
        features: list[tuple[int, Any]] | None = None, drafted: list[int] | None = None,
    ) -> list[list[int]]:
        """``accepted[i]``: how many of state i's draft tokens this step accepted (None: it had
        none) out of ``drafted[i]`` (default: as many as it was proposed); ``hidden`` (when
        ``needs_hidden``): row i is state i's last hidden state; ``features`` (when
        ``needs_features``): state i's (first position, hidden states of its verified positions
        this step)."""
        for i, (s, a) in enumerate(zip(states, accepted)):
            if a is not None:
                self.lengths.record(s, drafted[i] if drafted is not None else s.spec_drafted, a)
        if len(states) >= self.config.disable_by_batch_size:
            return [[] for _ in states]
        if features is not None:  # unobserved steps leave a gap: the drafter then starts the context over
            for s, (position, rows) in zip(states, features):
                if can_speculate(s.sampling_params, s.bad_words_token_ids):
                    self.drafter.observe(s.req_id, position, rows)
        drafts: list[list[int]] = [[] for _ in states]
        # Requests that may draft now, with the room left before max_tokens (the scheduler trims
        # drafts the same way).
        ready = [(i, s.sampling_params.max_tokens - len(s.output_token_ids) - 1) for i, (s, did) in enumerate(zip(states, sampled))
                 if did and can_speculate(s.sampling_params, s.bad_words_token_ids)]  # fmt: skip
        ready = [(i, room) for i, room in ready if room > 0 and not self.lengths.waiting(states[i])]
        if self.drafter is None:
            # Prompt lookup looks first (it is cheap) and asks the policy only where the text
            # offers a draft: a request's probe then waits for a step with something to try.
            found = self._ngram.propose([states[i].token_ids for i, _ in ready])
            for (i, room), d in zip(ready, found):
                if d:
                    drafts[i] = d[: min(room, self.lengths.choose(states[i]))]
                states[i].spec_drafted = len(drafts[i])
            return drafts
        wanted = [(i, min(room, k)) for i, room in ready if (k := self.lengths.choose(states[i])) > 0]
        if not wanted:
            return drafts
        token_ids = [states[i].token_ids for i, _ in wanted]
        rows = hidden[[i for i, _ in wanted]] if self.needs_hidden else None
        found = self.drafter.propose([states[i].req_id for i, _ in wanted], token_ids, [k for _, k in wanted], rows)
        for (i, _), d in zip(wanted, found):
            drafts[i] = d
            states[i].spec_drafted = len(d)
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
    drafter, cost = None, DraftCost()
    # Decode reads every weight once per step, so a drafter's cost is its weight bytes per pass
    # over the target's (plus a little dispatch for each model-based pass).
    target_bytes = max(1, step_nbytes(target))
    if config.method == "draft_model":
        drafter = DraftModelProposer(draft_model, k, pool.num_blocks, pool.block_size, pool.max_model_len,
                                     pool.kv_spec, pool.backend, pool.device)  # fmt: skip
        cost = DraftCost(fixed=DISPATCH_COST, per_token=step_nbytes(draft_model) / target_bytes)
    elif config.method == "eagle":
        head = EagleHead.load(Path(config.model or DEFAULT_EAGLE), target.arch.hidden_size, target.arch.vocab_size)
        drafter = EagleProposer(head, target, k, pool.num_blocks, pool.block_size, pool.max_model_len, pool.kv_spec,
                                pool.backend, pool.device)  # fmt: skip
        lm_head = drafter.lm_head if drafter.lm_head is not None else target.lm_head
        per_pass = (step_nbytes(head) + step_nbytes(lm_head)) / target_bytes
        cost = DraftCost(fixed=DISPATCH_COST, per_token=per_pass + DISPATCH_COST)
    elif config.method == "medusa":
        heads = MedusaHeads.load(Path(config.model or DEFAULT_MEDUSA), target.arch.hidden_size, target.arch.vocab_size)
        pack_linears(heads)  # read once per drafting step: Q8_0 blocks, not fp32
        lm_head = target.lm_head if heads.d2t is None else draft_lm_head(target.lm_head, heads.d2t)
        drafter = MedusaProposer(heads, k, target.compute_logits if heads.d2t is None else lm_head)
        cost = DraftCost(fixed=(step_nbytes(heads) + step_nbytes(lm_head)) / target_bytes + DISPATCH_COST)
    return Proposer(config, drafter, cost, verify_cost(target))


# Python dispatch of one model-based drafting pass, in plain decode steps (~0.3 ms of ~5.3 ms).
DISPATCH_COST = 0.06
