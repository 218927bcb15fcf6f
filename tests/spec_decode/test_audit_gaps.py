"""Behaviours of verification, the draft-length policy and the proposer that the other tests
left open: logprobs of later requests in a batch, biased greedy rows, the history that decides
draft lengths, the room before max_tokens, and which requests (and hidden rows) a drafter gets."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.sampler.sampler import Sampler, SamplingBatch
from pagedllm.spec_decode.draft_length import DraftCost
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.spec_decode.rejection import verify_drafts

from .test_proposer_and_rejection import LOGITS, _State


def test_each_request_s_logprobs_come_from_its_own_rows_after_a_rejection(native_or_torch):
    """A rejected draft leaves rows unused; the next request's logprobs must still be read from
    its own rows (not shifted onto the rejected request's leftovers), and each emitted token's
    from the row that produced it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3  # request 0: rows 0-2 (2 drafts), request 1: rows 3-5
    argmax = logits.argmax(dim=-1).tolist()
    wrong = (argmax[0] + 1) % 50
    drafts = [[wrong, argmax[1]], [argmax[3], argmax[4]]]  # request 0 rejected at once, request 1 accepted
    batch = SamplingBatch(temperatures=torch.zeros(6), generators=[None] * 6, num_logprobs=[2] * 6)
    tokens, logprobs = verify_drafts(Sampler(0), logits, batch, drafts)
    assert tokens == [[argmax[0]], argmax[3:6]]
    want = torch.log_softmax(logits.double(), dim=-1)
    for row, token, lp in [(0, argmax[0], logprobs[0][0])] + list(zip((3, 4, 5), argmax[3:6], logprobs[1])):
        assert lp.token_logprob == pytest.approx(float(want[row, token]), abs=1e-4), row
        assert lp.token_rank == 1
        assert lp.top_ids[0] == token


def test_greedy_verification_takes_the_argmax_after_logit_bias(native_or_torch):
    """Greedy requests with a logit bias (which may speculate) accept a draft when it is the
    argmax of the biased logits, and emit that argmax: exactly plain greedy decoding's tokens."""
    logits = torch.cat([LOGITS, LOGITS[1:]])  # unbiased argmax 0, 3, 3
    ids, bias = torch.tensor([6]), torch.tensor([100.0])
    batch = SamplingBatch(temperatures=torch.zeros(3), generators=[None] * 3, num_logprobs=[None] * 3,
                          logit_bias=[(r, ids, bias) for r in range(3)])  # fmt: skip
    assert verify_drafts(Sampler(0), logits, batch, [[6, 6]])[0] == [[6, 6, 6]]
    assert verify_drafts(Sampler(0), logits, batch, [[0, 3]])[0] == [[6]]


def test_a_request_that_drafts_again_probes_from_the_first_wait_when_it_fails_again():
    """The probe waits double only while a request keeps not drafting: once its drafts pay
    again, a later bad stretch starts the waits over from the first (6 steps for prompt lookup),
    rather than going on from the longest wait of the earlier stretch."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3), cost=DraftCost())
    s = _State([1, 2, 3, 1, 2, 3, 1, 2])
    s.spec_misses = 50.0  # a rate far too low to draft: probing, with the waits growing to 32
    accepted = None
    for _ in range(150):
        d = proposer.propose([s], [True], [accepted])[0]
        accepted = 0 if d else None
    assert s.spec_backoff == 32
    s.spec_skip = 0  # the wait ran out ...
    s.spec_misses, s.spec_hits = 0.0, 20.0  # ... and the text turned copyable: drafts pay again
    assert len(proposer.propose([s], [True], [None])[0]) == 3
    s.spec_misses, s.spec_hits = 50.0, 0.0  # and then bad again
    assert proposer.propose([s], [True], [None])[0] != []  # a probe, then the first wait
    assert s.spec_backoff == 6


def test_acceptance_history_decays_so_a_long_good_stretch_does_not_hide_a_bad_one():
    """Hits decay like misses: after a long run of accepted drafts, a run of rejected ones
    brings the request down to probes within a few steps (the estimate follows the text)."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3), cost=DraftCost())
    s = _State([1, 2, 3, 1, 2, 3, 1, 2])
    accepted = None
    for _ in range(100):  # every draft accepted in full
        d = proposer.propose([s], [True], [accepted])[0]
        accepted = len(d) if d else None
    assert len(d) == 3
    lengths = []
    for _ in range(30):  # now every draft rejected
        d = proposer.propose([s], [True], [accepted])[0]
        lengths.append(len(d))
        accepted = 0 if d else None
    assert max(lengths[15:]) <= 1 and sum(lengths[15:]) <= 2, lengths


class _Drafter:
    """A model drafter stand-in: records what it was asked and drafts 7s."""

    def __init__(self, needs_hidden: bool = False):
        self.needs_hidden = needs_hidden
        self.calls = []

    def propose(self, req_ids, token_ids, limits, hidden=None):
        self.calls.append((list(req_ids), list(limits), hidden))
        return [[7] * n for n in limits]


def test_drafts_leave_room_for_the_last_token_before_max_tokens():
    """A step emits the accepted drafts plus one token, so a request with r tokens left before
    max_tokens drafts at most r - 1 (and is not asked at all with one token left): n-gram
    drafts are cut, a model drafter gets the smaller limit, and a request with no room spends
    no probe of the policy."""
    rep = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    ngram = Proposer(SpeculativeConfig(num_speculative_tokens=3, auto_length=False))
    two_left, one_left = _State(rep, max_tokens=5), _State(rep, max_tokens=4)
    two_left.output_token_ids, one_left.output_token_ids = [0, 0, 0], [0, 0, 0]
    assert ngram.propose([two_left, one_left], [True, True], [None, None]) == [[3], []]

    drafter = _Drafter()
    model = Proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=3, auto_length=False), drafter)
    two_left, one_left = _State(rep, max_tokens=5), _State(rep, max_tokens=4)
    two_left.output_token_ids, one_left.output_token_ids = [0, 0, 0], [0, 0, 0]
    assert model.propose([two_left, one_left], [True, True], [None, None]) == [[7], []]
    assert drafter.calls[0][:2] == ([two_left.req_id], [1])
    # Adaptive: a request with no room left spends no probe (its back-off is untouched).
    adaptive = Proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=3), _Drafter())
    one_left = _State(rep, max_tokens=4)
    one_left.output_token_ids, one_left.spec_misses = [0, 0, 0], 50.0
    assert adaptive.propose([one_left], [True], [None]) == [[]]
    assert one_left.spec_backoff == 0 and one_left.spec_skip == 0


