"""Speculative decoding end to end on a tiny random model with the real tokenizer: drafts are
just more tokens of the flattened batch, and they change speed, never answers."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(tok) -> list[list[int]]:
    """Texts that repeat themselves (drafts get accepted) and ones that do not."""
    texts = [
        "one two three four five one two three four five one two three",
        "The cat sat on the mat. The cat sat on the mat. The cat",
        "Hello, my name is",
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
        "A B C D A B C D A B",
        "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20" * 3,
    ]
    return [tok.encode(t) for t in texts]


def _run(path, prompts, params, **kwargs):
    llm = LLM(str(path), dtype="float32", log_stats_interval=1e9, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # every block back, drafts' included
    kv.check_integrity()
    return llm, outs


CONFIGS = {
    "default": dict(num_kv_blocks=256),
    "chunked-prefill-tiny-pool-preemption": dict(num_kv_blocks=20, max_num_batched_tokens=24),
    "swap-preemption": dict(num_kv_blocks=20, max_num_batched_tokens=64, preemption_mode="swap", swap_space=0.01),
    "block_size=4-no-prefix-caching": dict(num_kv_blocks=200, block_size=4, enable_prefix_caching=False),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_drafts_give_the_tokens_of_plain_decoding_greedy_and_seeded(tiny_llama_tok, default_tokenizer, config):
    prompts = _prompts(default_tokenizer)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)] * len(prompts)
    params[2] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.5)  # no drafts
    # Seeded samples: one draw per output token, drafted or not, so the plain tokens too.
    # (Both draw near their repeating greedy text, so prompt lookup drafts for them.)
    params[0] = SamplingParams(temperature=0.3, top_k=3, seed=3, max_tokens=40, ignore_eos=True, logprobs=2)
    params[1] = SamplingParams(temperature=0.6, top_p=0.9, seed=4, max_tokens=40, ignore_eos=True)
    kwargs = CONFIGS[config]
    _, plain = _run(tiny_llama_tok, prompts, params, **kwargs)
    llm, spec = _run(tiny_llama_tok, prompts, params, speculative_config=SPEC, **kwargs)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if a.outputs[0].logprobs is not None:  # each token's logprob from its own row
            got = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
            want = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
            assert got == pytest.approx(want, abs=1e-4)
    stats = llm.llm_engine.stats.spec_total
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if "preemption" in config:
        assert llm.llm_engine.num_preemptions_total > 0
    if config == "swap-preemption":  # swapped out, not recomputed
        assert llm.llm_engine.kv_cache_manager.num_swap_outs > 0
    if config == "default":  # warm prefix cache: the same answers again
        warm = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in plain]
        assert sum(o.num_cached_tokens for o in warm) > 0


def test_seeded_sampling_with_drafts_is_reproducible_and_respects_max_tokens(tiny_llama_tok, default_tokenizer):
    prompts = _prompts(default_tokenizer)
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=23, ignore_eos=True, n=2)
    spec = SPEC | {"disable_by_batch_size": 64}  # 12 sequences
    _, first = _run(tiny_llama_tok, prompts, params, num_kv_blocks=256, speculative_config=spec)
    llm, again = _run(tiny_llama_tok, prompts, params, num_kv_blocks=256, speculative_config=spec)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in again]
    assert all(len(c.token_ids) == 23 for o in first for c in o.outputs)
    assert llm.llm_engine.stats.spec_total.num_drafts > 0


def test_bad_speculative_config_is_a_value_error(tiny_llama_tok):
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(str(tiny_llama_tok), speculative_config={"method": "medusa-x"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_llama_tok), speculative_config='{"num_speculative_tokens": -1}')
    # Settings the method would not use are refused, not ignored (they were).
    for spec, field in [({"method": "ngram", "model": "/nonexistent"}, "speculative_config.model"),
                        ({"method": "medusa", "model": ""}, "speculative_config.model"),
                        ({"method": "eagle", "prompt_lookup_min": 3, "prompt_lookup_max": 5}, "prompt_lookup_min/max"),
                        ({"method": "ngram", "prompt_lookup_max": 2000}, "prompt_lookup_max")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            LLM(str(tiny_llama_tok), speculative_config=spec)


def test_server_streams_drafted_tokens_and_counts_them(tiny_llama_tok):
    import json

    import openai

    from tests.entrypoints.server_utils import ServerProcess

    args = ["--model", str(tiny_llama_tok), "--dtype", "float32", "--num-kv-blocks", "200", "--max-model-len", "512"]
    srv = ServerProcess([*args, "--speculative-config", json.dumps(SPEC)])
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        body = dict(model=str(tiny_llama_tok), prompt="A B C D A B C D A B", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
        whole = c.completions.create(**body)
        chunks = list(c.completions.create(**body, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
        drafts, drafted = srv.metric("pagedllm:spec_decode_num_drafts_total"), srv.metric("pagedllm:spec_decode_num_draft_tokens_total")
        accepted = srv.metric("pagedllm:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= drafted
        assert srv.metric("pagedllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
        assert srv.metric("pagedllm:generation_tokens_total") == 2 * whole.usage.completion_tokens == 60
    finally:
        assert srv.stop() == 0
    with pytest.raises(RuntimeError, match="speculative_config"):
        ServerProcess([*args, "--speculative-config", '{"method": "nope"}'], timeout=60)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, default_tokenizer):
    """Another random model (1 layer, its own width) sharing the target's vocabulary."""
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-draft"), vocab_size=49152, seed=11, num_hidden_layers=1,
                           hidden_size=32, intermediate_size=64)  # fmt: skip
    default_tokenizer.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("config", ["default", "chunked-prefill-tiny-pool-preemption"])
