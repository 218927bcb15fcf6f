"""Multi-LoRA throughput: ``pagedllm bench lora [--workload W1] [--num-adapters 8]``.

One engine with ``enable_lora`` runs the same workload three ways, timed apart: every
request on the base model, every request on one adapter, and the requests spread over
``--num-adapters`` adapters (request i on adapter i mod N, all of them in every step). The
ratios to the base run are the cost of LoRA serving (goal: >= 0.8 with 8 adapters).
``--lora-off-baseline`` also times the base model on a second engine without LoRA, to show
that enabling LoRA costs base-model requests nothing.

The adapters are random PEFT-format directories written for the model's shapes (rank
``--lora-rank``, all seven q/k/v/o/gate/up/down targets, non-zero B), or ``--adapter-dir``'s
subdirectories.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.bench.common import add_workload_args, cpu_name, report, workload_from_args
from pagedllm.entrypoints.arg_types import existing_dir, positive_int

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p, default="W1")
    p.add_argument("--num-adapters", type=positive_int, default=8, help="adapters the spread run uses (default: %(default)s)")
    p.add_argument("--lora-rank", type=positive_int, default=16, help="rank of the generated adapters (default: %(default)s)")
    p.add_argument("--adapter-dir", type=existing_dir, default=None, help="use the PEFT adapters in this directory's subdirectories instead")
    p.add_argument("--repeats", type=positive_int, default=1, help="run the three phases this many times; the best of each counts")
    p.add_argument("--lora-off-baseline", action="store_true", help="also time the base model on an engine without LoRA")


def write_random_adapter(path: Path, targets, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for a model with ``targets`` (a lora.adapter.TargetShapes)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(targets.num_layers):
        for module in TARGETS:
            if module not in targets.shapes:
                continue
            in_features, out_features = targets.shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    modules = sorted({k.split(".")[-3] for k in tensors})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def _timed(llm, prompts, params, loras) -> dict:
    """One phase, from a cold prefix cache: every phase (and the warm-up) runs the same prompts,
    and a cache kept across them gave later phases prefill for free (up to 75% of it)."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed}


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, LoRARequest, SamplingParams

    w = workload_from_args(args)
    n = args.num_adapters
    kwargs = {**engine_kwargs, "enable_lora": True, "max_loras": n, "max_lora_rank": args.lora_rank}
    kwargs["max_cpu_loras"] = max(n, kwargs.get("max_cpu_loras") or n)
    llm = LLM(**kwargs)
    tmp = None
    if args.adapter_dir:
        dirs = sorted(p for p in Path(args.adapter_dir).iterdir() if (p / "adapter_config.json").is_file())[:n]
        if len(dirs) < n:
            raise ValueError(f"--adapter-dir has {len(dirs)} adapters; --num-adapters is {n}")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="pagedllm-lora-bench-")
        targets = llm.llm_engine.runner.lora.table.targets
        dirs = [write_random_adapter(Path(tmp.name) / f"adapter{i}", targets, args.lora_rank, seed=i) for i in range(n)]
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    params = SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True)
    # Warm-up: kernels, and every adapter loaded and given a slot once.
    warm = [prompts[i % len(prompts)] for i in range(n)]  # one per adapter, however few the prompts
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lora_request=adapters, use_tqdm=False)
    phases = {
        "base": [None] * len(prompts),
        "1_adapter": [adapters[0]] * len(prompts),
        f"{n}_adapters": [adapters[i % n] for i in range(len(prompts))],
    }
    results: dict[str, dict] = {}
    load_before = os.getloadavg()[0]  # the phases are comparable only on a machine this run has to itself
    for _ in range(args.repeats):
        for name, loras in phases.items():
            r = _timed(llm, prompts, params, loras)
            if name not in results or r["output_tokens_per_s"] > results[name]["output_tokens_per_s"]:
                results[name] = r
    base = results["base"]["output_tokens_per_s"]
    result = {"workload": w.name, "num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len,
              "num_adapters": n, "lora_rank": args.lora_rank, "targets": list(TARGETS), "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "load_average_1min": [load_before, os.getloadavg()[0]], **results,
              "ratio_1_adapter": results["1_adapter"]["output_tokens_per_s"] / base,
              f"ratio_{n}_adapters": results[f"{n}_adapters"]["output_tokens_per_s"] / base}  # fmt: skip
    lines = [f"LoRA ({w.name}, rank {args.lora_rank}, q/k/v/o/gate/up/down, {cpu_name()}, "
             f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}):"]
    for name, r in results.items():
        lines.append(f"  {name:>12}: {r['output_tokens_per_s']:7.1f} output tokens/s ({r['elapsed_s']:.1f} s)"
                     + ("" if name == "base" else f"  ratio to base {r['output_tokens_per_s'] / base:.2f}"))  # fmt: skip
    del llm
    if args.lora_off_baseline:
        import gc

        gc.collect()
        off = LLM(**engine_kwargs)
        off.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        result["base_lora_off"] = r = _timed(off, prompts, params, None)
        lines.append(f"  base, engine without LoRA: {r['output_tokens_per_s']:7.1f} output tokens/s ({r['elapsed_s']:.1f} s)")
    if tmp is not None:
        tmp.cleanup()
    return report(result, "\n".join(lines), args.save_result)
