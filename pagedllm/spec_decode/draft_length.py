"""How many tokens to draft for a request: as many as pay for themselves, often none.

A drafted token is worth a whole decode step when it is accepted, and the j-th draft counts only
if the j-1 before it were accepted. With a per-token acceptance rate ``a``, drafting k tokens
yields 1 + a + a^2 + ... + a^k tokens per step. It costs the verifying step's extra rows
(``VERIFY_COST_PER_TOKEN`` of a 1-token step each) plus the proposer's own work (its
``DraftCost``), all in units of one plain decode step. The policy drafts the k (0..k_max) with the
most tokens per unit of cost; when no k beats plain decoding, it drafts nothing.

``a`` is estimated per request from its own verified drafts: each draft adds its accepted tokens
as successes and, if it stopped early, one failure (the maximum-likelihood estimate of a
geometric run), both decayed so the estimate follows the text (a passage to copy, then free
prose). A request that drafts nothing probes with one token now and then, so it notices when
drafting starts paying again: now, then after w, 2w, 4w ... steps up to a longest wait. A probe
costs what a one-token draft costs (its proposer's work plus a verified row), so the waits grow
with it: prompt lookup (a probe is one verified row, 0.28 of a step) probes after 6, 12, 24
and every 32 steps; a drafter whose probe costs 0.83 of a step after 17, 34, 68 and every 83
steps, which keeps probing near 1% of the work (the first probes of a short reply cost a little
more). Prompt lookup asks the policy only at steps where the text offers a draft (a match), so
a probe is never spent on a step with nothing to propose, and the waits count steps as usual.

Everything here depends only on the request's own tokens, never on timing or the batch, so the
same request drafts the same way on every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from torch import nn

# Extra cost of one more token in a decode step, in 1-token steps: measured on the default model
# (fp32, exact), AMD EPYC Zen 4, whole engine steps of one request (medians over the `edit`
# prompts' steps, n-gram drafts up to 7, same process): 2 / 3 / 4 / 8 tokens cost 1.31 / 1.56 /
# 1.79 / 3.08x a plain step (4.38 ms), ~0.28 per drafted token. (It was ~0.21 until the one-row
# GEMM's prefetch made the plain step ~20% faster: the extra rows were compute-bound already.)
# Each extra row adds one FMA per weight, which the exact fp32 kernel cannot share between rows.
VERIFY_COST_PER_TOKEN = 0.28
# The same in the fast modes (activation_dtype int8), whose integer dot products do 4x the work
# per instruction, so extra rows stay cheap while the weight stream dominates: 2 / 3 / 4 / 5 / 6
# / 8 tokens cost 1.12 / 1.12 / 1.16 / 1.28 / 1.40 / 1.75x a plain step (4.22 ms), measured as
# above; 0.10 per drafted token fits k up to 7 (it overprices k <= 4 a little). The wide mode
# (int16 activations: twice the dot products, smaller row tiles) measured like the exact one:
# 1.10 / 1.41 / 1.72 / 2.83x for 2 / 3 / 4 / 8 tokens, ~0.26 per token.
VERIFY_COST_INT8 = 0.10
DECAY = 0.8  # weight of the older history at each verified draft
MIN_GAIN = 1.05  # a draft must promise this many times plain decoding's tokens per unit of cost
FIRST_PROBE_WAIT = 4  # steps between the first probes of a request that drafts nothing ...
MAX_PROBE_WAIT = 32  # ... doubling up to this (at least: expensive probes wait longer, below)
PROBE_SHARE = 0.01  # the share of the steps' work the longest waits leave to probes
FIRST_PROBE_SHARE = 0.05  # ... and the first ones


@dataclass(frozen=True)
class DraftCost:
    """A proposer's work for one request's draft, in plain decode steps of the target."""

    fixed: float = 0.0  # per drafting step (e.g. Medusa's one LM-head pass over its k rows)
    per_token: float = 0.0  # per drafted token (e.g. one EAGLE layer + an LM-head row pass)


class _State(Protocol):
    spec_hits: float
    spec_misses: float
    spec_backoff: int
    spec_skip: int


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step yields when it verifies k drafts, each accepted with rate a after the last."""
    return sum(a**j for j in range(k + 1))