def test_self_draft_accepts_every_token_and_gives_plain_tokens(tiny_llama_tok, default_tokenizer, config):
    """The model as its own draft proposes exactly what the target picks: acceptance 100%.
    (A row's logits do not depend on the step's shape, docs/determinism.md.)"""
    prompts = _prompts(default_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = CONFIGS[config] if config == "default" else dict(num_kv_blocks=16, max_num_batched_tokens=24)
    _, plain = _run(tiny_llama_tok, prompts, params, **kwargs)
    spec = {"model": str(tiny_llama_tok), "num_speculative_tokens": 3, "auto_length": False}  # draft every step
    llm, got = _run(tiny_llama_tok, prompts, params, speculative_config=spec, **kwargs)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.llm_engine.stats.spec_total
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    # The draft's blocks go back when the runner hears its requests ended (the next step).
    drafter = llm.llm_engine.runner.proposer.drafter
    llm.generate([{"prompt_token_ids": prompts[0][:3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    held = sum(len(b) for b in drafter.cache.blocks_held().values())
    assert not {o.request_id for o in got} & set(drafter.cache.blocks_held())
    assert drafter.num_free_blocks + held == llm.llm_engine.kv_cache_manager.num_blocks
    if "preemption" in config:
        assert llm.llm_engine.num_preemptions_total > 0
    if config == "swap-preemption":  # swapped out, not recomputed
        assert llm.llm_engine.kv_cache_manager.num_swap_outs > 0


def test_the_model_as_its_own_draft_accepts_everything_at_every_position(tiny_llama_tok, default_tokenizer):
    """Self-drafting: every draft token is accepted, so each draft counts at position 0, and
    position j counts the drafts that had a token j (vLLM's per-position counter)."""
    prompts = _prompts(default_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(tiny_llama_tok), "num_speculative_tokens": 4, "auto_length": False}
    llm, got = _run(tiny_llama_tok, prompts, params, num_kv_blocks=256, speculative_config=spec)
    _, plain = _run(tiny_llama_tok, prompts, params, num_kv_blocks=256)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    s = llm.llm_engine.stats.spec_total
    assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens
    per_pos = s.accepted_per_pos
    assert len(per_pos) == 4 and per_pos[0] == s.num_drafts and sum(per_pos) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[3] > 0


@pytest.mark.parametrize("config", list(CONFIGS))
def test_small_random_draft_keeps_greedy_and_seeded_tokens(tiny_llama_tok, tiny_draft, default_tokenizer, config):
    prompts = _prompts(default_tokenizer)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)] * len(prompts)
    params[1] = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True)
    kwargs = CONFIGS[config]
    spec = {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 4, "disable_by_batch_size": 64,
            "auto_length": False}  # fmt: skip
    _, first = _run(tiny_llama_tok, prompts, params, speculative_config=spec, **kwargs)
    llm, again = _run(tiny_llama_tok, prompts, params, speculative_config=spec, **kwargs)
    _, plain = _run(tiny_llama_tok, prompts, params, **kwargs)
    for i, (a, b, c) in enumerate(zip(plain, first, again)):
        assert b.outputs[0].token_ids == c.outputs[0].token_ids == a.outputs[0].token_ids  # greedy and seeded
    assert llm.llm_engine.stats.spec_total.num_draft_tokens > 0


def test_bad_draft_models_are_value_errors(tiny_llama_tok, tmp_path):
    from tests.conftest import save_tiny_model

    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(tiny_llama_tok), speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(tiny_llama_tok), speculative_config={"model": str(tmp_path / "missing")})
    other_vocab = save_tiny_model(tmp_path / "v256", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama_tok), speculative_config={"model": str(other_vocab)})


