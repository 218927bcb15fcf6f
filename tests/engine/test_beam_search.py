"""Beam search (engine/beam_search.py) against transformers' ``generate(num_beams=...)``, and its
KV blocks: beams share their prefix, dead beams free theirs at once."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 42, 8, 200, 31, 64, 11]


def oracle_beams(hf, prompt: list[int], width: int, max_tokens: int, eos: list[int] | None, **kw) -> list[tuple[list[int], float]]:
    """transformers' returned beams: (generated tokens up to and including an EOS, score)."""
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                        eos_token_id=eos, pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)  # fmt: skip
    out = []
    for seq, score in zip(g.sequences.tolist(), g.sequences_scores.tolist()):
        gen = seq[len(prompt) :]
        stop = next((i for i, t in enumerate(gen) if eos and t in eos), None)
        out.append((gen if stop is None else gen[: stop + 1], score))
    return out


def assert_same_beams(mine, theirs, tol: float = 1e-4) -> None:
    assert len(mine.sequences) == len(theirs)
    for seq, (tokens, score) in zip(mine.sequences, theirs):
        assert seq.output_token_ids == tokens
        assert seq.score == pytest.approx(score, abs=tol)
        n = len(tokens)
        assert seq.score == pytest.approx(seq.cum_logprob / n ** seq_length_penalty(mine), abs=1e-6)


def seq_length_penalty(out) -> float:
    return out.length_penalty  # set by the test on the output it checks


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    llm = LLM(str(tiny_llama), num_kv_blocks=300, block_size=4, log_stats_interval=0)
    return llm, hf


@pytest.mark.parametrize(
    "width,lp,early,ignore_eos",
    [(2, 1.0, False, True), (4, 1.0, False, False), (4, 0.5, True, False), (3, 2.0, "never", False), (4, -1.0, False, True)],
)
def test_tiny_model_matches_transformers(tiny, width, lp, early, ignore_eos):
    llm, hf = tiny
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=lp, early_stopping=early,
                              ignore_eos=ignore_eos, include_stop_str_in_output=True)  # fmt: skip
    (mine,) = llm.beam_search([{"prompt_token_ids": PROMPT}], params)
    mine.length_penalty = lp
    theirs = oracle_beams(hf, PROMPT, width, 10, None if ignore_eos else [2], length_penalty=lp, early_stopping=early)
    assert_same_beams(mine, theirs)
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks  # every beam's blocks came back


@pytest.fixture(scope="module")
def tiny_frequent_eos(tiny_llama, tmp_path_factory):
    """The tiny model with token 92 as its EOS: a token its beams rank in their top 8 at most
    steps, so searches finish hypotheses all along (with token 2 few ever did: a mutation audit
    changed how finished hypotheses are kept, ranked and bounded, and no parity case noticed)."""
    import json
    import shutil

    import transformers

    path = tmp_path_factory.mktemp("tiny-eos") / "m"
    shutil.copytree(tiny_llama, path)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            cfg = json.loads((path / name).read_text())
            cfg["eos_token_id"] = 92
            (path / name).write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), num_kv_blocks=300, block_size=4, log_stats_interval=0)
    assert llm.llm_engine.eos_token_ids == {92}
    return llm, hf


@pytest.mark.parametrize(
    "width,lp,early,max_tokens",
    [(2, 1.0, False, 10), (3, 1.0, False, 24), (4, 1.0, True, 10), (4, 0.5, False, 24), (3, 2.0, "never", 10),
     (4, 1.5, "never", 24), (2, 0.5, "never", 24), (4, -0.5, False, 10)],
)  # fmt: skip
def test_tiny_model_matches_transformers_when_beams_meet_eos_often(tiny_frequent_eos, width, lp, early, max_tokens):
    """Longer searches too: whether a search may stop before max_tokens (its worst kept
    hypothesis, "never"'s bound at max_tokens) decides which beams come back."""
    llm, hf = tiny_frequent_eos
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=lp, early_stopping=early,
                              include_stop_str_in_output=True)  # fmt: skip
    for prompt in (PROMPT, PROMPT[3:], [7, 7, 7, 120, 9], [1, 2, 3, 4, 5, 6]):
        (mine,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        mine.length_penalty = lp
        theirs = oracle_beams(hf, prompt, width, max_tokens, [92], length_penalty=lp, early_stopping=early)
        assert_same_beams(mine, theirs)


def test_a_search_whose_prompt_is_prefilled_in_chunks(tiny, tiny_llama):
    """A prompt longer than the step's token budget is prefilled over several steps (the chunks
    before the last sample nothing) before the beams branch: they equal the unchunked engine's."""
    llm, _ = tiny
    prompt = [(11 * j) % 240 + 3 for j in range(45)]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    (whole,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
    chunked = LLM(str(tiny_llama), num_kv_blocks=300, block_size=4, max_num_batched_tokens=16, log_stats_interval=0)
    (parts,) = chunked.beam_search([{"prompt_token_ids": prompt}], params)
    assert [s.output_token_ids for s in parts.sequences] == [s.output_token_ids for s in whole.sequences]
    assert len(parts.sequences) == 3 and all(len(s.output_token_ids) == 8 for s in parts.sequences)


def test_beams_share_the_prompt_and_free_dead_beams(tiny_llama):
    """Peak blocks of a 4-beam search: the prompt's blocks once plus about one tail per beam."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, block_size=4,
                                    enable_prefix_caching=False), log_stats_interval=0)  # fmt: skip
    prompt = list(range(3, 3 + 40))  # 10 full blocks
    width, max_tokens = 4, 6
    engine.add_beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    peak = 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, engine.kv_cache_manager.block_pool.num_used_blocks)
        engine.kv_cache_manager.check_integrity()
    peak = max(peak, engine.beams.peak_used_blocks)
    prompt_blocks = 10
    # each beam's tail: the (copied) last block plus blocks its own tokens filled
    tails = width * (-(-max_tokens // 4) + 1)
    assert prompt_blocks < peak <= prompt_blocks + tails
    assert peak < width * (prompt_blocks + 2)  # unshared beams would need this much
    assert engine.kv_cache_manager.num_free_blocks == 64
    assert len(outputs) == 1 and len(outputs[0].outputs) == width


def test_beams_run_beside_other_requests_and_abort(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=200, block_size=4), log_stats_interval=0)
    rid = engine.add_beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True))
    engine.add_request({"prompt_token_ids": PROMPT[:5]}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "plain")
    steps: list[set[str]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append({engine.scheduler.requests[s.req_id].parent_id for s in out.scheduled})
        return out

    engine.scheduler.schedule = recording_schedule
    for _ in range(4):
        engine.step()
    # one flattened batch: every step ran the beams (3 after the first) and the plain request together
    assert steps == [{rid, "plain"}] * 4
    outs = engine.abort_request(rid)
    assert [o.request_id for o in outs if o.finished] == [rid] and outs[0].outputs[0].finish_reason == "abort"
    assert all(r.parent_id != rid for r in engine.scheduler.requests.values())
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == 200


def test_bad_beam_params(tiny):
    llm, _ = tiny
    for bad in (dict(beam_width=0), dict(max_tokens=0), dict(temperature=0.7), dict(early_stopping="sometimes"), dict(early_stopping=1.0),
                dict(ignore_eos="yes"), dict(include_stop_str_in_output=None)):
        kw = dict(beam_width=2, max_tokens=4) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            BeamSearchParams(**kw)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=100000))


@pytest.fixture(scope="module")
def real(hf_default_model):
    return LLM(num_kv_blocks=400, log_stats_interval=0), hf_default_model


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4])
def test_default_model_matches_transformers(width, real, default_tokenizer):
    llm, hf = real
    eos = sorted(llm.llm_engine.eos_token_ids)
    chat = default_tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)  # fmt: skip
    prompts = [default_tokenizer.encode("The capital of France is"), chat]
    for prompt, (lp, early) in zip(prompts, [(1.0, False), (0.8, True)]):
        params = BeamSearchParams(beam_width=width, max_tokens=16, length_penalty=lp, early_stopping=early,
                                  include_stop_str_in_output=True)  # fmt: skip
        (mine,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        mine.length_penalty = lp
        assert_same_beams(mine, oracle_beams(hf, prompt, width, 16, eos, length_penalty=lp, early_stopping=early))


def test_beams_that_end_on_eos_leave_it_out_unless_asked(default_tokenizer):
    """As a plain request's stop token: by default a beam that ended on EOS shows neither the
    token nor its text (stop_reason names it); include_stop_str_in_output keeps both."""
    llm = LLM(num_kv_blocks=200, log_stats_interval=0)
    chat = default_tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)  # fmt: skip
    (eos,) = llm.llm_engine.eos_token_ids
    for include in (False, True):
        (out,) = llm.beam_search([{"prompt_token_ids": chat}], BeamSearchParams(beam_width=2, max_tokens=30,
                                                                             include_stop_str_in_output=include))  # fmt: skip
        for seq in out.sequences:
            assert seq.finish_reason == "stop" and seq.stop_reason == eos
            assert (seq.output_token_ids[-1] == eos) == include and ("<|im_end|>" in seq.text) == include


def test_best_of_returns_the_n_best_samples(tiny):
    """best_of=5, n=2 with a seed: the two returned are the two best of the same five samples
    (a seeded n=5 run draws the same five: sample i's seed derives from (seed, i))."""
    llm, _ = tiny
    prompt = {"prompt_token_ids": PROMPT}
    kw = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (all5,) = llm.generate([prompt], SamplingParams(n=5, logprobs=0, **kw), use_tqdm=False)
    (best2,) = llm.generate([prompt], SamplingParams(n=2, best_of=5, **kw), use_tqdm=False)
    (best2_lp,) = llm.generate([prompt], SamplingParams(n=2, best_of=5, logprobs=0, **kw), use_tqdm=False)
    ranked = sorted(all5.outputs, key=lambda o: -o.cumulative_logprob)
    assert len({tuple(o.token_ids) for o in all5.outputs}) > 2  # the samples differ
    assert [o.token_ids for o in best2.outputs] == [o.token_ids for o in ranked[:2]]
    assert [o.token_ids for o in best2_lp.outputs] == [o.token_ids for o in ranked[:2]]
    assert [o.cumulative_logprob for o in best2_lp.outputs] == pytest.approx([o.cumulative_logprob for o in ranked[:2]])
    assert [o.index for o in best2.outputs] == [0, 1]
    # Without logprobs asked for, neither the logprobs nor their sum are reported (as with n alone).
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in best2.outputs)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_an_aborted_best_of_request_says_so(tiny):
    """Aborted while some samples had already stopped, a best_of request's picks end as "abort":
    they were chosen among unfinished samples. (The stopped ones, with fewer tokens, have the
    higher cumulative logprobs: ranked as they were, the caller saw only "stop".)"""
    engine = tiny[0].llm_engine
    mixed = 0
    for seed in range(20):
        params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=seed, max_tokens=40,
                                allowed_token_ids=[7, 9], stop_token_ids=[9])  # fmt: skip
        engine.add_request({"prompt_token_ids": PROMPT}, params, f"a{seed}")
        if any(o.finished for _ in range(3) for o in engine.step()):
            continue  # every sample stopped first
        stopped = sum(sample not in engine.scheduler.requests for sample in engine._samples_of[f"a{seed}"])
        (out,) = [o for o in engine.abort_request(f"a{seed}") if o.request_id == f"a{seed}"]
        assert out.finished and [o.index for o in out.outputs] == [0, 1]
        assert [o.finish_reason for o in out.outputs] == ["abort", "abort"]
        assert all(o.stop_reason is None for o in out.outputs)
        mixed += stopped > 0
    assert mixed  # some seeds had stopped samples beside running ones when aborted
    assert not engine.has_unfinished_requests()


def test_best_of_ranks_a_sample_without_tokens_last():
    """An aborted sample that drew no token has no cumulative logprob to rank by."""
    from pagedllm.engine.best_of import BestOf
    from pagedllm.outputs import CompletionOutput, RequestOutput

    picks = BestOf()
    picks.add("r", SamplingParams(n=1, best_of=2, logprobs=0))
    samples = [CompletionOutput(0, "", [], 0.0, [], "abort"), CompletionOutput(1, "ab", [3, 4], -2.5, [], "abort")]
    (out,) = picks.select([RequestOutput("r", None, [1], samples, finished=True)])
    assert [o.token_ids for o in out.outputs] == [[3, 4]]


def test_use_beam_search_in_sampling_params(tiny):
    """The server's path: SamplingParams(use_beam_search, best_of, length_penalty) -> the n best beams."""
    llm, _ = tiny
    (beams,) = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=4, max_tokens=6, length_penalty=0.7))
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0, max_tokens=6, length_penalty=0.7)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [s.output_token_ids for s in beams.sequences[:2]]
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(use_beam_search=True, temperature=0.5)
    # Found by an adversarial session: detokenize=False was neither honoured (the beams had text)
    # nor refused, as the other fields a search cannot honour are.
    with pytest.raises(ValueError, match="^detokenize is not supported with use_beam_search"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(best_of=2, use_beam_search=True, temperature=0,
                                                                    max_tokens=4, detokenize=False), use_tqdm=False)  # fmt: skip


def test_a_search_that_cannot_fit_the_pool_is_refused(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=20, block_size=4), log_stats_interval=0)
    with pytest.raises(ValueError, match="KV blocks"):  # one beam fits (4 + 40 tokens = 11 blocks), 4 do not
        engine.add_beam_search({"prompt_token_ids": PROMPT[:4]}, BeamSearchParams(beam_width=4, max_tokens=40))
    assert not engine.has_unfinished_requests()


def test_a_search_without_max_tokens_runs_to_the_longest_that_fits(tiny_llama):
    """SamplingParams(use_beam_search=True) without max_tokens (the server's path): the search
    gets the longest max_tokens its beams fit in (it used to get the whole pool's context for
    one sequence, and then refuse itself for W of them)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=20, block_size=4), log_stats_interval=0)
    params = SamplingParams(use_beam_search=True, temperature=0, n=4, ignore_eos=True, max_tokens=None)
    engine.add_request({"prompt_token_ids": PROMPT[:4]}, params, request_id="b")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (out,) = [o for o in outs if o.finished]
    fit = engine.beams.longest_fit(4, 4, 10**6)
    assert engine.beams.worst_case_blocks(4, 4, fit) <= 20 < engine.beams.worst_case_blocks(4, 4, fit + 1)
    assert len(out.outputs) == 4 and all(len(c.token_ids) == fit for c in out.outputs)
    assert engine.kv_cache_manager.num_free_blocks == 20


def _one_at_a_time() -> tuple[BeamSearchParams, list[str], LLMEngine]:
    """Two searches that each fit the pool alone but not together: the default model, 14 blocks
    of 16 tokens, 3 beams of 30 tokens."""
    params = BeamSearchParams(beam_width=3, max_tokens=30)
    texts = ["The history of the Roman Empire spans many centuries and includes " * 3, "1 2 3 4 5 6 7 8 9 10 " * 3]
    return params, texts, LLMEngine(EngineConfig(max_model_len=256, max_num_seqs=4, num_kv_blocks=14), log_stats_interval=0)


def test_searches_that_fit_only_one_at_a_time_run_one_after_another():
    """Two searches that each fit the pool alone but not together (the default model, 14 blocks
    of 16 tokens): the second waits until the first ends. Before, both started, filled the pool
    with beams waiting for their siblings, and the engine spun forever with nothing scheduled
    (found by an adversarial session). Both give what they give alone; every block comes back."""
    params, texts, engine = _one_at_a_time()

    def run(which: list[int]) -> dict[int, list[list[int]]]:
        ids = {engine.add_beam_search(texts[i], params): i for i in which}
        got: dict[int, list[list[int]]] = {}
        for _ in range(1000):  # ~30 steps a search; a deadlock never ends
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    got[ids[out.request_id]] = [c.token_ids for c in out.outputs]
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests(), "the searches deadlocked"
        engine.kv_cache_manager.check_integrity()
        assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
        return got

    alone = {**run([0]), **run([1])}
    assert run([0, 1]) == alone and len(alone) == 2


@pytest.mark.parametrize("victim", ["waiting", "running"])
def test_aborting_one_of_two_searches_that_fit_one_at_a_time(victim):
    """The setup above, with one search aborted after a step: aborting the waiting one must not
    start it later (its group is gone: the step would raise), and aborting the running one must
    give its reserved blocks back and start the waiting one (else the engine spins for ever)."""
    params, texts, engine = _one_at_a_time()
    first, second = (engine.add_beam_search(t, params) for t in texts)
    engine.step()
    aborted, survivor = (second, first) if victim == "waiting" else (first, second)
    outs = engine.abort_request(aborted)
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == aborted] == ["abort"]
    finished = {o.request_id: o for o in _drain(engine)}
    assert aborted not in finished and len(finished[survivor].outputs) == 3


def _drain(engine, max_steps: int = 2000) -> list:
    outs = []
    for _ in range(max_steps):  # a deadlock never ends
        outs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "the engine stopped making progress"
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    return [o for o in outs if o.finished]


@pytest.mark.parametrize("order", ["beam-first", "plain-first"])
def test_a_search_and_a_plain_request_short_of_blocks_both_finish(tiny_llama, order):
    """A beam search beside an ordinary request in a pool too small for both (found by an
    adversarial session): the plain request preempted itself and then headed the queue, waiting
    for blocks that only the search's holders had, while the search's step requests waited
    behind it: nothing ran, forever. Each gives what it gives alone."""
    beam = BeamSearchParams(beam_width=2, max_tokens=30, ignore_eos=True)  # at most 7 blocks
    plain = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)  # 120 tokens: all 8 blocks

    def run(which: list[str]) -> dict[str, list[list[int]]]:
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8), log_stats_interval=0)
        for w in which:
            if w == "beam":
                engine.add_beam_search({"prompt_token_ids": list(range(10, 30))}, beam, "beam")
            else:
                engine.add_request({"prompt_token_ids": list(range(20, 60))}, plain, "plain")
        return {o.request_id: [c.token_ids for c in o.outputs] for o in _drain(engine)}

    alone = {**run(["beam"]), **run(["plain"])}
    both = run(["beam", "plain"] if order == "beam-first" else ["plain", "beam"])
    assert both == alone


def test_a_search_may_reach_max_model_len(tiny_llama):
    """prompt + max_tokens == max_model_len is a valid search; its last step request (the
    prompt and all but one token, asked for 2 tokens to be retired after 1) was checked as a
    new request and refused inside the step, which killed the served engine."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=100, block_size=4, max_model_len=16), log_stats_interval=0)
    engine.add_beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True), "b")
    (out,) = _drain(engine)
    assert [len(c.token_ids) for c in out.outputs] == [6, 6] and {c.finish_reason for c in out.outputs} == {"length"}


