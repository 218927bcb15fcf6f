"""Speculative decoding's parts alone: n-gram drafting, and verification keeping the target's
distribution exactly (chi-square, as the sampler's own tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedllm.config import SpeculativeConfig
from pagedllm.kernels import ops
from pagedllm.sampler.sampler import Sampler, SamplingBatch
from pagedllm.spec_decode.draft_length import MIN_GAIN, VERIFY_COST_PER_TOKEN, DraftCost, best_length, expected_tokens
from pagedllm.spec_decode.ngram import MAX_CANDIDATES, propose_ngram, propose_ngram_places, propose_ngram_reference
from pagedllm.spec_decode.proposer import Proposer


def ngram(ids, k=3, n_min=1, n_max=3):
    return propose_ngram(np.array(ids, dtype=np.int64), k, n_min, n_max)


def test_ngram_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    assert ngram([5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5]  # suffix [5, 6, 7] seen at 0
    assert ngram([1, 2, 3, 1, 2, 4, 9, 1, 2], k=2) == [4, 9]  # latest [1, 2] wins over the first
    assert ngram([1, 2, 3, 9, 2, 3, 7, 5, 2, 3]) == [7, 5, 2]  # [2, 3] at 4 (latest), not at 1
    assert ngram([4, 1, 4, 2, 3, 1, 4], n_max=2) == [2, 3, 1]  # n=2: [1, 4] at 1
    assert ngram([1, 2, 3, 4]) == []  # nothing repeats
    assert ngram([7, 7]) == [7]  # what follows runs to the end of the sequence
    assert ngram([3, 1, 2, 3], n_min=2) == []  # only a 1-token match, below n_min
    assert ngram([9]) == []


def test_ngram_walk_gives_the_reference_rule_s_drafts():
    """The plain-Python walk against the literal vectorised rule: random sequences over small
    vocabularies (many repeats), every n range, and long ones that make it hand over."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        ids = rng.integers(0, int(rng.choice([2, 3, 5, 40])), size=int(rng.integers(1, 60)))
        k, n_min = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 4))
        want = propose_ngram_reference(ids, k, n_min, n_max)
        assert propose_ngram(ids.tolist(), k, n_min, n_max) == want, (ids.tolist(), k, n_min, n_max)
        assert propose_ngram_places(ids, k, n_min, n_max) == want, (ids.tolist(), k, n_min, n_max)
    # The last token at more than MAX_CANDIDATES earlier places, none followed as at the end.
    ids = [t for i in range(2 * MAX_CANDIDATES) for t in (7, 1000 + i)] + [5, 6, 7]
    assert propose_ngram(ids, 3, 1, 4) == propose_ngram_reference(np.array(ids), 3, 1, 4) == [1000 + 2 * MAX_CANDIDATES - 1, 5, 6]
    # A long text where the last token is everywhere and n_max is large: the hand-over measured
    # the whole sequence n_max times per n (seconds a step); now only the token's places.
    ids = np.random.default_rng(1).integers(0, 3, size=3000)
    assert propose_ngram(ids.tolist(), 5, 2, 64) == propose_ngram_reference(ids, 5, 2, 64)


class _State:
    def __init__(self, ids, **params):
        from pagedllm.sampling_params import SamplingParams

        self.req_id = str(id(self))
        self.token_ids = ids
        self.output_token_ids = []
        self.sampling_params = SamplingParams(**params)
        self.bad_words_token_ids = []
        self.spec_backoff = self.spec_skip = self.spec_drafted = 0
        self.spec_hits = self.spec_misses = 0.0


def test_proposer_skips_big_batches_and_params_it_cannot_verify_exactly():
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=4, auto_length=False))
    rep = [1, 2, 3, 1, 2]
    states = [_State(rep), _State(rep, presence_penalty=0.5), _State(rep, min_tokens=3), _State(rep)]
    assert proposer.propose(states[:3], [True, True, True], [None] * 3) == [[3, 1], [], []]
    assert proposer.propose(states[:1], [False], [None]) == [[]]  # mid-prompt: no token was drawn
    assert proposer.propose(states, [True] * 4, [None] * 4) == [[]] * 4  # 4 >= disable_by_batch_size


