"""Accuracy of weight-only quantization: ``pagedllm bench weight-quant --model HF_DIR``.

Loads the checkpoint as it is and with ``quantization=int8`` / ``int4``, and reports for each:
the perplexity of a fixed English text (from prompt log-probabilities) and its change, and how
many greedy tokens of a few prompts equal the unquantized model's before the first divergence.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pagedllm.bench.common import PERPLEXITY_TEXT, cpu_name, report
from pagedllm.entrypoints.arg_types import result_path

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):\n    ",
           "The three laws of thermodynamics are"]  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="int8,int4", help="comma-separated quantization methods")
    p.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--output", type=result_path, default=None, help="write the results as JSON here")


def _prefix_agreement(mine: list[int], ref: list[int]) -> int:
    n = 0
    while n < min(len(mine), len(ref)) and mine[n] == ref[n]:
        n += 1
    return n


def run(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ppl_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    per: dict[str, Any] = {}
    ref_tokens: list[list[int]] = []
    for method in [None, *args.methods.split(",")]:
        llm = LLM(**{**engine_kwargs, "quantization": method})
        ids = llm.get_tokenizer().encode(PERPLEXITY_TEXT)
        (out,) = llm.generate({"prompt_token_ids": ids}, ppl_params, use_tqdm=False)
        lps = [entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])]
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        ref_tokens = ref_tokens or tokens
        per[method or "none"] = {
            "perplexity": math.exp(-sum(lps) / len(lps)),
            "text_tokens": len(ids),
            "equal_before_divergence": [_prefix_agreement(t, r) for t, r in zip(tokens, ref_tokens)],
        }
        del llm
    base = per["none"]["perplexity"]
    for r in per.values():
        r["perplexity_delta_pct"] = 100 * (r["perplexity"] / base - 1)
    result = {"cpu": cpu_name(), "model": engine_kwargs.get("model"), "max_tokens": args.max_tokens, "per_method": per}
    lines = [f"{m}: perplexity {r['perplexity']:.4f} ({r['perplexity_delta_pct']:+.2f}%), greedy tokens equal "
             f"before divergence {r['equal_before_divergence']} of {args.max_tokens}" for m, r in per.items()]  # fmt: skip
    return report(result, "\n".join(lines), args.output)