def test_request_ids_of_searches_and_requests_never_mix(tiny_llama):
    """An ordinary request under a live search's id is refused (it was accepted, and both then
    failed); a caller's id shaped like a search's step request never meets one."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=100, block_size=4), log_stats_interval=0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True), "x")
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        engine.add_request({"prompt_token_ids": [8, 9]}, params, "x")
    live = next(iter(engine.scheduler.requests))  # the search's first step request
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request({"prompt_token_ids": [8, 9]}, params, live)
    # Ids the search would give its next step requests, taken first by a caller.
    for i in range(1, 41):
        engine.add_request({"prompt_token_ids": [8, 9]}, params, f"x-beam{i}")
    finished = {o.request_id: o for o in _drain(engine)}
    assert len(finished) == 41 and all(o.error is None for o in finished.values())
    assert len(finished["x"].outputs) == 2 and all(len(c.token_ids) == 4 for c in finished["x"].outputs)
    assert all(len(finished[f"x-beam{i}"].outputs[0].token_ids) == 4 for i in range(1, 41))


def test_a_running_search_counts_as_running_between_its_steps(tiny_llama):
    """Found by an adversarial session: a search re-queues its beams after every step, so a
    running search of 4 beams showed as 0 running and 4 waiting at every scrape (and its beams
    counted against --max-waiting-requests)."""
    from pagedllm.engine.kv_state import kv_cache_state

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=200, block_size=4), log_stats_interval=0)
    engine.add_beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True), "S")
    engine.add_request({"prompt_token_ids": PROMPT[:3]}, SamplingParams(temperature=0, max_tokens=1), "plain")
    assert (engine.num_running(), engine.num_waiting()) == (0, 2)  # nothing has run yet
    engine.step()  # the prompt: the search chooses its 4 beams, the plain request finishes
    for _ in range(3):
        assert (engine.num_running(), engine.num_waiting()) == (4, 0)
        state = kv_cache_state(engine)
        assert (state["num_running"], state["num_waiting"]) == (4, 0)
        engine.step()
    _drain(engine)
    assert (engine.num_running(), engine.num_waiting()) == (0, 0)


def test_a_fault_inside_one_search_ends_that_search_only(tiny_llama, monkeypatch):
    """A bug in a search's own step (e.g. the max_model_len refusal above) ends it with
    finish_reason "error"; the engine and the requests beside it go on."""
    from pagedllm.engine.beam_search import BeamSearch

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=100, block_size=4), log_stats_interval=0)
    advance = BeamSearch._advance

    fork = engine.kv_cache_manager.fork

    def failing(self, group):
        if group.group_id == "bad" and len(group.beams[0].tokens) == 2:  # mid-way: one child forked
            forks = []

            def fork_once(parent, child):
                if forks:
                    raise RuntimeError("injected")
                forks.append(child)
                fork(parent, child)

            self.kv.fork = fork_once
            try:
                return advance(self, group)
            finally:
                self.kv.fork = fork
        return advance(self, group)

    monkeypatch.setattr(BeamSearch, "_advance", failing)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    engine.add_beam_search({"prompt_token_ids": PROMPT}, params, "bad")
    engine.add_beam_search({"prompt_token_ids": PROMPT}, params, "good")
    engine.add_request({"prompt_token_ids": PROMPT[:4]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "plain")
    outs = {o.request_id: o for o in _drain(engine)}
    assert outs["bad"].outputs[0].finish_reason == "error" and "injected" in outs["bad"].error
    assert [len(c.token_ids) for c in outs["good"].outputs] == [4, 4] and outs["good"].error is None
    assert len(outs["plain"].outputs[0].token_ids) == 4


def test_ids_of_samples_held_back_are_in_use(tiny_llama):
    """Samples 1..n-1 wait outside the scheduler until sample 0 has cached the prompt; a
    request under one of their ids was accepted, and releasing the sample then killed the step
    (found by a review). A refused best_of request leaves the live one's state alone."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=100, block_size=4), log_stats_interval=0)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(n=2, **{k: getattr(params, k) for k in
                       ("temperature", "seed", "max_tokens", "ignore_eos")}), "x")  # fmt: skip
    assert "1_x" not in engine.scheduler.requests  # held back
    with pytest.raises(ValueError, match="'1_x' is already in use"):
        engine.add_request({"prompt_token_ids": [8, 9]}, params, "1_x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request({"prompt_token_ids": [8, 9]}, SamplingParams(best_of=3, max_tokens=2), "x")
    finished = {o.request_id: o for o in _drain(engine)}
    assert list(finished) == ["x"] and [len(c.token_ids) for c in finished["x"].outputs] == [4, 4]


def test_a_search_on_sliding_window_layers_counts_every_kv_group(tmp_path):
    """Gemma 3 keeps a block table per KV-cache group; the search's size check counted one, so a
    search the pool could never hold was started and the engine spun forever with nothing to
    run (an adversarial session). Now it is refused up front, or it fits and finishes."""
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "g3", "gemma3_text", head_dim=16, num_hidden_layers=6, sliding_window=24,
                           query_pre_attn_scalar=24)  # fmt: skip
    params = BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True)

    def engine(num_blocks: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=num_blocks, block_size=4), log_stats_interval=0)

    probe = engine(400)
    assert probe.kv_cache_manager.num_groups > 1
    need = probe.beams.worst_case_blocks(len(PROMPT), 4, 30)
    with pytest.raises(ValueError, match="KV blocks"):
        engine(need - 1).add_beam_search({"prompt_token_ids": PROMPT}, params, "b")
    fits = engine(need)
    fits.add_beam_search({"prompt_token_ids": PROMPT}, params, "b")
    (out,) = _drain(fits, max_steps=500)
    assert [len(c.token_ids) for c in out.outputs] == [30] * 4
