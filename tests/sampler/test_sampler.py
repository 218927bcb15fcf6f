"""The batched sampler on controlled logits: distributions (chi-square), penalties, masks, seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedllm.kernels import ops
from pagedllm.sampler.sampler import Sampler, SamplingBatch, inverse_cdf, native_draw

VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
ROWS = 20000


def sample_many(batch_kwargs: dict, rows: int = ROWS, seed: int = 0) -> np.ndarray:
    logits = LOGITS.repeat(rows, 1)
    batch = SamplingBatch(
        temperatures=torch.full((rows,), batch_kwargs.pop("temperature", 1.0)),
        generators=[None] * rows,
        num_logprobs=[None] * rows,
        **{k: torch.full((rows,), v) for k, v in batch_kwargs.items()},
    )
    tokens = Sampler(seed)(logits, batch).token_ids
    return np.bincount(tokens, minlength=VOCAB)


def expected(probs: np.ndarray) -> np.ndarray:
    probs = np.asarray(probs, dtype=np.float64)
    return probs / probs.sum() * ROWS


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    exp = expected(probs)
    support = exp > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    p = chisquare(counts[support], exp[support] * counts.sum() / exp[support].sum()).pvalue
    assert p > 0.001, f"counts {counts} vs expected {exp.round(1)} (p={p:.2e})"


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature, native_or_torch):
    counts = sample_many({"temperature": temperature})
    assert_follows(counts, softmax(LOGITS.numpy() / temperature))


def test_top_k(native_or_torch):
    counts = sample_many({"top_k": 3})
    probs = softmax(LOGITS.numpy())
    probs[3:] = 0
    assert_follows(counts, probs)


def test_top_p(native_or_torch):
    probs = softmax(LOGITS.numpy())  # sorted descending already
    top_p = 0.8
    # Keep the smallest prefix whose mass reaches top_p.
    keep = np.cumsum(probs) - probs < top_p
    counts = sample_many({"top_p": top_p})
    assert_follows(counts, np.where(keep, probs, 0))
    assert keep.sum() < VOCAB  # the test means something


def test_top_p_without_a_full_sort_keeps_what_the_sorted_rule_keeps():
    """top_p_floor looks for the nucleus among the top 256, then 4,096 tokens, then sorts the
    row; every stage must keep exactly the smallest prefix (by probability) whose mass reaches
    top_p, as sorting every row does."""
    from pagedllm.sampler.sampler import top_p_floor

    torch.manual_seed(0)
    vocab = 6000
    logits = torch.cat([torch.randn(4, vocab) * s for s in (12.0, 4.0, 2.0, 0.3)])  # nuclei from a few tokens to most
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99] * 4)
    probs = logits.softmax(dim=-1)
    keep = probs >= top_p_floor(probs, top_p)[:, None]
    values, order = probs.sort(dim=-1, descending=True)
    want = torch.zeros_like(keep).scatter(1, order, (values.cumsum(dim=-1) - values) < top_p[:, None])
    assert torch.equal(keep, want)
    sizes = keep.sum(dim=-1)
    assert sizes.min() < 256 and ((sizes > 256) & (sizes < 4096)).any() and sizes.max() > 4096  # every stage ran


def test_min_p(native_or_torch):
    probs = softmax(LOGITS.numpy())
    min_p = 0.2
    keep = probs >= min_p * probs.max()
    counts = sample_many({"min_p": min_p})
    assert_follows(counts, np.where(keep, probs, 0))
    assert 1 < keep.sum() < VOCAB


def test_temperature_then_top_k_then_top_p(native_or_torch):
    t, k, p = 0.7, 5, 0.9
    probs = softmax(LOGITS.numpy() / t)
    probs[k:] = 0
    probs = probs / probs.sum()
    keep = np.cumsum(probs) - probs < p
    counts = sample_many({"temperature": t, "top_k": k, "top_p": p})
    assert_follows(counts, np.where(keep, probs, 0))


def run_single(logits: torch.Tensor, **kw) -> tuple[torch.Tensor, SamplingBatch]:
    rows = logits.shape[0]
    batch = SamplingBatch(temperatures=torch.zeros(rows), generators=[None] * rows, num_logprobs=[None] * rows, **kw)
    return logits, batch


def test_penalties_change_logits_exactly_as_their_formulas_say(native_or_torch):
    from pagedllm.sampler.sampler import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, 4.0]])
    batch = SamplingBatch(
        temperatures=torch.zeros(1),
        generators=[None],
        penalty_rows=[0],
        presence=[0.5],
        frequency=[0.25],
        repetition=[2.0],
        output_ids=[[0, 0, 1, 3]],  # token 0 twice, 1 and 3 once
        prompt_ids=[[5, 1]],
    )
    out = logits.clone()
    apply_penalties(out, batch)
    exp = logits.clone()
    # repetition (prompt + output tokens 0, 1, 3, 5): positive / 2, negative * 2
    exp[0, 0], exp[0, 1], exp[0, 3], exp[0, 5] = 2.0 / 2, -1.0 * 2, 3.0 / 2, 1.0 / 2
    # frequency (output counts) and presence (output only)
    exp[0, 0] -= 0.25 * 2 + 0.5
    exp[0, 1] -= 0.25 * 1 + 0.5
    exp[0, 3] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(out, exp)


def test_logit_bias_allowed_and_banned_tokens():
    logits = LOGITS.repeat(3, 1)
    batch = SamplingBatch(
        temperatures=torch.zeros(3),
        generators=[None] * 3,
        num_logprobs=[None] * 3,
        logit_bias=[(0, torch.tensor([6]), torch.tensor([100.0]))],
        allowed=[(1, [4, 5])],
        banned=[(2, [0, 1])],
    )
    assert Sampler(0)(logits, batch).token_ids == [6, 4, 2]


def test_bans_that_leave_no_allowed_token_give_way_to_allowed_token_ids(native_or_torch):
    """allowed_token_ids is the hard limit: when bad words or min_tokens' bans remove every
    allowed token, the row draws from the allowed ones (it used to emit token 0)."""
    logits = LOGITS.repeat(3, 1)
    batch = SamplingBatch(temperatures=torch.tensor([0.0, 1.0, 0.0]), generators=[None] * 3, num_logprobs=[None] * 3,
                          allowed=[(0, [4, 5]), (1, [4, 5]), (2, [3, 5])], banned=[(0, [4, 5]), (1, [5, 4]), (2, [3])])  # fmt: skip
    for seed in range(20):
        tokens = Sampler(seed)(logits, batch).token_ids
        assert tokens[0] == 4 and tokens[1] in (4, 5) and tokens[2] == 5  # row 2: the ban still holds


def test_seeded_rows_do_not_depend_on_the_batch():
    g1 = torch.Generator().manual_seed(7)
    g2 = torch.Generator().manual_seed(7)
    alone = Sampler(0)(LOGITS[None], SamplingBatch(torch.ones(1), [g1], num_logprobs=[None])).token_ids
    batch = SamplingBatch(torch.ones(3), [None, g2, None], num_logprobs=[None] * 3)
    mixed = Sampler(123)(LOGITS.repeat(3, 1), batch).token_ids
    assert mixed[1] == alone[0]
    # and the seeded stream keeps producing the same sequence
    seq_a = [Sampler(0)(LOGITS[None], SamplingBatch(torch.ones(1), [g], num_logprobs=[None])).token_ids[0]
             for g in [torch.Generator().manual_seed(3)] * 30]  # fmt: skip
    seq_b = [Sampler(9)(LOGITS[None], SamplingBatch(torch.ones(1), [g], num_logprobs=[None])).token_ids[0]
             for g in [torch.Generator().manual_seed(3)] * 30]  # fmt: skip
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    batch = SamplingBatch(torch.tensor([0.0, 0.0]), [None, None], num_logprobs=[3, None], banned=[(0, [0])])
    out = Sampler(0)(logits, batch)
    assert out.token_ids == [1, 7]  # row 0: token 0 banned, so the argmax is token 1
    lp = out.logprobs[0]
    raw = LOGITS.log_softmax(-1)
    assert math.isclose(lp.token_logprob, float(raw[1]), abs_tol=1e-6)
    assert lp.token_rank == 2  # rank in the raw distribution, before the ban
    assert lp.top_ids == [0, 1, 2]
    np.testing.assert_allclose(lp.top_logprobs, raw[:3].numpy(), atol=1e-6)
    assert out.logprobs[1] is None


def test_the_sampler_applies_penalties_yet_reports_logprobs_of_the_raw_logits(native_or_torch):
    """A repetition penalty moves the greedy token (token 0 was already said), and the logprobs
    still describe the model's own distribution: the penalty edits a copy, never the raw row."""
    batch = SamplingBatch(torch.zeros(1), [None], num_logprobs=[2], penalty_rows=[0], presence=[0.0],
                          frequency=[0.0], repetition=[4.0], output_ids=[[0]], prompt_ids=[[]])  # fmt: skip
    logits = LOGITS[None].clone()
    out = Sampler(0)(logits, batch)
    assert out.token_ids == [1]  # 2.0 / 4 = 0.5 < 1.5
    raw = LOGITS.log_softmax(-1)
    lp = out.logprobs[0]
    assert lp.top_ids == [0, 1] and lp.token_rank == 2
    np.testing.assert_allclose(lp.top_logprobs, raw[:2].numpy(), atol=1e-6)
    assert torch.equal(logits[0], LOGITS)


