"""vLLM sampling behaviours end to end on a tiny model with the real tokenizer."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

NUM_BLOCKS = 200


@pytest.fixture(scope="module")
def llm(tiny_llama_tok) -> LLM:
    return LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=NUM_BLOCKS, log_stats_interval=1e9)


def gen(llm, prompt, **kw):
    (out,) = llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)
    return out


def greedy_reference(llm, prompt="Hello, my name is", n=24):
    return gen(llm, prompt, temperature=0, max_tokens=n, ignore_eos=True).outputs[0]


def test_stop_string_is_found_across_tokens_and_removed(llm):
    ref = greedy_reference(llm)
    # A stop string made of the end of one token's text and the start of the next one's.
    tok = llm.get_tokenizer()
    pieces = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    k = next(i for i in range(3, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i - 1]) >= 2)
    stop = pieces[k - 1][-1] + pieces[k][len(pieces[k - 1])]
    cut = ref.text.find(stop)
    out = gen(llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:cut]
    out2 = gen(
        llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    ).outputs[0]
    assert out2.text == ref.text[: cut + len(stop)]


def test_stop_token_ids_keep_the_token_in_the_output(llm):
    ref = greedy_reference(llm)
    stop_id = ref.token_ids[5]
    out = gen(llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]).outputs[0]
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # Its text is left out unless include_stop_str_in_output (as vLLM does).
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(ref.token_ids[:first])
    kept = gen(llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id],
               include_stop_str_in_output=True).outputs[0]  # fmt: skip
    assert kept.text == tok.decode(ref.token_ids[: first + 1]) != out.text


def test_min_tokens_masks_stop_tokens_until_reached(llm):
    ref = greedy_reference(llm)
    stop_id = ref.token_ids[1]
    out = gen(
        llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=6
    ).outputs[0]
    assert len(out.token_ids) >= 7 or out.finish_reason == "length"
    assert stop_id not in out.token_ids[:6]
    # The stop token pushed up: masked for exactly min_tokens tokens, then it stops the request.
    forced = gen(llm, "Hello, my name is", temperature=0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=6,
                 logit_bias={stop_id: 100.0}).outputs[0]  # fmt: skip
    assert forced.finish_reason == "stop" and forced.token_ids[-1] == stop_id and len(forced.token_ids) == 7
    assert stop_id not in forced.token_ids[:6]


def test_bad_words_are_never_generated(llm):
    ref = greedy_reference(llm)
    tok = llm.get_tokenizer()
    word = tok.decode([ref.token_ids[0]]).strip()
    assert word
    out = gen(llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word]).outputs[0]
    banned = {tuple(tok.encode(v, add_special_tokens=False)) for v in (word, " " + word)}
    for ids in banned:
        if len(ids) == 1:
            assert ids[0] not in out.token_ids
    assert out.token_ids != ref.token_ids


def test_allowed_token_ids_restrict_the_output(llm):
    allowed = [100, 200, 300, 400]
    out = gen(llm, "Hello", temperature=1.0, seed=0, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed).outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 20


def test_detokenize_false_gives_tokens_without_text(llm):
    ref = greedy_reference(llm)
    out = gen(llm, "Hello, my name is", temperature=0, max_tokens=24, ignore_eos=True, detokenize=False).outputs[0]
    assert out.token_ids == ref.token_ids and out.text == ""
    # nor text in log-probability entries (decoded_token None, as vLLM)
    out = gen(llm, "Hello, my name is", temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1, detokenize=False)
    entries = [e for pos in out.outputs[0].logprobs for e in pos.values()]
    entries += [e for pos in out.prompt_logprobs[1:] for e in pos.values()]
    assert len(entries) >= 8 and all(e.decoded_token is None for e in entries)


def test_cumulative_outputs_never_show_text_a_stop_string_takes_back(llm):
    from pagedllm.engine.output_processor import RequestOutputKind

    ref = greedy_reference(llm)
    stop = ref.text[len(ref.text) // 3 : len(ref.text) // 3 + 8]
    engine = llm.llm_engine
    rid = engine.add_request("Hello, my name is", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                             output_kind=RequestOutputKind.CUMULATIVE)  # fmt: skip
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == rid]
    assert texts[-1] == ref.text[: ref.text.find(stop)] and len(texts) > 3
    assert all(texts[-1].startswith(t) for t in texts)


def test_logit_bias_forces_a_token(llm):
    out = gen(llm, "Hello", temperature=0, max_tokens=5, ignore_eos=True, logit_bias={1234: 100}).outputs[0]
    assert out.token_ids == [1234] * 5


def test_out_of_vocabulary_ids_in_params_are_rejected(llm):
    for kw, field in [
        (dict(allowed_token_ids=[1, 49152]), "allowed_token_ids"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),
        (dict(logit_bias={49152: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=field):
            llm.generate("Hi", SamplingParams(**kw), use_tqdm=False)


@pytest.mark.parametrize("prompt_len, expected_peak", [(161, 10 + 4 * 1), (160, 9 + 4 * 2)])
def test_n_samples_share_prompt_blocks(llm, prompt_len, expected_peak):
    """Samples 1..3 start once sample 0 computed the prompt and adopt its full blocks from
    the prefix cache, except the block holding the last prompt token (recomputed for its
    logits). 161 tokens: 10 shared blocks + 1 own block per sample; 160 tokens: 9 shared +
    2 own per sample - never 4 x 11."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(1000, 1000 + prompt_len))}
    engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True), "par")
    peak = 0
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        peak = max(peak, kv.block_pool.num_used_blocks)
        kv.check_integrity()
    assert peak == expected_peak, peak
    (out,) = outputs
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    assert kv.num_free_blocks == NUM_BLOCKS