def test_a_wholly_rejected_draft_backs_off_exponentially_and_an_accepted_one_resets():
    """With a fixed draft length (auto_length off), only wholly rejected drafts pause drafting."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=2, auto_length=False))
    s = _State([1, 2, 3, 1, 2])

    def wait_after(accepted: int) -> int:
        """Steps without a draft after a verified draft that accepted ``accepted`` tokens."""
        waited = 0
        drafted = proposer.propose([s], [True], [accepted])[0]
        while not drafted:
            waited += 1
            drafted = proposer.propose([s], [True], [None])[0]
        return waited

    assert proposer.propose([s], [True], [None])[0] == [3, 1]
    assert [wait_after(0) for _ in range(7)] == [0, 1, 2, 4, 8, 16, 16]
    assert wait_after(1) == 0 and wait_after(0) == 0 and wait_after(0) == 1  # reset, then again from the start


def test_best_length_trades_expected_tokens_against_cost():
    free = DraftCost()
    assert best_length(0.95, 7, free) == 7  # cheap and accepted: draft all
    assert best_length(0.0, 7, free) == 0  # never accepted: verifying costs only
    assert best_length(0.5, 7, free) == 1  # 1.5 tokens for 1.21 steps beats 1.75 for 1.42
    assert best_length(0.6, 7, free) == 2  # 1.96 tokens for 1.42 steps beats 1.6 for 1.21
    assert best_length(0.3, 3, DraftCost(per_token=0.3)) == 0  # 1.3 tokens for 1.47 steps: not worth it
    assert best_length(0.4, 3, DraftCost(per_token=0.05)) == 1  # 1.4 tokens for 1.26 steps
    assert best_length(0.3, 3, DraftCost(per_token=0.05)) == 0  # 1.3 for 1.26: within the margin, plain
    assert best_length(0.95, 3, DraftCost(fixed=0.3)) == 3  # a fixed cost wants long drafts
    # The chosen length's rate is the best of all lengths (0 = plain decoding, rate 1), unless
    # no length beats plain decoding by MIN_GAIN.
    for a in np.linspace(0, 1, 21):
        for cost in (free, DraftCost(0.2, 0.1), DraftCost(0.0, 0.5)):
            rates = [expected_tokens(a, k) / (1 + (k > 0) * cost.fixed + k * (VERIFY_COST_PER_TOKEN + cost.per_token))
                     for k in range(8)]  # fmt: skip
            k = best_length(a, 7, cost)
            assert rates[k] == pytest.approx(max(rates)) if max(rates) > MIN_GAIN else k == 0


def test_auto_length_follows_the_acceptance_rate_and_probes_when_drafting_stops():
    """A request whose drafts keep failing stops drafting but for rare one-token probes (so it
    costs at most a few percent); once drafts are accepted again it drafts long ones again."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3), cost=DraftCost(per_token=0.2))
    s = _State([1, 2, 3, 1, 2, 3, 1, 2])
    lengths = []
    accepted = None
    for step in range(60):  # every draft rejected
        d = proposer.propose([s], [True], [accepted])[0]
        lengths.append(len(d))
        accepted = 0 if d else None
    assert lengths[0] >= 1 and max(lengths[10:]) == 1  # only probes once the rate has dropped
    assert sum(lengths[30:]) <= 1  # then a probe every 33 steps
    lengths = []
    for step in range(200):  # now every draft accepted in full
        d = proposer.propose([s], [True], [accepted])[0]
        lengths.append(len(d))
        accepted = len(d) if d else None
    assert lengths[-10:] == [3] * 10, lengths


