"""``activation_dtype="int8"`` / ``"int16"``: the opt-in fast modes reach the linears, run the
integer kernel (or its twin), and keep the model answering (int16: with fp32's greedy tokens);
bad values are refused by name."""

from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import add_engine_args, engine_config_from_args
from pagedllm.kernels import ops
from pagedllm.model import fused_stack
from pagedllm.model.linear import Linear

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(20 + 5 * i)]} for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="activation_dtype"):
        EngineConfig(activation_dtype="int4")
    with pytest.raises(ValueError, match="activation_dtype"):
        LLM(activation_dtype="bf16")
    assert EngineConfig().activation_dtype == "float32"  # the exact default


def test_the_cli_flag_reaches_the_config(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).activation_dtype == "float32"
    assert engine_config_from_args(parser.parse_args(["--activation-dtype", "int8"])).activation_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--activation-dtype", "int4"])
    assert "activation-dtype" in capsys.readouterr().err


@pytest.fixture(scope="module")
def int4_engines(tiny_llama):
    """The tiny Llama quantized to Q4_1 at load, with fp32 and with int8 activations."""
    kw = dict(dtype="float32", quantization="int4", max_model_len=256, num_kv_blocks=64, log_stats_interval=1e9)
    return LLM(str(tiny_llama), **kw), LLM(str(tiny_llama), activation_dtype="int8", **kw)


def test_the_decoder_linears_take_int8_activations(int4_engines):
    exact, fast = int4_engines
    model = fast.llm_engine.runner.model
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert lin.int8 is not None and lin.int8.qtypes == "Q4_1"
            assert lin.weight is None and lin.panels is None and lin.packed is None  # released
    assert model.lm_head.int8 is None and model.lm_head.panels is not None  # checkpoint precision: no blocks
    caches = fast.llm_engine.runner.kv_caches
    assert fused_stack.why_not(model, caches) is None  # the one-call stack runs them (at every step size)
    plan = model.fused_stack.get(model, fast.llm_engine.runner.backend, caches, 1)
    assert set(plan.qtypes.unique().tolist()) == {fused_stack._INT8_QTYPES["Q4_1"]}
    assert all(m.int8 is None for m in exact.llm_engine.runner.model.modules() if isinstance(m, Linear))


def test_the_native_kernel_and_its_twin_give_the_same_tokens(int4_engines):
    """The same int8 model with the native kernels and with the torch twins (exact integer block
    sums on both sides: only fp32 rounding differs, far below this model's logit gaps)."""
    _, fast = int4_engines
    native = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, PARAMS, use_tqdm=False)]
    with ops.torch_only():
        twin = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert native == twin


def test_int8_activations_stay_close_to_fp32_on_a_tiny_model(int4_engines):
    """The tiny model's logits have clear winners (weights sharpened x4), so most greedy tokens
    survive int8 activations; measured 48/48 here, asserted >= 3/4."""
    exact, fast = int4_engines
    want = [o.outputs[0].token_ids for o in exact.generate(PROMPTS, PARAMS, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, PARAMS, use_tqdm=False)]
    agree = sum(_agreement(a, b) for a, b in zip(got, want))
    assert agree >= 0.75 * sum(len(w) for w in want), (got, want)


@pytest.mark.slow
def test_the_default_model_answers_in_int8_mode_and_keeps_its_greedy_text_in_int16():
    """SmolLM2-135M Q4_1. int8 activations move its logits by a few hundredths of a nat: near-ties
    flip (this small model's first answer token is often one: "The" vs "L'" at a 0.08-nat gap) and
    the greedy text then takes another path, but the model is as good: measured on the parity
    prompts (bench activation-dtype, docs/quantization.md) 54% of the greedy tokens before the
    first divergence and perplexity +0.40%. Asserted with margin for other CPUs' fp32 rounding:
    agreement >= 30%, perplexity within 2%, and the right answer once a near-tie is out of the way."""
    from pagedllm.bench.kv_cache_dtype import agreement_stats, greedy_and_perplexity

    kw = dict(dtype="float32", num_kv_blocks=512, max_model_len=2048, log_stats_interval=1e9)
    exact = LLM(**kw)
    want, ppl_exact = greedy_and_perplexity(exact, 48)
    del exact
    fast = LLM(activation_dtype="int8", **kw)
    got, ppl_fast = greedy_and_perplexity(fast, 48)
    assert agreement_stats(got, want)["agreement_pct"] >= 30
    assert abs(ppl_fast / ppl_exact - 1) < 0.02
    tok = fast.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Italy?"}], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    (out,) = fast.generate(prompt + "The", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Rome" in out.outputs[0].text
    # int16 quants are 256 times finer: measured 100% agreement (10/10 prompts identical) and
    # perplexity +0.003%; asserted at the performance issue's bar, >= 95%.
    del fast
    wide = LLM(activation_dtype="int16", **kw)
    got16, ppl16 = greedy_and_perplexity(wide, 48)
    assert agreement_stats(got16, want)["agreement_pct"] >= 95
    assert abs(ppl16 / ppl_exact - 1) < 0.001