def test_each_row_gets_its_own_number_of_top_logprobs(native_or_torch):
    batch = SamplingBatch(torch.zeros(3), [None] * 3, num_logprobs=[1, 5, None])
    out = Sampler(0)(LOGITS.repeat(3, 1), batch)
    assert [len(lp.top_ids) for lp in out.logprobs[:2]] == [1, 5] and out.logprobs[2] is None
    assert out.logprobs[1].top_ids == [0, 1, 2, 3, 4]


def test_min_p_of_one_keeps_only_the_most_likely_token(native_or_torch):
    """min_p = 1 is allowed: the threshold is the top probability itself, which stays (a strict
    comparison; <= masked every token and the draw became NaN)."""
    counts = sample_many({"min_p": 1.0}, rows=200)
    assert counts[0] == 200 and counts.sum() == 200
    probs = Sampler.probs(LOGITS[None], SamplingBatch(torch.ones(1), [None], min_p=torch.ones(1)))
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor([0]), VOCAB).float())


def test_a_logit_bias_is_added_once():
    batch = SamplingBatch(torch.zeros(2), [None] * 2, num_logprobs=[None] * 2,
                          logit_bias=[(0, torch.tensor([3, 5]), torch.tensor([1.0, -0.25]))])  # fmt: skip
    _, masked = Sampler(0).prepare(LOGITS.repeat(2, 1), batch)
    expected = LOGITS.clone()
    expected[3] += 1.0
    expected[5] -= 0.25
    assert torch.equal(masked[0], expected) and torch.equal(masked[1], LOGITS)