def test_probes_are_rarer_the_more_a_probe_costs():
    """A request that never gets a draft accepted keeps probing, but a probe that costs most of
    a step (a model drafter's layer and LM-head pass) comes far less often than a prompt-lookup
    probe (only a verified row), so both spend about the same small share of the work on them."""

    def probe_steps(cost: DraftCost) -> list[int]:
        proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3), cost=cost)
        s = _State([1, 2, 3, 1, 2, 3, 1, 2])
        s.spec_misses = 50.0  # a rate far too low to draft
        steps, accepted = [], None
        for step in range(400):
            d = proposer.propose([s], [True], [accepted])[0]
            if d:
                steps.append(step)
            accepted = 0 if d else None
        return steps

    cheap, costly = probe_steps(DraftCost()), probe_steps(DraftCost(fixed=0.06, per_token=0.49))
    # A prompt-lookup probe costs a verified row (0.28 of a step), the drafter's 0.83.
    assert cheap[:4] == [0, 7, 20, 45] and len(cheap) == 14  # waits 6, 12, 24, then every 32
    assert costly[:4] == [0, 18, 53, 122] and len(costly) == 7  # waits 17, 34, 68, then every 83
    for steps, cost in ((cheap, VERIFY_COST_PER_TOKEN), (costly, 0.55 + VERIFY_COST_PER_TOKEN)):
        assert len(steps) * cost / 400 < 0.03


def test_a_prompt_lookup_probe_waits_for_a_step_with_a_match():
    """A request backing off probes at the first step after its wait where the text offers a
    draft: steps with nothing to propose neither spend the probe nor lengthen the wait."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2))
    s = _State([1, 2, 3, 1, 2])  # [1, 2] occurred before: a draft is on offer
    s.spec_misses = 50.0  # a rate far too low to draft: only probes
    assert proposer.propose([s], [True], [None])[0] == [3]  # the first probe, then a wait of 6
    s.token_ids = [1, 2, 3, 1, 2, 8, 9]  # from here no 2-token suffix repeats
    accepted = 0  # the probe was rejected
    for _ in range(12):  # the wait runs out, and later steps find nothing to probe with
        assert proposer.propose([s], [True], [accepted])[0] == []
        accepted = None
    assert s.spec_skip == 0 and s.spec_backoff == 6  # the next wait is not doubled by empty steps
    s.token_ids = [1, 2, 3, 1, 2, 8, 9, 1, 2]  # a match again: the postponed probe comes now
    assert proposer.propose([s], [True], [None])[0] == [8]
    assert s.spec_backoff == 12


def test_model_based_drafts_get_the_chosen_length():
    class Drafter:
        def propose(self, req_ids, token_ids, limits, hidden=None):
            self.limits = limits
            return [[7] * n for n in limits]

    drafter = Drafter()
    proposer = Proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=5), drafter, DraftCost(per_token=0.1))
    good, bad = _State([1, 2, 3]), _State([4, 5, 6])
    good.spec_hits, bad.spec_misses = 20.0, 20.0
    proposer.propose([good, bad], [True, True], [None, None])
    assert drafter.limits[0] >= 4 and drafter.limits[1] == 1  # bad: a one-token probe


VOCAB = 8
TRIALS = 6000
# Two positions with different target distributions, a draft token per position.
LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], [0.0, 1.0, -1.0, 2.5, 0.3, 0.2, -2.0, 1.2]])


def _target(row: int, temperature: float, top_k: int) -> np.ndarray:
    x = LOGITS[row].double().numpy() / temperature
    if top_k:
        x[np.argsort(-x)[top_k:]] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


def _assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    support = probs > 0
    assert counts[~support].sum() == 0, f"outside the support: {counts}"
    p = chisquare(counts[support], probs[support] * counts.sum()).pvalue
    assert p > 0.001, f"counts {counts} vs expected {(probs * counts.sum()).round(1)} (p={p:.2e})"


@pytest.mark.parametrize("temperature,top_k,draft", [(1.0, 0, [1, 3]), (0.7, 4, [0, 4]), (1.0, 3, [5, 3])])
def test_verification_keeps_the_target_distribution(temperature, top_k, draft, native_or_torch):
    """First token ~ p_0; after an accepted first draft, the second ~ p_1. The draft [5, ...]
    with top-k 3 is never in p_0's support: always rejected, and still p_0 comes out."""
    from pagedllm.spec_decode.rejection import verify_drafts

    rows = 3 * TRIALS  # each trial: 2 drafts + the bonus row
    logits = torch.cat([LOGITS, LOGITS[1:]]).repeat(TRIALS, 1)
    batch = SamplingBatch(temperatures=torch.full((rows,), temperature), generators=[None] * rows,
                          num_logprobs=[None] * rows)  # fmt: skip
    if top_k:
        batch.top_k = torch.full((rows,), top_k)
    # (Sampler(0)'s stream gives p = 8e-4 on one check of these six: a 1-in-1000 draw; 200,000
    # trials per setting showed no bias, every |z| < 2.1.)
    tokens, _ = verify_drafts(Sampler(1), logits, batch, [draft] * TRIALS)
    first = np.bincount([t[0] for t in tokens], minlength=VOCAB)
    _assert_follows(first, _target(0, temperature, top_k))
    after_accept = [t[1] for t in tokens if t[0] == draft[0]]
    if _target(0, temperature, top_k)[draft[0]] > 0:
        assert len(after_accept) > 500
        _assert_follows(np.bincount(after_accept, minlength=VOCAB), _target(1, temperature, top_k))
    else:
        assert not after_accept
    assert all(1 <= len(t) <= 3 and t[: len(t) - 1] == draft[: len(t) - 1] for t in tokens)


