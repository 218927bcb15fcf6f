"""Single-stream latency: ``pagedllm bench latency`` (W2: one 128-token prompt, 128 new tokens).

Each iteration streams one request (or, with ``--text-prompts``, each text prompt in turn)
through the engine and records the time to the first token and the time between later tokens;
prints mean / median / p99 over the iterations. With ``--speculative-config``, the same run
first measures the plain engine and reports the speed-up and the drafts' acceptance. Greedy
unless ``--temperature`` (and ``--top-p``, ...) is given: request i is then seeded with i.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from pagedllm.bench.common import (
    add_sampling_args,
    add_workload_args,
    percentile,
    report,
    request_params,
    sampling_from_args,
    workload_from_args,
)
from pagedllm.bench.throughput import parallel_line, parallel_stats
from pagedllm.bench.workloads import TEXT_PROMPTS, Workload
from pagedllm.engine.stats import SpecDecodeStats
from pagedllm.entrypoints.arg_types import positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, default="W2")
    p.add_argument("--num-iters", type=positive_int, default=5, help="timed iterations (after one warm-up)")
    p.add_argument("--text-prompts", choices=sorted(TEXT_PROMPTS), default=None,
                   help="instead of the workload's token ids: these chat prompts, answers ending at EOS (at most --output-len)")
    p.add_argument("--no-compare-plain", dest="compare_plain", action="store_false",
                   help="with --speculative-config: do not also measure the plain engine first")
    add_sampling_args(p)


def _one(engine, prompt: list[int], params, request_id: str) -> tuple[float, list[float], float]:
    """TTFT, the gaps between output tokens, and the process CPU seconds spent after the first
    token (the decode's cost, which other jobs on the machine inflate far less than wall time)."""
    from pagedllm.engine.output_processor import RequestOutputKind

    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, params, request_id, RequestOutputKind.DELTA)
    stamps: list[float] = []
    cpu_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.outputs[0].token_ids)
            if cpu_first is None and stamps:
                cpu_first = time.process_time()
    ttft = stamps[0] - start
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, gaps, time.process_time() - cpu_first


def _measure(args: argparse.Namespace, w: Workload, engine_kwargs: dict) -> dict:
    """TTFT and ms per output token of one engine over the iterations (prompts one at a time)."""
    from pagedllm import LLM

    llm = LLM(**engine_kwargs)
    if args.text_prompts:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
                                           return_dict=False) for t in TEXT_PROMPTS[args.text_prompts]]  # fmt: skip
    else:
        prompts = w.prompts()[:1]
    sampling = sampling_from_args(args)
    _one(llm.llm_engine, prompts[0], request_params(sampling, 8, 0), "warmup")
    warm_spec = copy.deepcopy(llm.llm_engine.stats.spec_total)  # the figures below leave the warm-up out
    before = llm.llm_engine.executor.collective_stats()
    ttfts, per_token, num_tokens, decode_cpu, decode_tokens, decode_wall = [], [], 0, 0.0, 0, 0.0
    for i in range(args.num_iters):
        for j, prompt in enumerate(prompts):
            llm.reset_prefix_cache()  # every iteration prefills the whole prompt, as a new one would
            params = request_params(sampling, w.output_len, i * len(prompts) + j, ignore_eos=not args.text_prompts)
            ttft, gaps, cpu = _one(llm.llm_engine, prompt, params, f"it{i}.{j}")
            ttfts.append(ttft)
            if gaps:
                per_token.append(statistics.mean(gaps))
            num_tokens += len(gaps) + 1
            decode_cpu, decode_tokens = decode_cpu + cpu, decode_tokens + len(gaps)
            decode_wall += sum(gaps)
    if not per_token:  # (text prompts answered by EOS at once)
        llm.llm_engine.close()
        raise ValueError("every answer ended at its first token: there is no time per output token to report")
    total = llm.llm_engine.stats.spec_total
    spec = SpecDecodeStats(total.num_drafts - warm_spec.num_drafts, total.num_draft_tokens - warm_spec.num_draft_tokens,
                           total.num_accepted_tokens - warm_spec.num_accepted_tokens)  # fmt: skip
    parallel = parallel_stats(llm.llm_engine, before)
    llm.llm_engine.close()
    return {
        "parallel": parallel,
        "dtype": str(llm.llm_engine.config.torch_dtype).removeprefix("torch."),
        "activation_dtype": llm.llm_engine.config.activation_dtype,
        "ttft_ms": {"mean": 1e3 * statistics.mean(ttfts), "median": 1e3 * statistics.median(ttfts), "p99": 1e3 * percentile(ttfts, 99)},
        "ms_per_output_token": {
            "mean": 1e3 * statistics.mean(per_token),
            "median": 1e3 * statistics.median(per_token),
            "p99": 1e3 * percentile(per_token, 99),
        },
        "output_tokens": num_tokens,
        # All output tokens after each request's first over their wall time: a token-weighted
        # rate (the ms-per-token mean above weighs every request alike, however short).
        "decode_tokens_per_s": decode_tokens / decode_wall if decode_wall else 0.0,
        # CPU seconds of the whole process per token after the first: with PAGEDLLM_NUM_THREADS=1
        # the cost of a token, whatever else runs on the machine.
        "cpu_ms_per_output_token": 1e3 * decode_cpu / max(1, decode_tokens),
        "spec_decode": None if not spec.num_drafts else {
            "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "acceptance_rate": spec.num_accepted_tokens / spec.num_draft_tokens,
            "mean_acceptance_length": 1 + spec.num_accepted_tokens / spec.num_drafts,
        },
    }  # fmt: skip


def _line(name: str, r: dict, iters: int) -> str:
    t, m = r["ttft_ms"], r["ms_per_output_token"]
    line = (
        f"Latency ({name}, {r['dtype']}, {iters} iterations): TTFT mean {t['mean']:.1f} / median "
        f"{t['median']:.1f} / p99 {t['p99']:.1f} ms; per output token mean {m['mean']:.2f} / median "
        f"{m['median']:.2f} / p99 {m['p99']:.2f} ms (CPU {r['cpu_ms_per_output_token']:.2f} ms); decode "
        f"{r['decode_tokens_per_s']:.1f} tok/s"
    )
    if r["spec_decode"]:
        s = r["spec_decode"]
        line += f"; drafts accepted {100 * s['acceptance_rate']:.1f}%, mean acceptance length {s['mean_acceptance_length']:.2f}"
    return line + parallel_line(r.get("parallel"))


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    w = workload_from_args(args)
    if w.output_len < 2:
        raise ValueError("--output-len must be at least 2: ms per output token needs a token after the first")
    name = args.text_prompts or w.name
    spec = engine_kwargs.get("speculative_config")
    sampling = sampling_from_args(args)
    result = {"workload": name, "speculative_config": spec, "sampling": sampling}
    name += "".join(f", {k} {v}" for k, v in sampling.items())
    lines = []
    if spec and args.compare_plain:
        plain = _measure(args, w, {**engine_kwargs, "speculative_config": None})
        result["plain"] = plain
        lines.append(_line(f"{name}, plain", plain, args.num_iters))
    result.update(_measure(args, w, engine_kwargs))
    lines.append(_line(f"{name}, speculative" if spec else name, result, args.num_iters))
    if "plain" in result:
        speedup = result["plain"]["ms_per_output_token"]["mean"] / result["ms_per_output_token"]["mean"]
        result["speedup_per_output_token"] = speedup
        cpu = result["plain"]["cpu_ms_per_output_token"] / result["cpu_ms_per_output_token"]
        result["cpu_speedup_per_output_token"] = cpu
        rate = result["decode_tokens_per_s"] / max(result["plain"]["decode_tokens_per_s"], 1e-9)
        result["decode_tokens_per_s_speedup"] = rate
        lines.append(f"speculative / plain: {speedup:.2f}x faster per output token, mean over requests "
                     f"({rate:.2f}x in decode tokens/s; {cpu:.2f}x in CPU time)")
    return report(result, "\n".join(lines), args.save_result)
