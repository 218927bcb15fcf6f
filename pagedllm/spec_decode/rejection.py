"""Verify draft tokens against the target model's distributions, keeping its output exact.

A request with k draft tokens d_0..d_{k-1} has k + 1 rows of target logits: row j is the
distribution of the token after d_0..d_{j-1}. Greedy rows accept d_j while it is the target's
argmax and then emit the target's own token, so the output is token for token what decoding
one token at a time gives (the logits of a row do not depend on the batch: docs/determinism.md).

Sampling rows use the rejection rule of Leviathan et al. / Chen et al. (2023) with a draft
distribution q. Our proposers are deterministic (q is a point mass on d_j), so: accept d_j with
probability p_j(d_j); on rejection draw from p_j with d_j removed, renormalised; after k
acceptances draw a bonus token from p_k. Then P(token = x) = p(d)[x = d] + (1 - p(d)) p(x)[x != d]
/ (1 - p(d)) = p(x): exactly the target distribution (temperature, top-k, top-p and min-p
applied first, as the sampler does). Draws come from the request's own generator when seeded.
"""

from __future__ import annotations

import torch

from pagedllm.kernels import ops
from pagedllm.outputs import RowLogprobs
from pagedllm.sampler.sampler import Sampler, SamplingBatch, gather_logprobs, inverse_cdf


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]]
) -> tuple[list[list[int]], list[list[RowLogprobs | None]]]:
    """Per request: the tokens to append (accepted drafts + one target token) and their logprobs.

    ``logits`` has ``len(d) + 1`` consecutive rows per request ``d`` in ``drafts`` (a request
    without drafts has one row, sampled as usual); ``batch`` has one entry per row.
    """
    raw_logprobs, masked = sampler.prepare(logits, batch)
    greedy_tokens = ops.argmax(masked).tolist()
    temps = batch.temperatures.tolist()
    probs = sampler.probs(masked, batch) if not batch.all_greedy else None
    tokens: list[list[int]] = []
    row = 0
    for draft in drafts:
        rows = range(row, row + len(draft) + 1)
        if temps[row] == 0:
            out = _accept_greedy(draft, greedy_tokens[row : row + len(draft) + 1])
        else:
            g = batch.generators[row] or sampler.generator
            out = _accept_sampled(draft, probs[rows.start : rows.stop], g)
        tokens.append(out)
        row = rows.stop
    assert row == logits.shape[0]
    return tokens, _logprobs(raw_logprobs, batch, drafts, tokens)


def _accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return target[: a + 1]


def _accept_sampled(draft: list[int], p: torch.Tensor, g: torch.Generator) -> list[int]:
    """``p``: [len(draft) + 1, vocab] target probabilities; one uniform per draft position."""
    out: list[int] = []
    for j, d in enumerate(draft):
        u = torch.rand((), generator=g, device=p.device)
        if u < p[j, d]:
            out.append(d)
            continue
        residual = p[j].clone()
        residual[d] = 0
        out.append(_draw(residual, g))  # inverse_cdf needs no normalisation
        return out
    out.append(_draw(p[len(draft)], g))
    return out


def _draw(weights: torch.Tensor, g: torch.Generator) -> int:
    """A draw proportional to ``weights`` [vocab], as the sampler draws (one uniform)."""
    u = torch.rand(1, generator=g, dtype=torch.float64)
    return int(inverse_cdf(weights[None], u)[0])


def _logprobs(raw: torch.Tensor | None, batch: SamplingBatch, drafts: list[list[int]],
              tokens: list[list[int]]) -> list[list[RowLogprobs | None]]:  # fmt: skip
    """Each emitted token's log-probability from its own row (the rows past it are dropped)."""
    if raw is None:
        return [[None] * len(t) for t in tokens]
    rows, ids, ks = [], [], []
    row = 0
    for draft, out in zip(drafts, tokens):
        rows.extend(range(row, row + len(out)))
        ids.extend(out)
        ks.extend(batch.num_logprobs[row : row + len(out)])
        row += len(draft) + 1
    entries = gather_logprobs(raw[torch.tensor(rows)], torch.tensor(ids, device=raw.device), ks)
    result, at = [], 0
    for out in tokens:
        result.append(entries[at : at + len(out)])
        at += len(out)
    return result