def test_a_seeded_request_draws_the_plain_samplers_tokens_one_uniform_per_token(native_or_torch):
    """Row j draws with the request's j-th uniform, as plain sampling would, and the generator
    gives back the uniforms of rows past a rejection: a seeded request's tokens and its random
    stream are those of decoding one token at a time, whatever was drafted."""
    from pagedllm.spec_decode.rejection import verify_drafts

    gen = torch.Generator().manual_seed(0)
    emitted_lengths = set()
    for trial in range(40):
        k = trial % 5
        logits = torch.randn(k + 1, 300, generator=gen) * 3
        drafts = [int(t) for t in logits[:k].argmax(dim=-1)]  # likely, so some are accepted
        if trial % 3 == 0 and k:
            drafts[k // 2] = 299  # and some rejected
        params = dict(temperatures=torch.full((k + 1,), 0.8), top_k=torch.full((k + 1,), 50), num_logprobs=[None] * (k + 1))
        g = torch.Generator().manual_seed(100 + trial)
        tokens, _ = verify_drafts(Sampler(0), logits, SamplingBatch(generators=[g] * (k + 1), **params), [drafts])
        emitted_lengths.add((len(tokens[0]), k))
        plain_g, plain = torch.Generator().manual_seed(100 + trial), []
        for j in range(len(tokens[0])):  # one token at a time, each row alone
            one = dict(temperatures=params["temperatures"][:1], top_k=params["top_k"][:1], num_logprobs=[None])
            plain.append(Sampler(0)(logits[j : j + 1], SamplingBatch(generators=[plain_g], **one)).token_ids[0])
        assert tokens[0] == plain, f"trial {trial}"
        assert torch.equal(g.get_state(), plain_g.get_state())  # one uniform per emitted token
    assert any(n == k + 1 for n, k in emitted_lengths if k) and any(n <= k for n, k in emitted_lengths)


def test_greedy_verification_accepts_while_the_draft_is_the_argmax():
    from pagedllm.spec_decode.rejection import verify_drafts

    logits = torch.cat([LOGITS, LOGITS[1:], LOGITS[:1], LOGITS[:1]])  # argmax 0, 3, 3, 0, 0
    batch = SamplingBatch(temperatures=torch.zeros(5), generators=[None] * 5, num_logprobs=[None, None, None, 1, 1])
    tokens, logprobs = verify_drafts(Sampler(0), logits, batch, [[0, 3], [7]])
    assert tokens == [[0, 3, 3], [0]]  # both accepted + bonus; the wrong draft replaced by the argmax
    assert logprobs[0] == [None, None, None] and logprobs[1][0].token_rank == 1


def check_native_verification_follows_the_torch_rule(vocab: int = 49152) -> None:
    """The native verification (``ops.verify_rows``, whichever library ``ops.load_kernels``
    gives) emits, for the same uniforms, the very tokens of the torch rule: drafts of 0-4 tokens
    that are each row's likeliest token (mostly accepted), random (mostly rejected) or masked
    (always rejected); temperature, min-p, top-k and top-p per request; greedy requests beside."""
    from pagedllm.spec_decode.rejection import verify_drafts

    gen = torch.Generator().manual_seed(2)
    accepted = rejected = 0
    for trial in range(6):
        lengths = torch.randint(0, 5, (10,), generator=gen).tolist()
        rows = sum(lengths) + len(lengths)
        logits = torch.randn(rows, vocab, generator=gen) * (1.0 + 2.0 * (trial % 3))
        banned = torch.randint(0, vocab, (vocab // 20,), generator=gen)
        logits[:, banned] = float("-inf")
        per_request = lambda t: torch.repeat_interleave(t, torch.tensor(lengths) + 1)  # noqa: E731
        pick = torch.rand(4, len(lengths), generator=gen)
        batch = SamplingBatch(
            temperatures=per_request(torch.where(pick[3] < 0.2, 0.0, 0.3 + torch.rand(len(lengths), generator=gen))),
            generators=[None] * rows,
            min_p=per_request(torch.where(pick[0] < 0.3, 0.2 * torch.rand(len(lengths), generator=gen), 0.0)),
            top_k=per_request(torch.where(pick[1] < 0.4, torch.randint(1, 200, (len(lengths),), generator=gen), 0)),
            top_p=per_request(torch.where(pick[2] < 0.5, 0.5 + 0.49 * torch.rand(len(lengths), generator=gen), 1.0)),
            num_logprobs=[None] * rows,
        )
        drafts, row = [], 0
        for n in lengths:
            kind = torch.randint(0, 3, (n,), generator=gen).tolist()
            best = logits[row : row + n].argmax(dim=-1).tolist()
            for j in (j for j, k in enumerate(kind) if k == 0):  # its draft made likely (not certain)
                logits[row + j, best[j]] += 10 + 6 * float(torch.rand((), generator=gen))
            drafts.append([best[j] if k == 0 else int(banned[j]) if k == 1 else j * 7 for j, k in enumerate(kind)])
            row += n + 1
        native, _ = verify_drafts(Sampler(trial), logits, batch, drafts)
        with ops.torch_only():
            reference, _ = verify_drafts(Sampler(trial), logits, batch, drafts)
        assert native == reference, f"trial {trial}"
        accepted += sum(len(t) - 1 for t in native)
        rejected += sum(len(t) <= len(d) for t, d in zip(native, drafts))
    assert accepted >= 10 and rejected >= 10  # both branches ran, many times


def test_native_verification_follows_the_torch_rule():
    if not ops.native_available():
        pytest.skip("no native kernels here (no C++ compiler)")
    check_native_verification_follows_the_torch_rule()


def test_the_verify_price_follows_the_targets_kernels():
    """Extra verified rows cost ~0.1 of a step where most weight bytes meet int8 activations
    (integer dot products), ~0.28 in the exact mode and in the wide (int16) mode: the policy
    drafts longer where verifying is cheap."""
    from types import SimpleNamespace

    from torch import nn

    from pagedllm.spec_decode.draft_length import VERIFY_COST_INT8, DraftLengthPolicy, verify_cost

    class Lin(nn.Module):
        def __init__(self, nbytes: int, bits: int | None):
            super().__init__()
            self.int8 = SimpleNamespace(bits=bits) if bits else None
            self.nbytes = nbytes

        def step_nbytes(self) -> int:
            return self.nbytes

    assert verify_cost(nn.Sequential(Lin(900, 8), Lin(100, None))) == VERIFY_COST_INT8
    assert verify_cost(nn.Sequential(Lin(900, 16), Lin(100, None))) == VERIFY_COST_PER_TOKEN
    assert verify_cost(nn.Sequential(Lin(400, 8), Lin(600, None))) == VERIFY_COST_PER_TOKEN
    assert verify_cost(nn.Sequential(Lin(500, 8), Lin(500, None))) == VERIFY_COST_PER_TOKEN  # half is not most
    assert VERIFY_COST_INT8 < VERIFY_COST_PER_TOKEN
    # At an acceptance rate where exact verification pays for 3 tokens, cheap verification pays for more.
    s = _State([1, 2, 3])
    s.spec_hits, s.spec_misses = 8.0, 2.0
    exact = DraftLengthPolicy(7, DraftCost()).choose(s)
    cheap = DraftLengthPolicy(7, DraftCost(), verify=VERIFY_COST_INT8).choose(s)
    assert 0 < exact < cheap