def test_n_samples_share_the_full_blocks_and_compute_their_own_partial_block(llm):
    """Parallel samples share the prompt's full blocks through the prefix cache (no block is
    forked: copy-on-write is beam search's, tested there); each computes its partial block."""
    prompt = {"prompt_token_ids": list(range(2000, 2000 + 20))}  # 1 full + 1 partial block
    params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    (single,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    # Greedy samples are identical and equal the single greedy run.
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS


def test_seeded_n_samples_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    a = llm.generate("The weather", params, use_tqdm=False)[0]
    b = llm.generate(["Something else entirely", "The weather"], params, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_logprobs_and_prompt_logprobs_shapes(llm):
    out = gen(llm, "Hello, my name is", temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    total = 0.0
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry and entry[tid].rank == 1  # greedy: the chosen token is the top one
        assert 3 <= len(entry) <= 4
        assert all(lp.decoded_token is not None for lp in entry.values())
        total += entry[tid].logprob
    assert abs(c.cumulative_logprob - total) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tid in entry and len(entry) <= 3
    # Values, not just shapes: the prompt's position j scores what generating from the first
    # j tokens would (the sampler's logprobs of the raw logits), for its top-2 tokens.
    ids = out.prompt_token_ids
    for j in (2, len(ids) - 1):
        first = gen(llm, {"prompt_token_ids": ids[:j]}, temperature=0, max_tokens=1, logprobs=2).outputs[0].logprobs[0]
        ranked = {t: lp.logprob for t, lp in out.prompt_logprobs[j].items() if lp.rank <= 2}
        assert len(ranked) == 2
        for t, lp in ranked.items():
            assert abs(first[t].logprob - lp) < 1e-4, (j, t)


def test_chat_renders_the_template_and_rejects_malformed_messages(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    (out,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    tok = llm.get_tokenizer()
    text = tok.decode(out.prompt_token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    outs = llm.chat([msgs, [{"role": "user", "content": "Yo"}]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 2
    cont = llm.chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}],
        SamplingParams(max_tokens=2),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )
    assert tok.decode(cont[0].prompt_token_ids).endswith("Hello th")
    for bad, match in [
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text part"),
        (["hello"], "must be"),
        ([], "non-empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.chat(bad, use_tqdm=False)
    # A template that renders nothing is named as such (it was "prompt_token_ids is empty").
    with pytest.raises(ValueError, match="the chat template rendered the messages as empty text"):
        llm.chat([{"role": "user", "content": ""}], chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                 add_generation_prompt=False, use_tqdm=False)  # fmt: skip
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS


def test_prompt_logprobs_are_complete_even_when_the_prefix_is_cached(llm):
    prompt = {"prompt_token_ids": list(range(3000, 3040))}  # 2.5 blocks, cached after the first run
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(first.prompt_logprobs) == len(second.prompt_logprobs) == 40
    for tid, a, b in zip(prompt["prompt_token_ids"][1:], first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=1e-5)


def test_parallel_samples_count_against_max_num_seqs(tiny_llama_tok):
    small = LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=64, max_num_seqs=4, log_stats_interval=1e9)
    engine = small.llm_engine
    engine.add_request("a", SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    for p in ("b", "c", "d"):
        engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        assert len(engine.scheduler.running) <= 4
    assert len(done) == 4 and sum(len(o.outputs) for o in done) == 6


def test_id_lists_are_deduplicated_and_made_tensors_once(llm, monkeypatch):
    """A request may bring up to 2**18 allowed ids (a body of duplicates) or 4,096 biases: they
    were converted to tensors for every row at every step, so one such request with n=32 made
    everyone's steps ~10x slower (an adversarial session). Now the list is deduplicated and
    the runner makes its tensors once per request; the result is unchanged."""
    params = SamplingParams(allowed_token_ids=[7, 5, 7, 5] * 1000)
    assert params.allowed_token_ids == [7, 5]

    from pagedllm.runner.model_runner import ModelRunner

    seen: list[tuple] = []
    original = ModelRunner._sampling_batch

    def spy(self, reqs, grammar=None):
        batch = original(self, reqs, grammar)
        seen.append((tuple(id(t) for _, t in batch.allowed), tuple(id(t) for _, t, _ in batch.logit_bias)))
        return batch

    monkeypatch.setattr(ModelRunner, "_sampling_batch", spy)
    out = gen(llm, "Hello", temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[1234, 99] * 500,
              logit_bias={t: 1.0 for t in range(2000, 6000)} | {1234: 100.0})  # fmt: skip
    assert out.outputs[0].token_ids == [1234] * 6
    assert len(seen) == 6 and len(set(seen)) == 1  # the same tensor objects at every step


def test_the_eos_that_ends_a_request_leaves_no_text(llm):
    """As vLLM: the token that ends a request adds no text, also with skip_special_tokens=False
    (the chat model's "<|im_end|>" ended its replies), unless include_stop_str_in_output; an
    ignored EOS is ordinary text."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    forced = dict(temperature=0, max_tokens=3, skip_special_tokens=False, logit_bias={eos: 100.0})
    out = gen(llm, "Hello", **forced).outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    kept = gen(llm, "Hello", include_stop_str_in_output=True, **forced).outputs[0]
    assert kept.token_ids == [eos] and kept.text == tok.eos_token
    ignored = gen(llm, "Hello", ignore_eos=True, **forced).outputs[0]
    assert ignored.token_ids == [eos] * 3 and ignored.text == tok.eos_token * 3


def test_cache_salt_in_a_prompt_dict(llm):
    """vLLM's prompt key ``cache_salt``: the same salt shares prefix-cache blocks, another does not."""
    prompt = "A prompt long enough to fill some blocks of the prefix cache. " * 4
    kw = dict(temperature=0, max_tokens=1)
    cached = [gen(llm, {"prompt": prompt, "cache_salt": s}, **kw).num_cached_tokens for s in ("a", "a", "b")]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    for bad in (5, ""):
        with pytest.raises(ValueError, match="cache_salt"):
            gen(llm, {"prompt": prompt, "cache_salt": bad}, **kw)