def best_length(a: float, k_max: int, cost: DraftCost, verify: float = VERIFY_COST_PER_TOKEN) -> int:
    """The draft length with the most tokens per unit of step cost; 0 = plain decoding, unless
    some length beats it by ``MIN_GAIN`` (the costs are measured to a few percent, so a draft
    that promises less is as likely to lose)."""
    best, best_rate = 0, MIN_GAIN
    for k in range(1, k_max + 1):
        rate = expected_tokens(a, k) / (1.0 + cost.fixed + k * (verify + cost.per_token))
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class DraftLengthPolicy:
    """Per-request draft lengths from acceptance history and the proposer's cost."""

    def __init__(self, k_max: int, cost: DraftCost, prior: float = 0.5, adaptive: bool = True,
                 verify: float = VERIFY_COST_PER_TOKEN):
        """``prior``: the acceptance rate assumed before a request's first verified draft (as
        one success and one failure's worth of evidence); ``adaptive=False`` always drafts k_max,
        backing off only after wholly rejected drafts. ``verify``: the target's price of one
        more verified token, in plain steps (``verify_cost``)."""
        self.k_max, self.cost, self.prior, self.adaptive, self.verify = k_max, cost, prior, adaptive, verify
        probe = cost.fixed + cost.per_token + verify  # a one-token draft's work, in steps
        self.first_wait = max(FIRST_PROBE_WAIT, math.ceil(probe / FIRST_PROBE_SHARE))
        self.max_wait = max(MAX_PROBE_WAIT, math.ceil(probe / PROBE_SHARE))

    def acceptance(self, s: _State) -> float:
        hits, misses = s.spec_hits + 2 * self.prior, s.spec_misses + 2 * (1 - self.prior)
        return hits / (hits + misses)

    def record(self, s: _State, drafted: int, accepted: int) -> None:
        """A verified draft of ``drafted`` tokens of which the first ``accepted`` were right."""
        s.spec_hits = DECAY * s.spec_hits + accepted
        s.spec_misses = DECAY * s.spec_misses + (1 if accepted < drafted else 0)
        if self.adaptive:
            return
        if accepted == 0:  # fixed length: wait 1, 2, 4, ... 16 steps after each wholly rejected draft
            s.spec_skip, s.spec_backoff = s.spec_backoff, min(16, 2 * s.spec_backoff or 1)
        else:
            s.spec_skip = s.spec_backoff = 0

    def length(self, s: _State) -> int:
        """How many tokens to draft for s now (it just sampled and may draft)."""
        return 0 if self.waiting(s) else self.choose(s)

    def waiting(self, s: _State) -> bool:
        """Whether s sits this step out (a back-off after drafts that did not pay); counts the step."""
        if s.spec_skip > 0:
            s.spec_skip -= 1
            return True
        return False

    def choose(self, s: _State) -> int:
        """The draft length for s, which is not waiting: 0 .. k_max, or a 1-token probe."""
        if not self.adaptive:
            return self.k_max
        k = best_length(self.acceptance(s), self.k_max, self.cost, self.verify)
        if k > 0:
            s.spec_backoff = 0
            return k
        # Not worth it now: probe with one token, then wait first_wait, twice that, ... up to
        # max_wait steps before the next.
        s.spec_backoff = min(self.max_wait, 2 * s.spec_backoff) if s.spec_backoff else self.first_wait
        s.spec_skip = s.spec_backoff
        return 1


def verify_cost(target: nn.Module) -> float:
    """The price of one more verified token on ``target``: the int8 mode's when most of the
    bytes a step reads are int8 panels met by int8 activations (its linears' ``int8`` form with
    8-bit activations), else the exact mode's."""
    int8 = sum(m.step_nbytes() for m in target.modules() if getattr(getattr(m, "int8", None), "bits", 0) == 8)
    return VERIFY_COST_INT8 if 2 * int8 > step_nbytes(target) else VERIFY_COST_PER_TOKEN


def step_nbytes(module: nn.Module) -> int:
    """Bytes of weights one single-token step of ``module`` reads: each of our linears' own
    count (``Linear.step_nbytes``: its smallest-step form), torch linears' weights; other
    parameters (norms) are noise."""
    total = 0
    for m in module.modules():
        if hasattr(m, "step_nbytes"):
            total += m.step_nbytes()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