def test_rejected_prompt_lookup_drafts_count_as_misses_without_a_drafted_list():
    """``propose`` records each request's last draft length (``spec_drafted``) so a caller that
    passes no ``drafted`` still has rejected drafts counted: a cheap drafter whose drafts keep
    failing stops drafting."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3), cost=DraftCost())
    s = _State([1, 2, 3, 1, 2, 3, 1, 2])
    d = proposer.propose([s], [True], [None])[0]
    assert d and s.spec_drafted == len(d)
    lengths, accepted = [], 0
    for _ in range(40):
        d = proposer.propose([s], [True], [accepted])[0]
        lengths.append(len(d))
        accepted = 0 if d else None
    assert s.spec_misses > 1.0 and sum(lengths[20:]) <= 2, lengths


def test_acceptance_is_measured_against_the_tokens_actually_verified():
    """The scheduler may trim a draft (budget, max_tokens): the policy judges the ``drafted``
    tokens that were verified, so a trimmed draft accepted in full is no miss."""
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3, auto_length=False))
    s = _State([1, 2, 3, 1, 2, 3, 1, 2])
    assert len(proposer.propose([s], [True], [None])[0]) == 3
    proposer.propose([s], [True], [1], drafted=[1])  # trimmed to one token, which was accepted
    assert s.spec_misses == 0.0 and s.spec_hits == 1.0


def test_requests_with_bad_words_or_structured_outputs_get_no_drafts():
    """Bad words and grammars change a position's distribution with the tokens before it, which
    verification does not model: such requests decode one token at a time."""
    from pagedllm.sampling_params import StructuredOutputsParams

    drafter = _Drafter()
    for proposer in (Proposer(SpeculativeConfig(num_speculative_tokens=2, auto_length=False)),
                     Proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=2, auto_length=False), drafter)):  # fmt: skip
        rep = [1, 2, 3, 1, 2]
        bad = _State(rep)
        bad.bad_words_token_ids = [[9]]
        grammar = _State(rep, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
        plain = _State(rep)
        drafts = proposer.propose([bad, grammar, plain], [True] * 3, [None] * 3)
        assert drafts[0] == [] and drafts[1] == [] and drafts[2]
    assert drafter.calls[0][0] == [plain.req_id]


def test_a_hidden_state_drafter_gets_the_rows_of_the_requests_it_drafts_for():
    """Medusa heads draft from each request's own last hidden state: when some requests of the
    step do not draft (params it cannot verify, a back-off), the drafter still gets the rows of
    those that do, not the first rows of the batch."""
    drafter = _Drafter(needs_hidden=True)
    proposer = Proposer(SpeculativeConfig(method="medusa", num_speculative_tokens=2, auto_length=False), drafter)
    states = [_State([1, 2, 3], presence_penalty=0.5), _State([4, 5, 6]), _State([7, 8], min_tokens=2), _State([9])]
    hidden = torch.arange(4, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i
    proposer.propose(states, [True] * 4, [None] * 4, hidden)
    req_ids, _, rows = drafter.calls[0]
    assert req_ids == [states[1].req_id, states[3].req_id]
    assert rows[:, 0].tolist() == [1.0, 3.0]


class _Target:
    """The parts of a target model the EAGLE proposer shares: embeddings and the LM head."""

    def __init__(self, hidden: int, vocab: int):
        gen = torch.Generator().manual_seed(5)
        self.embed = torch.randn(vocab, hidden, generator=gen)
        self.out = torch.randn(vocab, hidden, generator=gen)
        self.lm_head = None

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.out.T


def _eagle(k: int, max_model_len: int = 64):
    from pagedllm.attention.backend import get_attention_backend
    from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype
    from pagedllm.spec_decode.eagle import EagleConfig, EagleHead, EagleProposer

    torch.manual_seed(0)
    head = EagleHead(EagleConfig(32, 4, 2, 8, 48, 100)).eval()
    target = _Target(32, 100)
    backend = get_attention_backend("auto", torch.float32, torch.device("cpu"))
    kv = resolve_kv_cache_dtype("auto", torch.float32)
    return EagleProposer(head, target, k, 16, 4, max_model_len, kv, backend, torch.device("cpu")), head, target


def _dense_chain(head, target, ids: list[int], feats: torch.Tensor, offset: int, k: int) -> list[int]:
    """EAGLE's drafts by the dense path: pairs (token t + 1, feature t) from ``offset``, then each
    guessed feature and its token appended as the next pair."""
    e, f = target.embed_tokens(torch.tensor(ids[offset + 1 :])), feats[offset : len(ids) - 1]
    drafts = []
    with torch.no_grad():
        for _ in range(k):
            g = head.forward_dense(e, f)[-1:]
            drafts.append(int(target.compute_logits(g).argmax(dim=-1)))
            e, f = torch.cat([e, target.embed_tokens(torch.tensor(drafts[-1:]))]), torch.cat([f, g])
    return drafts


def test_eagle_chains_each_guessed_feature_into_the_next_draft():
    """Each drafting step after the first feeds the head its own newest guessed feature (with
    the token it drafted): the drafts equal the dense path's chain, at every depth."""
    proposer, head, target = _eagle(k=4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (11,), generator=gen).tolist()
    feats = torch.randn(10, 32, generator=gen)
    proposer.observe("r", 0, feats)  # the target's features of positions 0 .. 9
    got = proposer.propose(["r"], [ids], [4])[0]
    assert got == _dense_chain(head, target, ids, feats, 0, 4)


