"""Single-stream latency: ``pagedllm bench latency`` (W2: one 128-token prompt, 128 new tokens).

Each iteration streams one request through the engine and records the time to the first
token and the time between later tokens; prints mean / median / p99 over the iterations.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.bench.common import add_workload_args, report, workload_from_args


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, default="W2")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations (after one warm-up)")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _one(engine, prompt: list[int], n: int, request_id: str) -> tuple[float, list[float]]:
    from pagedllm import SamplingParams
    from pagedllm.engine.output_processor import RequestOutputKind

    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       request_id, RequestOutputKind.DELTA)  # fmt: skip
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.outputs[0].token_ids)
    ttft = stamps[0] - start
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, gaps


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM

    w = workload_from_args(args)
    llm = LLM(**engine_kwargs)
    prompt = w.prompts()[0]
    _one(llm.llm_engine, prompt, 8, "warmup")
    ttfts, per_token = [], []
    for i in range(args.num_iters):
        llm.reset_prefix_cache()  # every iteration prefills the whole prompt, as a new one would
        ttft, gaps = _one(llm.llm_engine, prompt, w.output_len, f"it{i}")
        ttfts.append(ttft)
        per_token.append(statistics.mean(gaps))
    result = {
        "workload": w.name,
        "dtype": str(llm.llm_engine.config.torch_dtype).removeprefix("torch."),
        "activation_dtype": llm.llm_engine.config.activation_dtype,
        "ttft_ms": {"mean": 1e3 * statistics.mean(ttfts), "median": 1e3 * statistics.median(ttfts), "p99": 1e3 * _percentile(ttfts, 99)},
        "ms_per_output_token": {
            "mean": 1e3 * statistics.mean(per_token),
            "median": 1e3 * statistics.median(per_token),
            "p99": 1e3 * _percentile(per_token, 99),
        },
    }
    t, m = result["ttft_ms"], result["ms_per_output_token"]
    line = (
        f"Latency ({w.name}, {result['dtype']}, {args.num_iters} iterations): TTFT mean {t['mean']:.1f} / median "
        f"{t['median']:.1f} / p99 {t['p99']:.1f} ms; per output token mean {m['mean']:.2f} / median "
        f"{m['median']:.2f} / p99 {m['p99']:.2f} ms"
    )
    return report(result, line, args.save_result)
