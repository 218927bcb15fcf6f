"""Verify draft tokens against the target model's distributions, keeping its output exact.

A request with k draft tokens d_0..d_{k-1} has k + 1 rows of target logits: row j is the
distribution of the token after d_0..d_{j-1}. Greedy rows accept d_j while it is the target's
argmax and then emit the target's own token, so the output is token for token what decoding
one token at a time gives (the logits of a row do not depend on the batch: docs/determinism.md).

Sampling rows use the rejection rule of Leviathan et al. / Chen et al. (2023) with a draft
distribution q. Our proposers are deterministic (q is a point mass on d_j), and for a point mass
the rule is: accept d_j with probability p_j(d_j); on rejection draw from p_j with d_j removed,
renormalised; after k acceptances draw a bonus token from p_k. We realise it by drawing: row j
draws its token x_j from p_j with its own uniform, exactly as plain sampling would, and d_j is
accepted when x_j = d_j. Then P(accept) = p_j(d_j), and a rejected row's token is distributed as
p_j without d_j: the same rule, so the output follows the target distribution exactly
(temperature, top-k, top-p and min-p applied first, as the sampler does).

The drawing form also means a request's j-th output token always comes from its j-th uniform.
A seeded request takes one uniform from its generator per emitted token (the uniforms of rows
past a rejection are given back), as in plain decoding, so its samples are the very tokens of
plain decoding, whatever was drafted: speculation, preemption and the batch change speed, never
a seeded request's output.
"""

from __future__ import annotations

import itertools

import torch

from pagedllm.kernels import ops
from pagedllm.outputs import RowLogprobs
from pagedllm.sampler.sampler import Sampler, SamplingBatch, filter_params, gather_logprobs, inverse_cdf


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]]
) -> tuple[list[list[int]], list[list[RowLogprobs | None]]]:
    """Per request: the tokens to append (accepted drafts + one target token) and their logprobs.

    ``logits`` has ``len(d) + 1`` consecutive rows per request ``d`` in ``drafts`` (a request
    without drafts has one row, sampled as usual); ``batch`` has one entry per row.
    """
    raw, masked = sampler.prepare(logits, batch)
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
    assert starts[-1] == logits.shape[0]
    temps = batch.temperatures.tolist()
    sampled = [i for i in range(len(drafts)) if temps[starts[i]] != 0]
    tokens = dict(zip(sampled, verify_sampled(sampler, masked, batch, [drafts[i] for i in sampled],
                                              [starts[i] for i in sampled])))  # fmt: skip
    if len(sampled) < len(drafts):
        greedy_tokens = ops.argmax(masked).tolist()
        for i, draft in enumerate(drafts):
            if i not in tokens:
                tokens[i] = _accept_greedy(draft, greedy_tokens[starts[i] : starts[i + 1]])
    ordered = [tokens[i] for i in range(len(drafts))]
    return ordered, _logprobs(raw, batch, drafts, ordered)


def _accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return target[: a + 1]


def verify_sampled(
    sampler: Sampler, masked: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]], starts: list[int]
) -> list[list[int]]:
    """The tokens of sampled requests (request i: draft ``drafts[i]``, rows from ``starts[i]``).

    Row j of a request draws with the request's j-th uniform; a seeded request's generator is
    then wound back to have given exactly one uniform per emitted token. Natively where the row
    kernels run (``ops.verify_rows``: only the rows up to the first rejection are filtered),
    else by the torch rule (``accept_sampled``); both give the same tokens."""
    if not drafts:
        return []
    u = torch.zeros(masked.shape[0], dtype=torch.float64)
    rewind: list[tuple[int, torch.Generator, torch.Tensor]] = []  # (request, its generator, state before)
    for i, (draft, start) in enumerate(zip(drafts, starts)):
        g = batch.generators[start]
        if g is not None and draft:
            rewind.append((i, g, g.get_state()))
        g = g or sampler.generator
        u[start : start + len(draft) + 1] = torch.rand(len(draft) + 1, generator=g, dtype=torch.float64,
                                                       device=g.device).cpu()  # fmt: skip
    if not ops.native_rows(masked):
        probs, u = sampler.probs(masked, batch), u.to(masked.device)
        result = [accept_sampled(d, probs[s : s + len(d) + 1], u[s : s + len(d) + 1]) for d, s in zip(drafts, starts)]
    else:
        draft_rows = torch.full((masked.shape[0],), -1, dtype=torch.int64)
        for draft, start in zip(drafts, starts):
            draft_rows[start : start + len(draft)] = torch.tensor(draft, dtype=torch.int64)
        out = ops.verify_rows(
            masked, torch.tensor(starts), torch.tensor([len(d) + 1 for d in drafts]), draft_rows,
            *filter_params(batch, masked.shape[0]), u,
        ).tolist()  # fmt: skip
        result = []
        for draft, start in zip(drafts, starts):
            emitted = out[start : start + len(draft) + 1]
            result.append(emitted[: emitted.index(-1)] if -1 in emitted else emitted)
    for i, g, state in rewind:
        if len(result[i]) <= len(drafts[i]):  # rows past the rejection: their uniforms go back
            g.set_state(state)
            torch.rand(len(result[i]), generator=g, dtype=torch.float64, device=g.device)
    return result


def accept_sampled(draft: list[int], p: torch.Tensor, u: torch.Tensor) -> list[int]:
    """The torch rule. ``p``: [len(draft) + 1, vocab] target probabilities; ``u``: the request's
    len(draft) + 1 uniforms (float64). Row j draws with u[j]; the draft stands while it is the draw."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        out.append(int(inverse_cdf(p[j][None], u[j : j + 1])[0]))
        if j == len(draft) or out[-1] != draft[j]:
            break
    return out


def _logprobs(raw: torch.Tensor | None, batch: SamplingBatch, drafts: list[list[int]],
              tokens: list[list[int]]) -> list[list[RowLogprobs | None]]:  # fmt: skip
    """Each emitted token's log-probability from its own row of the raw logits (the rows past
    it are dropped)."""
    if raw is None:
        return [[None] * len(t) for t in tokens]
    rows, ids, ks = [], [], []
    row = 0
    for draft, out in zip(drafts, tokens):
        rows.extend(range(row, row + len(out)))
        ids.extend(out)
        ks.extend(batch.num_logprobs[row : row + len(out)])
        row += len(draft) + 1
    entries = gather_logprobs(raw, torch.tensor(ids, device=raw.device), ks, rows)
    result, at = [], 0
    for out in tokens:
        result.append(entries[at : at + len(out)])
        at += len(out)
    return result