def _mask(vocab: int, allowed: list[int]) -> list[int]:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32


def test_grammar_bitmask_limits_rows_and_wins_over_a_conflicting_ban():
    vocab = LOGITS.shape[0]
    logits = LOGITS.repeat(4, 1)
    batch = SamplingBatch(
        temperatures=torch.tensor([0.0, 0.0, 1.0, 0.0]),
        generators=[None, None, torch.Generator().manual_seed(1), None],
        num_logprobs=[None, 1, None, None],
        banned=[(3, [4])],  # e.g. EOS before min_tokens, and 4 is all the grammar allows
        bitmask_rows=[1, 2, 3],
        token_bitmask=torch.tensor([_mask(vocab, [0, 3]), _mask(vocab, [5]), _mask(vocab, [4])], dtype=torch.int32),
    )
    out = Sampler(0)(logits, batch)
    free = int(LOGITS.argmax())
    assert out.token_ids[0] == free  # the unconstrained row is untouched
    assert out.token_ids[1] == max([0, 3], key=lambda t: float(LOGITS[t]))
    assert out.token_ids[2] == 5  # sampled, but only 5 is allowed
    assert out.token_ids[3] == 4  # the grammar wins: a row must never be left without a token
    # Log-probabilities stay the model's raw distribution.
    assert out.logprobs[1].token_logprob == pytest.approx(float(LOGITS.log_softmax(-1)[out.token_ids[1]]), abs=1e-6)


