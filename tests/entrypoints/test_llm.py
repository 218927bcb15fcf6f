"""The offline LLM API on a tiny random model: shapes, ordering, bad input, block accounting."""

from __future__ import annotations

import pytest

from pagedllm import LLM, RequestOutput, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams

NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=256, log_stats_interval=1e9)


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks == NUM_BLOCKS
    assert not llm.llm_engine.has_unfinished_requests()


def tok(ids):
    return {"prompt_token_ids": ids}


def test_outputs_come_back_in_input_order_with_vllm_shapes(llm):
    prompts = [tok([5] * n) for n in (30, 1, 12, 50)]
    lens = [3, 7, 1, 5]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lens])
    assert [len(o.prompt_token_ids) for o in outs] == [30, 1, 12, 50]
    for out, m in zip(outs, lens):
        assert isinstance(out, RequestOutput) and out.finished
        (c,) = out.outputs
        assert c.index == 0 and len(c.token_ids) == m and c.finish_reason == "length"
    assert len({o.request_id for o in outs}) == 4
    assert_all_blocks_free(llm)


def test_single_token_prompt_dict_is_accepted(llm):
    (out,) = llm.generate(tok([9, 8, 7]), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == [9, 8, 7] and len(out.outputs[0].token_ids) == 2


def test_batching_does_not_change_greedy_output(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(tok([3, 4, 5, 6]), params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([tok([7] * 40), tok([3, 4, 5, 6]), tok([1, 2])], params, use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_stop_token_ids_end_the_request(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (first,) = llm.generate(tok([3, 4, 5, 6]), params, use_tqdm=False)
    stop_at = first.outputs[0].token_ids[2]
    idx = first.outputs[0].token_ids.index(stop_at)
    (out,) = llm.generate(
        tok([3, 4, 5, 6]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at])
    )
    c = out.outputs[0]
    assert c.token_ids == first.outputs[0].token_ids[: idx + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_at


def test_eos_ends_the_request_unless_ignored(llm):
    eos = 2
    assert eos in llm.llm_engine.eos_token_ids  # the tiny config says eos_token_id=2
    # EOS made likely (not certain) by a bias, so it turns up somewhere in most samples.
    params = SamplingParams(temperature=1.0, max_tokens=60, logit_bias={eos: 4.0})
    outs = llm.generate([tok([11, 12])] * 6, params, use_tqdm=False)
    for o in outs:
        ids = o.outputs[0].token_ids
        assert eos not in ids[:-1]
        assert (o.outputs[0].finish_reason == "stop") == (ids[-1] == eos)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 3  # (else this checks nothing)
    forced = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100.0})
    out = llm.generate(tok([11, 12]), forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    ignored = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True)
    out = llm.generate(tok([11, 12]), ignored, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"


def test_seed_makes_sampling_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(tok([20, 21, 22]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate([tok([9] * 30), tok([20, 21, 22]), tok([1, 2, 3])], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=12, seed=4321, ignore_eos=True)
    assert llm.generate(tok([20, 21, 22]), other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "prompt is empty"),
        (tok([]), None, "prompt_token_ids is empty"),
        (tok([1, 2, 256]), None, "outside the vocabulary"),
        (tok([1, -1]), None, "outside the vocabulary"),
        (tok([1, "a"]), None, "list of integers"),
        (tok([1] * 300), None, "max_model_len"),
        (tok([1] * 200), SamplingParams(max_tokens=100), "exceeds max_model_len"),
        (12345, None, "prompt must be"),
        ("hello", None, "no tokenizer"),
    ],
)
def test_bad_input_is_a_value_error_and_the_engine_keeps_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([tok([1, 2, 3]), prompt], params, use_tqdm=False)
    assert_all_blocks_free(llm)  # the good prompt queued before the bad one was withdrawn
    (out,) = llm.generate(tok([1, 2, 3]), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
        (dict(detokenize=1), "detokenize"),
        (dict(early_stopping=1.0), "early_stopping"),  # (1.0 == True, but not a bool)
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_bigger_than_the_pool_is_rejected_up_front(tiny_llama):
    small = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=4, log_stats_interval=1e9)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate(tok([1] * 60), SamplingParams(max_tokens=10), use_tqdm=False)
    (out,) = small.generate(tok([1] * 30), SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10


def test_preemption_under_a_tiny_pool_keeps_outputs_and_frees_everything(tiny_llama, llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [tok(list(range(3 + i, 35 + i))) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=8, log_stats_interval=1e9)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.llm_engine.num_preemptions_total > 0
    kv = tight.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_mismatched_sampling_params_list_is_rejected(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([tok([1]), tok([2])], [SamplingParams()], use_tqdm=False)


def test_engine_config_errors_name_the_field(tiny_llama):
    for kwargs, field in [
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(dtype="float16x"), "dtype"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(max_model_len=100000), "max_model_len"),
        (dict(attention_backend="nope"), "attention_backend"),
        # A twelfth adversarial session: an allocator traceback (a rank of 1e9), a traceback
        # after the model loaded (no such directory), silently ignored (no swap mode), a
        # TypeError at the first generate, stats off for the string "no".
        (dict(enable_lora=True, max_lora_rank=10**9), "max_lora_rank must be at most 512"),
        (dict(preemption_mode="swap", swap_path="/nonexistent/dir/f"), "swap_path '/nonexistent/dir/f': no writable directory"),
        (dict(preemption_mode="swap", swap_path=123), "swap_path must be a file path"),
        (dict(swap_path="/tmp/swap"), "swap_path needs preemption_mode='swap'"),
        (dict(log_stats_interval="5"), "log_stats_interval must be a number of seconds"),
        (dict(log_stats_interval=-1.0), "log_stats_interval must be a number of seconds"),
        (dict(log_stats_interval=float("nan")), "log_stats_interval must be a number of seconds"),
        (dict(disable_log_stats="no"), "disable_log_stats must be a bool"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(str(tiny_llama), **kwargs)


def test_two_engines_in_one_process_are_independent(tiny_llama, llm):
    other = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, log_stats_interval=1e9)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    a = llm.generate(tok([4, 5, 6]), params, use_tqdm=False)[0].outputs[0].token_ids
    b = other.generate(tok([4, 5, 6]), params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    assert other.llm_engine.kv_cache_manager.num_blocks == 16


def test_prefix_cache_hits_reset_and_identical_outputs(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, log_stats_interval=1e9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    shared = list(range(10, 74))  # 4 full blocks
    (cold,) = llm.generate(tok(shared + [1, 2, 3]), params, use_tqdm=False)
    assert cold.num_cached_tokens == 0
    (warm,) = llm.generate(tok(shared + [1, 2, 3]), params, use_tqdm=False)
    assert warm.num_cached_tokens == 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    (other,) = llm.generate(tok(shared + [9]), params, use_tqdm=False)
    assert other.num_cached_tokens == 64
    llm.reset_prefix_cache()
    (after_reset,) = llm.generate(tok(shared + [1, 2, 3]), params, use_tqdm=False)
    assert after_reset.num_cached_tokens == 0
    assert after_reset.outputs[0].token_ids == cold.outputs[0].token_ids
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == 64


def test_priority_policy_in_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=12, scheduling_policy="priority", log_stats_interval=1e9)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(tok([3 + i] + list(range(50, 109))), params, f"low{i}", priority=5)
    engine.step()
    engine.add_request(tok([7, 8, 9]), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "high", priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished[0] == "high" and sorted(finished[1:]) == ["low0", "low1", "low2"]
    with pytest.raises(ValueError, match="priority"):
        engine.add_request(tok([1]), params, priority="high")


@pytest.mark.parametrize("swap_path", [False, True])
def test_swap_preemption_keeps_outputs(tiny_llama, llm, tmp_path, swap_path):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [tok(list(range(3 + i, 35 + i))) for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(
        str(tiny_llama),
        dtype="float32",
        num_kv_blocks=8,
        preemption_mode="swap",
        swap_space=0.001,
        swap_path=str(tmp_path / "swap.bin") if swap_path else None,
        enable_prefix_caching=False,
        log_stats_interval=1e9,
    )
    engine = tight.llm_engine
    swapped = 0
    for p in prompts:
        engine.add_request(p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        swapped += len(engine.kv_cache_manager.req_to_swapped)
        engine.kv_cache_manager.check_integrity()
    assert swapped > 0 and engine.num_preemptions_total > 0 and engine.kv_cache_manager.num_swap_outs > 0
    assert [outs[k].outputs[0].token_ids for k in sorted(outs, key=int)] == expected
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == 8 and kv.swap_pool.num_free_blocks == kv.swap_pool.num_blocks


def test_odd_python_inputs_are_value_errors_naming_the_field(tiny_llama_tok):
    """Inputs only Python callers can send (found by an adversarial session; each used to be a
    TypeError, IndexError or RecursionError from deeper down). The engine works on after each."""
    from pagedllm.sampling_params import StructuredOutputsParams

    llm = LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=256, log_stats_interval=1e9)
    zero_n = SamplingParams(max_tokens=3)
    zero_n.n = 0  # set after construction
    nested: dict = {"prompt": "hi"}
    for _ in range(5000):
        nested = {"prompt": nested}
    cases = [
        (lambda: llm.generate("hi \ud800", use_tqdm=False), "prompt contains a lone surrogate"),
        (lambda: llm.generate("hi", SamplingParams(bad_words=["\ud800"]), use_tqdm=False), "bad_words"),
        (lambda: llm.chat([{"role": "user", "content": "\udc00"}], use_tqdm=False), "messages contains a lone surrogate"),
        (lambda: llm.chat([{"role": "user", "content": "hi"}], tools="x", use_tqdm=False), "tools must be a non-empty list"),
        (lambda: llm.generate(None), "prompts must be"),
        (lambda: llm.generate("hi", zero_n, use_tqdm=False), "n must be at least 1"),
        (lambda: llm.generate({"prompt": "hi", "promt_token_ids": [1]}, use_tqdm=False), "unknown keys 'promt_token_ids'"),
        (lambda: SamplingParams(logit_bias={1.7: 5.0}), "logit_bias keys must be token ids"),
        (lambda: SamplingParams(logit_bias={True: 5.0}), "logit_bias keys must be token ids"),
        (lambda: SamplingParams(logit_bias={3: "5"}), "logit_bias values"),
        (lambda: StructuredOutputsParams(json_object=True, disable_any_whitespace="yes"), "disable_any_whitespace"),
        (lambda: LLM(str(tiny_llama_tok), max_model_len=True), "max_model_len must be a positive integer"),
        (lambda: LLM(str(tiny_llama_tok), kv_cache_space=True), "kv_cache_space"),
        # A third adversarial session (KeyError, TypeError, RecursionError, OverflowError before):
        (lambda: llm.chat({"role": "user", "content": "hi"}, use_tqdm=False), "messages must be a non-empty list"),
        (lambda: llm.chat(m for m in [{"role": "user", "content": "hi"}]), "messages must be a non-empty list"),
        (lambda: llm.chat([{"role": "user", "content": "hi"}], tools=[{"type": "function"}], use_tqdm=False), "tools"),
        (lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False,
                          tools=[{"type": "function", "function": {"name": "f", "parameters": {"enum": {1, 2}}}}]),
         "cannot be written as JSON"),
        (lambda: llm.generate(["a"], 5, use_tqdm=False), "sampling_params must be a SamplingParams"),
        (lambda: llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False), "sampling_params must be a SamplingParams"),
        (lambda: llm.generate(["a"], priority=5, use_tqdm=False), "priority must be a list"),
        (lambda: llm.generate(nested, use_tqdm=False), "prompt\\['prompt'\\] must be a string"),
        (lambda: LLM(str(tiny_llama_tok), seed=10**23), "seed must be a 64-bit integer"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1e308), "length_penalty"),
        # A sixth adversarial session: "false" turned prefix caching on; a priority under fcfs
        # was ignored; a string lora_request was counted as a list of characters.
        (lambda: LLM(str(tiny_llama_tok), enable_prefix_caching="false"), "enable_prefix_caching must be true or false"),
        (lambda: LLM(str(tiny_llama_tok), enable_lora="false"), "enable_lora must be true or false"),
        (lambda: llm.generate(["a"], priority=[5], use_tqdm=False), "priority is not supported with the 'fcfs'"),
        (lambda: llm.generate(["a"], lora_request="sql-adapter", use_tqdm=False), "lora_request must be a LoRARequest"),
        (lambda: llm.generate(["a"], lora_request=5, use_tqdm=False), "lora_request must be a LoRARequest"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    deep: dict = {"type": "string"}
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json=deep)
    assert SamplingParams(logit_bias={"12": 1}).logit_bias == {12: 1.0}  # JSON's string keys
    (out,) = llm.generate(tok([1, 2, 3]), SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    assert_all_blocks_free(llm)


def test_generate_from_two_threads_at_once_gives_each_its_own_outputs(tiny_llama_tok):
    """The engine is stepped by the calling thread, so calls from two threads take turns (they
    used to step it together: requests failed, and a call could return the other's outputs)."""
    import threading

    llm = LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=NUM_BLOCKS, log_stats_interval=1e9)
    prompts = [tok([1, 2, 3]), tok([4, 5, 6, 7]), tok([8, 9])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got: dict[int, list] = {}

    def run(i: int) -> None:
        got[i] = [o.outputs[0].token_ids for o in llm.generate(prompts[i:] + prompts[:i], params, use_tqdm=False)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert {i: got.get(i) for i in range(3)} == {i: want[i:] + want[:i] for i in range(3)}
    assert_all_blocks_free(llm)


def test_without_max_tokens_a_request_runs_to_the_longest_context_the_pool_holds(tiny_llama_tok):
    """max_tokens=None means "up to the limit": the KV pool's when it holds less than
    max_model_len (was refused: the request asked for max_model_len's blocks)."""
    llm = LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=4, max_model_len=256, log_stats_interval=1e9)
    outs = llm.generate([tok([1, 2, 3])] * 2, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4 * 16 - 3] * 2
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == 4
    # The chat endpoint leaves max_tokens to the engine too (it used to ask for max_model_len
    # minus the prompt, which a small pool refused: every chat request without max_tokens).
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).to_sampling_params().max_tokens is None


def test_streamed_samples_report_only_when_they_move(tiny_llama):
    """A delta output holds the samples with something new (found by an adversarial session,
    2026-11-27: a stream of n samples in a tight pool sent 58 of 99 chunks empty)."""
    from pagedllm.engine.output_processor import RequestOutputKind

    tight = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=8, log_stats_interval=1e9)
    engine = tight.llm_engine
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    engine.add_request(tok(list(range(3, 30))), params, request_id="r", output_kind=RequestOutputKind.DELTA)
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert c.token_ids or c.finish_reason, "an empty delta"
                tokens[c.index] += c.token_ids
    assert engine.num_preemptions_total > 0
    assert all(len(t) == 24 for t in tokens.values())


def test_vllm_arguments_without_meaning_here(tiny_llama):
    """vLLM users' LLM() arguments: the harmless ones are accepted (disable_log_stats turns the
    stats line off), the others refused with what to use instead."""
    llm = LLM(str(tiny_llama), num_kv_blocks=16, enforce_eager=True, trust_remote_code=True, disable_log_stats=True,
              enable_chunked_prefill=True, tokenizer_mode="auto", distributed_executor_backend="mp")  # fmt: skip
    assert llm.llm_engine.stats.interval == float("inf")
    with pytest.raises(ValueError, match="gpu_memory_utilization is vLLM's .* kv_cache_space"):
        LLM(str(tiny_llama), gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not available here: prefill is always chunked"):
        LLM(str(tiny_llama), enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="revision is vLLM's .*no downloads"):
        LLM(str(tiny_llama), revision="main")
    with pytest.raises(ValueError, match="unknown engine argument.* no_such_arg"):
        LLM(str(tiny_llama), no_such_arg=1)


def test_vllm_argument_orders_and_prompt_forms(tiny_llama):
    """vLLM scripts pass lora_request third to beam_search / fourth to chat and generate, token
    ids as bare lists, a tqdm-like callable as use_tqdm, seed=-1 for "unseeded" (a LoRA passed
    third to beam_search was taken for use_tqdm and dropped; found by an offline-API sweep)."""
    import inspect

    assert list(inspect.signature(LLM.generate).parameters)[1:5] == ["prompts", "sampling_params", "use_tqdm", "lora_request"]
    assert list(inspect.signature(LLM.chat).parameters)[1:6] == ["messages", "sampling_params", "use_tqdm", "lora_request", "chat_template"]
    assert list(inspect.signature(LLM.beam_search).parameters)[1:5] == ["prompts", "params", "lora_request", "use_tqdm"]
    llm = LLM(str(tiny_llama), num_kv_blocks=32, log_stats_interval=1e9)
    from pagedllm.lora.request import LoRARequest

    with pytest.raises(ValueError, match="lora_request needs .*enable_lora"):  # the adapter is seen (this engine has no LoRA)
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2), LoRARequest("a", 1, "/nowhere"))
    greedy = SamplingParams(temperature=0, max_tokens=3)
    one = llm.generate([5, 6, 7], greedy, use_tqdm=False)
    two = llm.generate([[5, 6, 7], [8, 9]], greedy, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == [5, 6, 7] and [o.prompt_token_ids for o in two] == [[5, 6, 7], [8, 9]]
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    bars = []

    def make_bar(**kw):
        from tqdm import tqdm

        bars.append(kw)
        return tqdm(disable=True, **kw)

    llm.generate([[5, 6]], greedy, use_tqdm=make_bar)
    assert bars and bars[0]["total"] == 1
    assert SamplingParams(seed=-1).seed is None
    sp = SamplingParams(stop=["x"], seed=3)
    twin = sp.clone()
    assert twin == sp and twin.stop is not sp.stop
    assert llm.reset_prefix_cache() is True


def test_vllm_prompt_types(llm):
    from pagedllm import TextPrompt, TokensPrompt

    greedy = SamplingParams(temperature=0, max_tokens=2)
    (a,) = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), greedy, use_tqdm=False)
    (b,) = llm.generate([5, 6, 7], greedy, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and TextPrompt(prompt="x") == {"prompt": "x"}
