"""``pagedllm bench activation-dtype``: what ``--activation-dtype int8`` costs in accuracy and buys in speed.

- ``accuracy``: for each variant - ``float32`` (the reference), ``int8`` / ``int16`` (the engine's
  settings; ``ACT/KV`` adds a KV cache dtype, e.g. ``int16/float16``),
  ``int8-exact:NAME[+NAME]`` (int8 with those linears kept exact, e.g. ``lm_head`` or
  ``mlp.down_proj``) and ``int8-only:NAME[+NAME]`` (int8 for those linears only) - greedy agreement with float32 on the parity prompts (tokens equal before
  each prompt's first divergence, as a share; the code of ``bench kv-cache-dtype``) and the
  perplexity of the fixed text. Each variant is a fresh engine.
- ``w1``: W1's prompts (64 x 256 ids, greedy, EOS ignored) with ``--w1-output-len`` new tokens,
  float32 and int8 engines alternating ``--w1-rounds`` times (another process may share the
  cores: alternating spreads its load over both), output tokens per second, best round.
  ``bench throughput --workload W1 --activation-dtype int8`` is the full workload.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from pagedllm.bench.common import cpu_name
from pagedllm.bench.kv_cache_dtype import agreement_stats, greedy_and_perplexity
from pagedllm.entrypoints.arg_types import comma_list, positive_int, result_path

DEFAULT_VARIANTS = "float32,int8,int16,int16/float16,int8-exact:lm_head,int8-exact:mlp.down_proj"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", type=comma_list("accuracy", "w1"), default="accuracy,w1", help="comma-separated: accuracy, w1")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="accuracy part: float32, int8, int16 (each optionally /KV_CACHE_DTYPE), int8-exact:NAME[+NAME], int8-only:NAME[+NAME] (comma-separated)")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="accuracy part: greedy tokens per parity prompt")
    p.add_argument("--w1-output-len", type=positive_int, default=32)
    p.add_argument("--w1-rounds", type=positive_int, default=2)
    p.add_argument("--save-result", type=result_path, default=None, help="write the result as JSON to this file")


def make_llm(engine_kwargs: dict, variant: str):
    """A fresh engine for ``variant``: float32, int8 or int16 (``/KV``: with that KV cache dtype),
    or int8 with some linears kept exact."""
    from pagedllm import LLM
    from pagedllm.quantization import int8_activations

    kwargs = {**engine_kwargs, "log_stats_interval": 1e9}
    act, _, kv = variant.partition("/")
    if act in ("float32", "int8", "int16"):
        return LLM(**{**kwargs, "activation_dtype": act, **({"kv_cache_dtype": kv} if kv else {})})
    kind, _, names = variant.partition(":")
    if kind not in ("int8-exact", "int8-only") or not names:
        raise ValueError(f"unknown variant {variant!r}: float32, int8, int8-exact:NAME[+NAME] or int8-only:NAME[+NAME]")
    llm = LLM(**{**kwargs, "activation_dtype": "float32"})
    model = llm.llm_engine.runner.model
    keep = tuple(names.split("+"))
    if kind == "int8-only":  # every other linear stays exact
        linears = [n for n, m in model.named_modules() if hasattr(m, "set_int8")]
        keep = tuple(n for n in linears if not any(n == k or n.endswith("." + k) for k in keep))
    report = int8_activations.convert_model(model, keep_exact=keep)
    int8_activations.log_report(report)
    return llm


def bench_accuracy(engine_kwargs: dict, variants: list[str], max_tokens: int) -> dict[str, Any]:
    per: dict[str, Any] = {}
    ref: list[list[int]] | None = None
    for variant in dict.fromkeys(["float32", *variants]):
        llm = make_llm(engine_kwargs, variant)
        tokens, ppl = greedy_and_perplexity(llm, max_tokens)
        del llm
        gc.collect()
        ref = tokens if ref is None else ref
        per[variant] = {**agreement_stats(tokens, ref), "perplexity": ppl}
        per[variant]["perplexity_delta_pct"] = 100.0 * (ppl / per["float32"]["perplexity"] - 1)
        r = per[variant]
        print(f"  {variant:40s} agreement {r['agreement_pct']:5.1f}% ({r['prompts_identical']}/{len(ref)} identical)  "
              f"perplexity {r['perplexity']:.4f} ({r['perplexity_delta_pct']:+.3f}%)  {r['first_divergence']}", flush=True)  # fmt: skip
    return {"num_prompts": len(ref), "max_tokens": max_tokens, "per_variant": per}


def bench_w1(engine_kwargs: dict, output_len: int, rounds: int) -> dict[str, Any]:
    from pagedllm import SamplingParams
    from pagedllm.bench.workloads import WORKLOADS

    w = WORKLOADS["W1"]
    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    kwargs = {**engine_kwargs, "enable_prefix_caching": False}
    llms = {name: make_llm(kwargs, name) for name in ("float32", "int8")}
    out: dict[str, Any] = {"num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": output_len}
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for name, llm in llms.items():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    for _ in range(rounds):
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates[name].append(w.num_prompts * output_len / (time.perf_counter() - t))
            print(f"  {name:8s} {rates[name][-1]:.1f} output tok/s", flush=True)
    for name, r in rates.items():
        out[name] = {"output_tokens_per_s": max(r), "rounds": r}
    out["speedup"] = out["int8"]["output_tokens_per_s"] / out["float32"]["output_tokens_per_s"]
    return out


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict[str, Any]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    result: dict[str, Any] = {"cpu": cpu_name(), "threads": torch.get_num_threads()}
    print(f"CPU: {result['cpu']}, {result['threads']} threads")
    kwargs = {k: v for k, v in engine_kwargs.items() if k != "activation_dtype"}
    if "accuracy" in parts:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        print(f"\naccuracy vs float32 activations: parity prompts x {args.max_tokens} greedy tokens; perplexity of the fixed text:")
        result["accuracy"] = bench_accuracy(kwargs, variants, args.max_tokens)
    if "w1" in parts:
        print(f"\nW1 prompts (64 x 256), {args.w1_output_len} new tokens each, float32 and int8 alternating:")
        w = bench_w1(kwargs, args.w1_output_len, args.w1_rounds)
        result["w1"] = w
        print(f"  int8 / float32: {w['speedup']:.2f}x")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result