def test_inverse_cdf_draws_by_cumulative_weight_and_never_a_zero_weight_token():
    w = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]] * 5)
    u = torch.tensor([0.0, 0.33, 1 / 3 + 1e-9, 0.999999, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(w, u).tolist() == [1, 1, 3, 3, 3]
    big = torch.rand(3, 49152) * (torch.rand(3, 49152) < 0.001)  # mostly zeros, unnormalised
    picks = inverse_cdf(big, torch.tensor([0.0, 0.5, 1 - 2**-53], dtype=torch.float64))
    assert bool((big[torch.arange(3), picks] > 0).all())


def check_native_draws_follow_the_torch_rule(vocab: int = 49152) -> None:
    """The native kernel (``ops.sample_rows``, whichever library ``ops.load_kernels`` gives)
    draws, for the same uniforms, the very tokens the torch rule does (``Sampler.probs`` then
    ``inverse_cdf``): temperature, min-p, top-k, top-p, masked (-inf) tokens, u at both ends."""
    gen = torch.Generator().manual_seed(0)
    rows = 24
    for trial in range(12):
        logits = torch.randn(rows, vocab, generator=gen) * (1.0 + 3.0 * (trial % 4))
        logits[:, torch.randint(0, vocab, (vocab // 20,), generator=gen)] = float("-inf")
        logits[0] = float("-inf")
        logits[0, 7] = 0.5  # one allowed token
        pick = torch.rand(4, rows, generator=gen)
        batch = SamplingBatch(
            temperatures=0.2 + 1.5 * torch.rand(rows, generator=gen),
            generators=[None] * rows,
            min_p=torch.where(pick[0] < 0.3, 0.3 * torch.rand(rows, generator=gen), torch.zeros(rows)),
            top_k=torch.where(pick[1] < 0.4, torch.randint(1, vocab // 10, (rows,), generator=gen), 0),
            top_p=torch.where(pick[2] < 0.6, 0.3 + 0.69 * torch.rand(rows, generator=gen), torch.ones(rows)),
        )
        probs = Sampler.probs(logits, batch)
        no_greedy = torch.zeros(rows, dtype=torch.bool)
        for _ in range(4):
            u = torch.rand(rows, generator=gen, dtype=torch.float64)
            u[0] = 0.0
            want = inverse_cdf(probs, u)
            got = native_draw(logits, batch, u, no_greedy)
            assert torch.equal(got, want), f"trial {trial}: rows {(got != want).nonzero()[:, 0].tolist()} differ"
        # At u's top end the two may part on tokens of ~1e-16 of the mass (float32 probabilities
        # against float32 weights); the token drawn must still be one the filters kept.
        got = native_draw(logits, batch, torch.full((rows,), 1 - 2**-53, dtype=torch.float64), no_greedy)
        assert bool((probs[torch.arange(rows), got] > 0).all())
    # A view whose rows are not contiguous takes the torch rule: the same tokens for the same seed.
    strided = logits.t().contiguous().t()
    assert Sampler(3)(strided, batch).token_ids == Sampler(3)(logits, batch).token_ids
    # Greedy rows in the batch are skipped (their argmax is taken elsewhere); the others match.
    is_greedy = torch.arange(rows) % 3 == 0
    got = native_draw(logits, batch, u, is_greedy)
    assert bool((got[is_greedy] == 0).all()) and torch.equal(got[~is_greedy], want[~is_greedy])


def test_native_draws_follow_the_torch_rule():
    if not ops.native_available():
        pytest.skip("no native kernels here (no C++ compiler)")
    check_native_draws_follow_the_torch_rule()


def check_native_penalties_match_the_torch_code(vocab: int = 49152) -> None:
    """The native penalties (``ops.apply_penalties``: only the history's tokens touched) give the
    bits of the torch code (over the whole vocabulary): repeated tokens, prompt tokens also in the
    output, negative and < 1 penalties, -inf logits, rows without penalties left alone."""
    from pagedllm.sampler.sampler import apply_penalties

    gen = torch.Generator().manual_seed(1)
    rows = 9
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[:, :50] = float("-inf")
    hist = lambda n, hi: torch.randint(0, hi, (n,), generator=gen).tolist()  # noqa: E731
    batch = SamplingBatch(
        temperatures=torch.ones(rows),
        generators=[None] * rows,
        penalty_rows=[0, 2, 3, 5, 8],
        presence=[0.5, -0.3, 0.0, 1.5, 0.2],
        frequency=[0.25, 0.0, -0.7, 0.3, 1.1],
        repetition=[1.3, 0.8, 1.0, 1.0, 2.0],
        output_ids=[hist(40, 200), hist(300, vocab), hist(7, 60), [], hist(129, vocab)],
        prompt_ids=[hist(30, 200), hist(500, vocab), [], [], hist(64, 100)],
    )
    native = logits.clone()
    apply_penalties(native, batch)
    twin = logits.clone()
    with ops.torch_only():
        apply_penalties(twin, batch)
    assert torch.equal(native, twin)
    assert not torch.equal(native[0], logits[0]) and torch.equal(native[1], logits[1])


def test_native_penalties_match_the_torch_code():
    if not ops.native_available():
        pytest.skip("no native kernels here (no C++ compiler)")
    check_native_penalties_match_the_torch_code()


def test_native_argmax_is_torch_argmax():
    """First maximum on ties, NaN counted as the maximum (before or after the max), all -inf,
    rows narrower than a vector, strided rows."""
    if not ops.native_available():
        pytest.skip("no native kernels here (no C++ compiler)")
    check_native_argmax()


def check_native_argmax() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(12, 1000, generator=gen)
    x[1, [17, 400, 999]] = 50.0  # ties: the first
    x[2, 3] = float("nan")
    x[3, 600] = float("nan")
    x[3, 10] = 99.0  # a NaN after the maximum still wins
    x[4] = float("-inf")
    x[5, 999] = 1e9  # the maximum in the scalar tail
    x[6, 900:] = float("inf")
    for t in (x, x[:, :5], x[:, 1:], x[::2], torch.randn(3, 49152, generator=gen)):
        assert torch.equal(ops.argmax(t), t.argmax(dim=-1)), t.shape


def check_native_logprobs_match_torch(vocab: int = 49152) -> None:
    """The native logprobs (``ops.logprobs_rows``) against log_softmax, gather, count and topk:
    rows picked in any order and repeated, k from 0 to 20, logits of several scales, a row's
    chosen token anywhere in its ranking, and ties (the lower token id first; a token tied with
    the chosen one is not above it)."""
    from pagedllm.sampler.sampler import gather_logprobs

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(10, vocab, generator=gen) * torch.tensor([0.5, 1, 2, 4, 8, 1, 1, 3, 0.1, 20])[:, None]
    logits[5, [3, 9, 40]] = 30.0  # a three-way tie at the top
    logits[6, [100, 7]] = float(logits[6, 50])  # two tokens tied with the chosen one
    rows = torch.tensor([9, 0, 5, 5, 6, 3, 2, 8, 1, 7, 4])
    ids = torch.randint(0, vocab, (len(rows),), generator=gen)
    ids[2], ids[3], ids[4] = 40, 3, 50
    ref = logits[rows].log_softmax(dim=-1)
    want = ref.gather(1, ids[:, None])[:, 0]
    distinct = [i for i in range(len(rows)) if int(rows[i]) != 5]  # torch.topk orders ties its own way
    for k in (0, 1, 5, 20):
        lp, rank, top_ids, top_lp = ops.logprobs_rows(logits, rows, ids, k)
        torch.testing.assert_close(lp, want, rtol=1e-6, atol=2e-6)  # an ulp or two
        assert rank.tolist() == ((ref > want[:, None]).sum(dim=-1) + 1).tolist()
        ref_top = ref.topk(k, dim=-1)
        torch.testing.assert_close(top_lp, ref_top.values, rtol=1e-6, atol=2e-6)
        assert top_ids[distinct].tolist() == ref_top.indices[distinct].tolist()
        if k >= 3:
            assert top_ids[2, :3].tolist() == [3, 9, 40]
    assert rank[2].item() == rank[3].item() == 1 and rank[4].item() == 1 + int((logits[6] > logits[6, 50]).sum())
    # Through gather_logprobs, natively and in torch: the same entries.
    ks = [2, None, 0, 5, 1, None, 3, 2, 2, 20, 4]
    native = gather_logprobs(logits, ids, ks, rows.tolist())
    with ops.torch_only():
        torch_entries = gather_logprobs(logits, ids, ks, rows.tolist())
    for a, b, row in zip(native, torch_entries, rows.tolist()):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_rank == b.token_rank and a.token_logprob == pytest.approx(b.token_logprob, rel=1e-6, abs=2e-6)
            assert len(a.top_ids) == len(b.top_ids)
            if row != 5:
                assert a.top_ids == b.top_ids
            np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, rtol=1e-6, atol=2e-6)


def test_native_logprobs_match_torch():
    if not ops.native_available():
        pytest.skip("no native kernels here (no C++ compiler)")
    check_native_logprobs_match_torch()
