"""Turns the logits of a step into one token per sampling row, all rows at once.

Order of operations (as vLLM): raw log-probabilities are taken first (what ``logprobs``
reports); then allowed-token masks, banned tokens (bad words, EOS before ``min_tokens``),
logit bias, penalties and, last, the grammar's token bitmask (structured outputs: the grammar
wins where it conflicts with a ban); greedy rows take the argmax of that; the others are divided by
their temperature, filtered by min-p, top-k and top-p, and sampled.

Sampling uses the "exponential race": with E ~ Exp(1) per vocabulary entry,
argmax(p / E) is a draw from p. A seeded request draws its noise from its own generator,
so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    logit_bias: list[tuple[int, int, float]] = field(default_factory=list)  # (row, token, bias)
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, allowed token ids)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, banned token ids)
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None = not requested
    # Structured outputs: row bitmask_rows[i] may only take the tokens token_bitmask[i] allows.
    bitmask_rows: list[int] = field(default_factory=list)
    token_bitmask: torch.Tensor | None = None  # [len(bitmask_rows), ceil(vocab / 32)] int32

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[RowLogprobs | None]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int | None]) -> list[RowLogprobs | None]:
    """Per row: the log-probability and 1-based rank of ``token_ids[row]``, plus the top-k.

    ``logprobs`` [rows, vocab] is a log-softmax; rows whose k is None get None.
    """
    wanted = [k for k in ks if k is not None]
    if not wanted:
        return [None] * len(ks)
    k_max = max(wanted)
    top = logprobs.topk(k_max, dim=-1) if k_max > 0 else None
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    return [
        None
        if k is None
        else RowLogprobs(
            token_logprob=float(chosen[row]),
            token_rank=int(ranks[row]),
            top_ids=top.indices[row, :k].tolist() if top is not None else [],
            top_logprobs=top.values[row, :k].tolist() if top is not None else [],
        )
        for row, k in enumerate(ks)
    ]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place, on the penalized rows: repetition (HF), then frequency and presence (OpenAI)."""
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
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (keeps at least one).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= batch.top_p.to(logits.device)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    return logits


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
        raw_logprobs, masked = self.prepare(logits, batch)
        tokens = masked.argmax(dim=-1)
        if not batch.all_greedy:
            is_greedy = batch.temperatures.to(logits.device) == 0
            probs = self.probs(masked, batch)
            noise = self._noise(probs, batch.generators)
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(is_greedy, tokens, sampled)

        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, gather_logprobs(raw_logprobs, tokens, batch.num_logprobs))

    def prepare(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(raw log-probabilities if any row asks for them, the logits after every mask, ban,
        bias, penalty and grammar): greedy rows take the argmax of the latter."""
        want_logprobs = any(k is not None for k in batch.num_logprobs)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None

        raw = logits
        if batch.allowed or batch.banned or batch.logit_bias or batch.penalty_rows or batch.bitmask_rows:
            logits = logits.clone()
        for row, ids in batch.allowed:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[ids] = True
            logits[row].masked_fill_(~keep, float("-inf"))
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
        if batch.logit_bias:
            rows, toks, biases = zip(*batch.logit_bias)
            logits.index_put_(
                (torch.tensor(rows), torch.tensor(toks)), torch.tensor(biases, dtype=logits.dtype), accumulate=True
            )
        if batch.penalty_rows:
            apply_penalties(logits, batch)
        if batch.bitmask_rows:
            apply_grammar(logits, raw, batch)
        return raw_logprobs, logits

    @staticmethod
    def probs(masked: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each sampling row draws from: temperature, then min-p, top-k and
        top-p (greedy rows are left at temperature 1; their argmax is taken elsewhere)."""
        temps = batch.temperatures.to(masked.device)
        scaled = masked / torch.where(temps == 0, 1.0, temps)[:, None]
        return apply_top_k_top_p_min_p(scaled, batch).softmax(dim=-1)

    def _noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            return noise.exponential_(generator=self.generator)
        if unseeded:
            rows = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise[unseeded] = rows.exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise
