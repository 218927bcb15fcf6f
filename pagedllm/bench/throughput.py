"""Offline throughput: ``pagedllm bench throughput --workload W1 [--compare transformers]``.

Model load and a warm-up are excluded from the timing; the timed part is one generate call
over all prompts (greedy, EOS ignored, exactly ``output_len`` tokens each). With
``--compare transformers`` the same workload then runs through transformers ``generate``
(same weights, same dtype, batch = all prompts; equal prompt lengths need no padding) in the
same process, one after the other, and the ratio is printed.
"""

from __future__ import annotations

import argparse
import gc
import time

from pagedllm.bench.common import add_workload_args, report, workload_from_args
from pagedllm.bench.workloads import Workload


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--compare", choices=["transformers"], default=None, help="also run this baseline in the same run")


def _rates(w: Workload, elapsed: float) -> dict:
    return {
        "elapsed_s": elapsed,
        "requests_per_s": w.num_prompts / elapsed,
        "total_tokens_per_s": w.num_prompts * (w.input_len + w.output_len) / elapsed,
        "output_tokens_per_s": w.num_prompts * w.output_len / elapsed,
    }


def run_pagedllm(w: Workload, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    llm = LLM(**engine_kwargs)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True))
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == w.output_len for o in outs), "every request must give output_len tokens"
    return {"engine": "pagedllm", "num_preemptions": llm.llm_engine.num_preemptions_total, **_rates(w, elapsed)}


def run_transformers(w: Workload, model: str | None, dtype) -> dict:
    import torch
    import transformers

    from pagedllm.model.loader import resolve_model

    source = resolve_model(model)
    if source.format == "gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    hf.eval()
    ids = torch.tensor(w.prompts())

    def generate(batch: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    generate(ids[:4], 4)
    start = time.perf_counter()
    out = generate(ids, w.output_len)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == w.input_len + w.output_len
    return {"engine": "transformers", "transformers_version": transformers.__version__, **_rates(w, elapsed)}


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm.config import resolve_dtype
    from pagedllm.model.loader import DEFAULT_MODEL_NAME

    w = workload_from_args(args)
    dtype = resolve_dtype(engine_kwargs.get("dtype", "auto"))
    ours = run_pagedllm(w, engine_kwargs)
    result = {"workload": w.name, "model": engine_kwargs.get("model") or DEFAULT_MODEL_NAME,
              "num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len,
              "dtype": str(dtype).removeprefix("torch."), "pagedllm": ours}  # fmt: skip
    line = (
        f"pagedllm ({w.name}, {result['dtype']}): {ours['requests_per_s']:.2f} requests/s, "
        f"{ours['total_tokens_per_s']:.1f} total tokens/s, {ours['output_tokens_per_s']:.1f} output tokens/s "
        f"({ours['elapsed_s']:.1f} s)"
    )
    if args.compare == "transformers":
        gc.collect()
        base = run_transformers(w, engine_kwargs.get("model"), dtype)
        result["transformers"] = base
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
        line += (
            f"\ntransformers ({w.name}, {result['dtype']}, batch {w.num_prompts}): "
            f"{base['output_tokens_per_s']:.1f} output tokens/s ({base['elapsed_s']:.1f} s)"
            f"\nratio pagedllm / transformers: {result['ratio_output_tokens_per_s']:.2f}x"
        )
    return report(result, line, args.save_result)