def test_a_preempted_request_resumes_with_its_drafting_history(tiny_llama_tok):
    """The runner forgets a preempted request and relearns it on resume; the drafting policy's
    history (acceptance estimate, back-off) comes back with it, so the request drafts as it
    would have, instead of starting over from the prior. A finished request's history goes."""
    from pagedllm.runner.model_runner import SPEC_HISTORY
    from pagedllm.scheduler.output import NewRequestData, ScheduledRequest, SchedulerOutput

    llm = LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=8, speculative_config=SPEC, log_stats_interval=1e9)
    runner = llm.llm_engine.runner
    new = NewRequestData("r", [1, 2, 3], [], SamplingParams(temperature=0), frozenset(), [])
    learn = SchedulerOutput(scheduled=[ScheduledRequest("r", 3, 0, [0], True, new)])
    runner.update_states(learn)
    history = (7.5, 1.25, 8, 3, 2)
    for f, value in zip(SPEC_HISTORY, history):
        setattr(runner.requests["r"], f, value)
    runner.update_states(SchedulerOutput(preempted_ids=["r"]))
    assert "r" not in runner.requests
    runner.update_states(learn)
    assert tuple(getattr(runner.requests["r"], f) for f in SPEC_HISTORY) == history
    runner.update_states(SchedulerOutput(preempted_ids=["r"]))
    runner.update_states(SchedulerOutput(finished_req_ids={"r"}))  # aborted while waiting
    runner.update_states(learn)  # (a new request that reuses the id starts afresh)
    assert tuple(getattr(runner.requests["r"], f) for f in SPEC_HISTORY) == (0.0, 0.0, 0, 0, 0)


@pytest.mark.parametrize("kind", ["stop_token_ids", "stop"])
def test_a_stop_inside_accepted_drafts_ends_the_output_there(tiny_llama_tok, default_tokenizer, kind):
    """Tokens a step accepted after a stop token id or a stop string are dropped, with their
    logprobs: the output is plain decoding's. (Adversarial sessions found, for a stop token id,
    its text repeated and with logprobs an IndexError that killed the engine; for a stop
    string, the text cut but not the tokens.)"""
    prompt = _prompts(default_tokenizer)[0]
    _, (free,) = _run(tiny_llama_tok, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    toks = free.outputs[0].token_ids
    piece = lambda j: default_tokenizer.decode(toks[j : j + 1]).strip()  # noqa: E731
    # Self-drafting 3 tokens a step accepts all: outputs 1-3, 5-7, ... are accepted drafts,
    # each followed by more tokens of its step. Stop at the first one that is new.
    if kind == "stop_token_ids":
        j = next(j for j in range(1, len(toks)) if j % 4 and toks[j] not in toks[:j])
        stop = {"stop_token_ids": [toks[j]]}
    else:
        j = next(j for j in range(1, len(toks) - 1)
                 if j % 4 and len(piece(j)) > 2 and piece(j) not in default_tokenizer.decode(toks[:j]))  # fmt: skip
        stop = {"stop": [piece(j)]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0, **stop)
    _, (plain,) = _run(tiny_llama_tok, [prompt], params)
    spec = {"model": str(tiny_llama_tok), "num_speculative_tokens": 3, "auto_length": False}
    llm, (got,) = _run(tiny_llama_tok, [prompt], params, speculative_config=spec)
    assert llm.llm_engine.stats.spec_total.num_accepted_tokens > 0
    a, b = plain.outputs[0], got.outputs[0]
    assert b.token_ids == a.token_ids == toks[: j + 1] and b.finish_reason == a.finish_reason == "stop"
    assert b.text == a.text and b.stop_reason == a.stop_reason is not None
    assert len(b.logprobs) == j + 1 and b.cumulative_logprob == pytest.approx(a.cumulative_logprob)
    assert [e[t].logprob for e, t in zip(b.logprobs, b.token_ids)] == [e[t].logprob for e, t in zip(a.logprobs, a.token_ids)]