def test_eagle_starts_the_context_over_after_a_gap_and_drafts_only_from_the_newest_feature():
    """Features that do not continue the context (steps the proposer did not observe) start it
    over from their position, and the drafts come from that context; a request whose newest
    token was not sampled from the last feature seen gets no draft (it would be a stale guess);
    and drafts stop at the model's length."""
    proposer, head, target = _eagle(k=3)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (11,), generator=gen).tolist()
    feats = torch.randn(10, 32, generator=gen)
    proposer.observe("r", 0, feats[:5])
    proposer.observe("r", 7, feats[7:10])  # positions 5, 6 unobserved: a gap
    assert proposer.propose(["r"], [ids], [3])[0] == _dense_chain(head, target, ids, feats, 7, 3)
    proposer.observe("s", 0, feats[:8])  # the features up to position 7, but the sequence is at 10
    assert proposer.propose(["s"], [ids], [3])[0] == []
    short, head, target = _eagle(k=3, max_model_len=12)
    short.observe("r", 0, feats)
    assert short.propose(["r"], [ids], [3])[0] == _dense_chain(head, target, ids, feats, 0, 1)


def test_the_prior_weighs_as_one_success_and_one_failure():
    """Before any verified draft the estimate is the prior; a first draft then moves it as far
    as two tokens' worth of prior evidence allows (``prior`` is documented as one success and
    one failure's worth), so one lucky draft does not make the request look certain."""
    from pagedllm.spec_decode.draft_length import DraftLengthPolicy

    policy = DraftLengthPolicy(3, DraftCost(), prior=0.5)
    s = _State([1])
    assert policy.acceptance(s) == pytest.approx(0.5)
    policy.record(s, drafted=3, accepted=3)
    assert policy.acceptance(s) == pytest.approx(4 / 5)
    assert DraftLengthPolicy(3, DraftCost(), prior=0.3).acceptance(_State([1])) == pytest.approx(0.3)


def test_a_feature_drafter_observes_only_requests_that_may_draft():
    """EAGLE keeps each observed request's features until it drafts for it: a request whose
    params rule drafting out (penalties here) must not be observed, or its features would pile
    up for the whole request, never used."""

    class Observer(_Drafter):
        needs_features = True

        def __init__(self):
            super().__init__()
            self.observed = []

        def observe(self, req_id, position, rows):
            self.observed.append(req_id)

    drafter = Observer()
    proposer = Proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=2, auto_length=False), drafter)
    penalised, plain = _State([1, 2, 3], presence_penalty=0.5), _State([4, 5, 6])
    features = [(0, torch.zeros(3, 4)), (0, torch.zeros(3, 4))]
    proposer.propose([penalised, plain], [True, True], [None, None], features=features)
    assert drafter.observed == [plain.req_id]
