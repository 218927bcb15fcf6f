"""Offline throughput: ``pagedllm bench throughput --workload W1``.

Model load and a warm-up generate are excluded from the timing; the timed part is one
``LLM.generate`` over all prompts (greedy, EOS ignored, exactly ``output_len`` tokens each).
"""

from __future__ import annotations

import argparse
import json
import time

from pagedllm.bench.workloads import WORKLOADS, Workload


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default=None, help="a standard workload (WORKLOADS.md)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--save-result", default=None, help="write the result as JSON to this file")


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams

    w = WORKLOADS[args.workload] if args.workload else Workload(
        "custom", args.prompt_seed, args.num_prompts, args.input_len, args.output_len
    )
    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    llm = LLM(**engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    llm.generate(prompts[: min(4, len(prompts))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == w.num_prompts * w.output_len, "every request must produce exactly output_len tokens"
    result = {
        "workload": w.name,
        "num_prompts": w.num_prompts,
        "input_len": w.input_len,
        "output_len": w.output_len,
        "dtype": engine_kwargs.get("dtype"),
        "elapsed_s": elapsed,
        "requests_per_s": w.num_prompts / elapsed,
        "total_tokens_per_s": w.num_prompts * (w.input_len + w.output_len) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "num_preemptions": llm.llm_engine.num_preemptions_total,
    }
    print(
        f"Throughput ({w.name}, {result['dtype']}): {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s, {result['output_tokens_per_s']:.1f} output tokens/s "
        f"({elapsed:.1f} s)"
    )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result
