"""Turns the logits of a step into one token per sampling row, all rows at once.

Order of operations (as vLLM): raw log-probabilities are taken first (what ``logprobs``
reports); then allowed-token masks, banned tokens (bad words, EOS before ``min_tokens``),
logit bias, penalties and, last, the grammar's token bitmask (structured outputs: the grammar
wins where it conflicts with a ban); greedy rows take the argmax of that; the others are divided by
their temperature, filtered by min-p, top-k and top-p, and sampled.

Sampling inverts the cumulative distribution: one uniform u per row, and the token is the first
whose cumulative probability exceeds u (``inverse_cdf``). That is one random number per row
instead of one per vocabulary entry (an "exponential race" over 49,152 entries cost ~1.1 ms a
row here, the cumulative sum and search ~0.1). A seeded request draws its u from its own
generator, so its tokens do not depend on the rest of the batch.

Where the native kernels are built, temperature, min-p, top-k, top-p and the draw run in one
native call (``native_draw``: a few passes over each row while it sits in cache, no sort);
``probs`` + ``inverse_cdf`` are its torch rule, and the tests check that both draw the same
token from the same uniform.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from pagedllm.kernels import ops
from pagedllm.outputs import RowLogprobs


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows to sample this step (one row per generated sequence)."""

    temperatures: torch.Tensor  # [rows] fp32; 0 means greedy
    generators: list[torch.Generator | None]  # per row: the sequence's own generator, or None
    top_k: torch.Tensor | None = None  # [rows] int64, 0 = off
    top_p: torch.Tensor | None = None  # [rows] fp32, 1 = off
    min_p: torch.Tensor | None = None  # [rows] fp32, 0 = off
    # Penalties: rows that have any, with their parameters and token histories.
    penalty_rows: list[int] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    output_ids: list[list[int]] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (row, token ids, biases)
    allowed: list[tuple[int, Sequence[int] | torch.Tensor]] = field(default_factory=list)  # (row, allowed token ids)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, banned token ids)
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None = not requested
    # Structured outputs: row bitmask_rows[i] may only take the tokens token_bitmask[i] allows.
    bitmask_rows: list[int] = field(default_factory=list)
    token_bitmask: torch.Tensor | None = None  # [len(bitmask_rows), ceil(vocab / 32)] int32

    @property
    def all_greedy(self) -> bool:
        # On the list: a compare, a reduction and a bool of a tensor cost ~0.1 ms a step on the
        # caches the LM head has just flushed (one W2 step is ~6 ms).
        return not any(self.temperatures.tolist())


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[RowLogprobs | None]


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int | None], rows: list[int] | None = None
) -> list[RowLogprobs | None]:
    """Per row (``rows`` of ``logits``, or all of them): the log-probability and 1-based rank
    of ``token_ids[i]`` in the row's log-softmax, plus its top-k; rows whose k is None get None.

    ``logits`` are the raw logits. Natively where the row kernels run (``ops.logprobs_rows``: a
    few passes over each row in cache), else log_softmax, a gather, a count and topk in torch."""
    rows = list(range(logits.shape[0])) if rows is None else rows
    wanted = [i for i, k in enumerate(ks) if k is not None]
    if not wanted:
        return [None] * len(ks)
    k_max = max(ks[i] for i in wanted)
    sel = torch.tensor([rows[i] for i in wanted], dtype=torch.int64)
    ids = token_ids.reshape(-1)[torch.tensor(wanted)]
    if ops.native_rows(logits):
        chosen, ranks, top_ids, top_lps = ops.logprobs_rows(logits, sel, ids, k_max)
    else:
        logprobs = logits[sel.to(logits.device)].log_softmax(dim=-1)
        chosen = logprobs.gather(1, ids.to(logits.device)[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        top = logprobs.topk(k_max, dim=-1)
        top_ids, top_lps = top.indices, top.values
    out: list[RowLogprobs | None] = [None] * len(ks)
    chosen_l, ranks_l, ids_l, lps_l = chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lps.tolist()
    for j, i in enumerate(wanted):
        k = ks[i]
        out[i] = RowLogprobs(token_logprob=chosen_l[j], token_rank=ranks_l[j], top_ids=ids_l[j][:k],
                             top_logprobs=lps_l[j][:k])  # fmt: skip
    return out


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place, on the penalized rows: repetition (HF), then frequency and presence (OpenAI).

    Natively where the kernels run (``ops.apply_penalties``: only the history's tokens are
    touched, bit for bit what the torch code below computes over the whole vocabulary)."""
    if ops.native_rows(logits):
        ops.apply_penalties(
            logits, batch.penalty_rows, batch.output_ids, batch.prompt_ids, batch.presence, batch.frequency,
            batch.repetition,
        )  # fmt: skip
        return
    rows = torch.tensor(batch.penalty_rows, device=logits.device)
    sub = logits[rows]
    vocab = logits.shape[1]
    counts = torch.zeros_like(sub)
    in_prompt = torch.zeros_like(sub, dtype=torch.bool)
    for i, (out_ids, prompt_ids) in enumerate(zip(batch.output_ids, batch.prompt_ids)):
        if out_ids:
            ids = torch.tensor(out_ids, device=logits.device)
            counts[i].index_add_(0, ids, torch.ones(len(out_ids), device=logits.device))
        if prompt_ids:
            in_prompt[i, torch.tensor(prompt_ids, device=logits.device)] = True
    rep = torch.tensor(batch.repetition, device=logits.device)[:, None]
    seen = in_prompt | (counts > 0)
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    freq = torch.tensor(batch.frequency, device=logits.device)[:, None]
    pres = torch.tensor(batch.presence, device=logits.device)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    assert sub.shape[1] == vocab
    logits[rows] = sub


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) what min-p, top-k and top-p remove; logits are temperature-scaled."""
    neg_inf = float("-inf")
    if batch.min_p is not None and bool((batch.min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.to(logits.device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, neg_inf)
    if batch.top_k is not None and bool((batch.top_k > 0).any()):
        vocab = logits.shape[1]
        k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp(max=vocab).to(logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, neg_inf)
    if batch.top_p is not None and bool((batch.top_p < 1).any()):
        top_p = batch.top_p.to(logits.device)
        if bool((top_p < 1).all()):
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < top_p_floor(probs, top_p)[:, None], neg_inf)
        else:  # only the rows that ask for it
            rows = (top_p < 1).nonzero()[:, 0]
            probs = logits[rows].softmax(dim=-1)
            floor = top_p_floor(probs, top_p[rows])
            logits = logits.index_put((rows,), logits[rows].masked_fill(probs < floor[:, None], neg_inf))
    return logits


# Nucleus sizes tried, in order, before sorting a whole row: the nucleus of top_p <= 0.95 of an
# instruct model's next-token distribution is usually far smaller than the vocabulary, and a
# top-k of it costs a fraction of the full sort (measured in docs/benchmarks.md).
TOP_P_CANDIDATES = (256, 4096)


def top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [rows, vocab], the smallest probability top-p keeps: the nucleus is
    the most likely tokens whose mass first reaches top_p, so a token stays when its
    probability is at least that of the nucleus's last token (ties with it stay too). A row
    whose whole mass falls short of top_p (rounding) keeps everything.

    The nucleus is looked for among the top 256, then 4,096 tokens, and only rows whose nucleus
    is bigger are sorted whole, instead of sorting every row."""
    vocab = probs.shape[1]
    floor = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    todo = torch.arange(probs.shape[0], device=probs.device)
    for k in [c for c in TOP_P_CANDIDATES if c < vocab] + [vocab]:
        top = (probs if len(todo) == probs.shape[0] else probs[todo]).topk(k, dim=-1).values  # descending
        last = (top.cumsum(dim=-1) < top_p[todo, None]).sum(dim=-1)  # index of the nucleus's last token
        found = last < k
        floor[todo[found]] = top[found].gather(1, last[found, None])[:, 0]
        todo = todo[~found]
        if len(todo) == 0:
            break
    return floor


def apply_grammar(logits: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch) -> None:
    """Mask what each constrained row's grammar forbids, in one kernel call for all rows.

    A row left with no token at all (an allowed-ids list or a ban, e.g. EOS before min_tokens,
    removed everything the grammar allows) falls back to the grammar alone: the output must
    stay valid.
    """
    assert batch.token_bitmask is not None
    rows = torch.tensor(batch.bitmask_rows, dtype=torch.int64)
    ops.apply_token_bitmask(logits, rows, batch.token_bitmask)
    restricted = {r for r, _ in batch.allowed} | {r for r, _ in batch.banned}
    for i, row in enumerate(batch.bitmask_rows):
        if row in restricted and bool(torch.isneginf(logits[row]).all()):
            logits[row] = raw[row]
            ops.apply_token_bitmask(logits, torch.tensor([row]), batch.token_bitmask[i : i + 1])


class Sampler:
    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [rows, vocab] fp32 -> one token (and optional logprobs) per row."""
        raw, masked = self.prepare(logits, batch)
        tokens = ops.argmax(masked)
        if not batch.all_greedy:
            is_greedy = batch.temperatures.to(logits.device) == 0
            u = self._uniforms(batch.generators, logits.device)
            if ops.native_rows(masked):
                sampled = native_draw(masked, batch, u, is_greedy)
            else:
                sampled = inverse_cdf(self.probs(masked, batch), u)
            tokens = torch.where(is_greedy, tokens, sampled)

        token_list = tokens.tolist()
        if raw is None:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, gather_logprobs(raw, tokens, batch.num_logprobs))

    def prepare(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the raw logits if any row asks for logprobs - they are reported from the model's own
        distribution -, the logits after every mask, ban, bias, penalty and grammar): greedy rows
        take the argmax of the latter."""
        want_logprobs = any(k is not None for k in batch.num_logprobs)
        raw = logits
        if batch.allowed or batch.banned or batch.logit_bias or batch.penalty_rows or batch.bitmask_rows:
            logits = logits.clone()
        for row, ids in batch.allowed:
            logits[row] = _keep_only(raw[row], ids)
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
        if batch.allowed and batch.banned:
            # Bans (bad words, min_tokens' stop tokens) that leave no allowed token give way to
            # allowed_token_ids, the hard limit: the output never leaves the allowed set.
            banned_rows = {row for row, _ in batch.banned}
            for row, ids in batch.allowed:
                if row in banned_rows and bool(torch.isneginf(logits[row]).all()):
                    logits[row] = _keep_only(raw[row], ids)
        for row, ids, biases in batch.logit_bias:
            logits[row].index_add_(0, ids.to(logits.device), biases.to(logits.device, logits.dtype))
        if batch.penalty_rows:
            apply_penalties(logits, batch)
        if batch.bitmask_rows:
            apply_grammar(logits, raw, batch)
        return (raw if want_logprobs else None), logits

    @staticmethod
    def probs(masked: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each sampling row draws from: temperature, then min-p, top-k and
        top-p (greedy rows are left at temperature 1; their argmax is taken elsewhere)."""
        temps = batch.temperatures.to(masked.device)
        scaled = masked / torch.where(temps == 0, 1.0, temps)[:, None]
        return apply_top_k_top_p_min_p(scaled, batch).softmax(dim=-1)

    def _uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: a seeded row's from its own generator, the others' from
        the sampler's."""
        u = torch.empty(len(generators), dtype=torch.float64)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand((), generator=g, dtype=torch.float64)
        return u.to(device)


def _keep_only(row: torch.Tensor, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``row`` with every token but ``ids`` at -inf (allowed_token_ids)."""
    keep = torch.zeros(row.shape[0], dtype=torch.bool, device=row.device)
    keep[ids] = True
    return row.masked_fill(~keep, float("-inf"))


def filter_params(batch: SamplingBatch, rows: int) -> tuple[torch.Tensor, ...]:
    """(temperature, min_p, top_k, top_p) per row as the native kernels take them, "off" where unset."""
    min_p = batch.min_p if batch.min_p is not None else torch.zeros(rows)
    top_k = batch.top_k if batch.top_k is not None else torch.zeros(rows, dtype=torch.int64)
    top_p = batch.top_p if batch.top_p is not None else torch.ones(rows)
    return batch.temperatures.to(torch.float32), min_p, top_k, top_p


def native_draw(masked: torch.Tensor, batch: SamplingBatch, u: torch.Tensor, is_greedy: torch.Tensor) -> torch.Tensor:
    """What ``inverse_cdf(Sampler.probs(masked, batch), u)`` draws, by the native kernel
    (``ops.sample_rows``: a few passes over each row in cache instead of ~10 full-vocabulary torch
    ops). Only the sampling rows are passed; greedy rows get 0 (their argmax is taken elsewhere)."""
    rows = masked.shape[0]
    temps, min_p, top_k, top_p = filter_params(batch, rows)
    if not bool(is_greedy.any()):
        return ops.sample_rows(masked, temps, min_p, top_k, top_p, u)
    idx = (~is_greedy).nonzero()[:, 0]
    out = torch.zeros(rows, dtype=torch.int64)
    out[idx] = ops.sample_rows(masked[idx], temps[idx], min_p[idx], top_k[idx], top_p[idx], u[idx])
    return out


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's draw in proportion to ``weights[i]`` (>= 0, not necessarily normalised) from the
    uniform ``u[i]`` in [0, 1): the first token whose cumulative weight exceeds u times the
    total. The sums are in float64, so u x total stays below the total and the token found
    always has a positive weight."""
    cdf = weights.to(torch.float64).cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0]
