"""``pagedllm bench kv-cache-dtype``: what each ``--kv-cache-dtype`` costs and buys.

Three parts (``--parts``), each short enough to run once:

- ``attention``: the decode-attention kernel alone at the default model's shapes (9 query heads,
  3 KV heads, head_dim 64, block 16), ``--num-seqs`` x ``--context`` (default 64 x 320: W1's
  decode contexts), ms per call for each cache dtype and its speed-up over fp32. Calls of the
  dtypes alternate, round after round, so a busy machine slows them alike; medians.
- ``accuracy``: greedy agreement with the fp32 cache on the parity prompts of
  tests/test_parity.py (share of generated tokens equal before each prompt's first
  divergence) and perplexity of a fixed English text (prompt log-probabilities) per dtype.
- ``w1``: W1's prompts (64 x 256 random ids, greedy, EOS ignored) with ``--w1-output-len``
  new tokens (default 64, W1 has 128, to keep the run short), fp32 cache against int8, output
  tokens per second.

The model is loaded once; each dtype then gets a fresh model runner (new KV pools) around it,
and the prefix cache is reset, so only the KV storage differs between runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from typing import Any

import torch

from pagedllm.bench.common import PERPLEXITY_TEXT, cpu_name
from pagedllm.bench.workloads import parity_prompts
from pagedllm.entrypoints.arg_types import comma_list, positive_int, positive_int_list, result_path

DTYPES = ["float32", "bfloat16", "float16", "int8", "fp8_e4m3"]

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", type=comma_list("attention", "accuracy", "w1"), default="attention,accuracy,w1", help="comma-separated: attention, accuracy, w1")
    p.add_argument("--kv-dtypes", default=",".join(DTYPES), help="cache dtypes compared with float32")
    p.add_argument("--num-seqs", type=positive_int, default=64)
    p.add_argument("--context", type=positive_int, default=320)
    p.add_argument("--rounds", type=positive_int, default=30, help="attention part: calls per dtype")
    p.add_argument("--attention-threads", type=positive_int_list, default="", help="attention part: comma-separated thread counts (default: torch's)")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="accuracy part: greedy tokens per parity prompt")
    p.add_argument("--w1-output-len", type=positive_int, default=64)
    p.add_argument("--save-result", type=result_path, default=None, help="write the result as JSON to this file")


# ------------------------------------------------------------------------------ attention
def bench_attention(dtypes: list[str], num_seqs: int, context: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """ms per decode-attention call per cache dtype (medians of alternating rounds) and speed-ups."""
    from pagedllm.kernels import kv_ops, ops

    H, Hkv, D, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(seed)
    nbps = -(-context // bs)
    nb = num_seqs * nbps + 1
    tables = (torch.randperm(nb - 1, generator=g)[: num_seqs * nbps] + 1).view(num_seqs, nbps)  # scattered blocks
    q = torch.randn(num_seqs, H, D, generator=g)
    seq_lens, qsl = torch.full((num_seqs,), context), torch.arange(num_seqs + 1)
    kf, vf = torch.randn(nb, bs, Hkv, D, generator=g), torch.randn(nb, bs, Hkv, D, generator=g)
    calls = {}
    for name in dict.fromkeys(["float32", *dtypes]):
        if name in ("float32", "bfloat16"):
            dt = torch.float32 if name == "float32" else torch.bfloat16
            kc, vc = kf.to(dt), vf.to(dt)
            calls[name] = lambda kc=kc, vc=vc: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125)
        elif name == "float16":
            kc, vc = kf.half(), vf.half()
            calls[name] = lambda kc=kc, vc=vc: kv_ops.paged_attention_kv(q, kc, vc, None, None, tables, seq_lens, qsl, 0.125)
        else:
            storage = torch.int8 if name == "int8" else torch.float8_e4m3fn
            (kc, ks), (vc, vs) = kv_ops.quantize(kf, storage), kv_ops.quantize(vf, storage)
            calls[name] = lambda kc=kc, vc=vc, ks=ks, vs=vs: kv_ops.paged_attention_kv(q, kc, vc, ks, vs, tables, seq_lens, qsl, 0.125)
    times: dict[str, list[float]] = {k: [] for k in calls}
    for f in calls.values():
        f()
    for _ in range(rounds):
        for name, f in calls.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    ms = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {
        "num_seqs": num_seqs, "context": context, "threads": torch.get_num_threads(), "rounds": rounds,
        "ms_per_call": ms, "speedup_vs_float32": {k: ms["float32"] / v for k, v in ms.items()},
        "cache_mib": {k: nb * bs * Hkv * _bytes_per_token_head(k, D) * 2 / 2**20 for k in ms},
    }  # fmt: skip


def _bytes_per_token_head(name: str, head_dim: int) -> int:
    from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype

    return resolve_kv_cache_dtype(name, torch.float32).bytes_per_token_head(head_dim)


# ------------------------------------------------------------------------------ engine parts
def use_kv_dtype(llm, kv_cache_dtype: str) -> None:
    """Give ``llm`` a fresh model runner (new KV pools of ``kv_cache_dtype``) around its model."""
    from pagedllm.executor.uniproc import UniProcExecutor
    from pagedllm.runner.model_runner import ModelRunner

    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    old, cfg = engine.runner, engine.config
    model, num_blocks = old.model, old.num_blocks
    engine.runner = engine.executor = None  # the engine steps through its executor: both go
    del old
    gc.collect()
    engine.runner = ModelRunner(model, num_blocks=num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                                max_model_len=engine.max_model_len, dtype=cfg.torch_dtype,
                                attention_backend=cfg.attention_backend, seed=cfg.seed, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    engine.executor = UniProcExecutor(engine.runner)
    llm.reset_prefix_cache()  # blocks cached under the old pools hold nothing in the new ones


def _agreement(mine: list[int], ref: list[int]) -> int:
    n = 0
    for a, b in zip(mine, ref):
        if a != b:
            break
        n += 1
    return n


def greedy_and_perplexity(llm, max_tokens: int) -> tuple[list[list[int]], float]:
    """The greedy tokens of every parity prompt (``max_tokens`` each, EOS ignored) and the
    perplexity of ``PERPLEXITY_TEXT`` (its prompt log-probabilities), from one engine."""
    from pagedllm import SamplingParams

    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": p} for p in parity_prompts(tok)]
    text_ids = tok.encode(PERPLEXITY_TEXT)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    ppl_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (ppl_out,) = llm.generate({"prompt_token_ids": text_ids}, ppl_params, use_tqdm=False)
    lps = [entry[t].logprob for t, entry in zip(text_ids[1:], ppl_out.prompt_logprobs[1:])]
    return [o.outputs[0].token_ids for o in outs], math.exp(-sum(lps) / len(lps))


def agreement_stats(tokens: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """Share of the reference's tokens matched before each prompt's first divergence."""
    agree = [_agreement(m, r) for m, r in zip(tokens, ref)]
    return {
        "agreement_pct": 100.0 * sum(agree) / sum(len(r) for r in ref),
        "prompts_identical": sum(a == len(r) for a, r in zip(agree, ref)),
        "first_divergence": agree,
    }


def bench_accuracy(llm, dtypes: list[str], max_tokens: int) -> dict[str, Any]:
    tokens: dict[str, list[list[int]]] = {}
    per: dict[str, Any] = {}
    for name in dict.fromkeys(["float32", *dtypes]):
        use_kv_dtype(llm, name)
        tokens[name], ppl = greedy_and_perplexity(llm, max_tokens)
        per[name] = {**agreement_stats(tokens[name], tokens["float32"]), "perplexity": ppl}
    for name, r in per.items():
        r["perplexity_delta_pct"] = 100.0 * (r["perplexity"] / per["float32"]["perplexity"] - 1)
    tok = llm.get_tokenizer()
    return {"num_prompts": len(tokens["float32"]), "max_tokens": max_tokens,
            "perplexity_text_tokens": len(tok.encode(PERPLEXITY_TEXT)), "per_dtype": per}  # fmt: skip


def bench_w1(llm, output_len: int, dtypes: tuple[str, ...] = ("float32", "int8")) -> dict[str, Any]:
    from pagedllm import SamplingParams
    from pagedllm.bench.workloads import WORKLOADS

    w = WORKLOADS["W1"]
    prompts = [{"prompt_token_ids": p} for p in w.prompts()]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    out: dict[str, Any] = {"num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": output_len}
    for name in dtypes:
        use_kv_dtype(llm, name)
        llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        out[name] = {"elapsed_s": elapsed, "output_tokens_per_s": w.num_prompts * output_len / elapsed}
    out["speedup"] = out[dtypes[1]]["output_tokens_per_s"] / out[dtypes[0]]["output_tokens_per_s"]
    return out


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict[str, Any]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    result: dict[str, Any] = {"cpu": cpu_name(), "threads": torch.get_num_threads()}
    print(f"CPU: {result['cpu']}, {result['threads']} threads")
    if "attention" in parts:
        result["attention"] = []
        default_threads = torch.get_num_threads()
        for n in [int(t) for t in args.attention_threads.split(",") if t.strip()] or [default_threads]:
            torch.set_num_threads(n)
            a = bench_attention(dtypes, args.num_seqs, args.context, args.rounds)
            torch.set_num_threads(default_threads)
            result["attention"].append(a)
            print(f"\ndecode attention, {a['num_seqs']} seqs x {a['context']} context (9 q heads, 3 KV heads, head_dim 64, "
                  f"block 16), {n} thread(s):")  # fmt: skip
            for k, ms in a["ms_per_call"].items():
                print(f"  {k:9s} {ms:7.3f} ms/call  {a['speedup_vs_float32'][k]:.2f}x vs float32  (cache {a['cache_mib'][k]:.1f} MiB)")
    if "accuracy" in parts or "w1" in parts:
        from pagedllm import LLM

        kwargs = {**engine_kwargs, "kv_cache_dtype": "auto", "log_stats_interval": 1e9}
        if kwargs.get("num_kv_blocks") is None:
            kwargs["num_kv_blocks"] = 2048  # W1's 64 x 384 tokens fit; the same pool for every dtype
        llm = LLM(**kwargs)
        if "accuracy" in parts:
            acc = bench_accuracy(llm, dtypes, args.max_tokens)
            result["accuracy"] = acc
            print(f"\naccuracy vs the float32 cache: {acc['num_prompts']} parity prompts x {acc['max_tokens']} greedy tokens; "
                  f"perplexity of a {acc['perplexity_text_tokens']}-token text:")  # fmt: skip
            for k, r in acc["per_dtype"].items():
                print(f"  {k:9s} agreement {r['agreement_pct']:5.1f}% ({r['prompts_identical']}/{acc['num_prompts']} identical)  "
                      f"perplexity {r['perplexity']:.4f} ({r['perplexity_delta_pct']:+.3f}%)")  # fmt: skip
        if "w1" in parts:
            w = bench_w1(llm, args.w1_output_len)
            result["w1"] = w
            print(f"\nW1 prompts ({w['num_prompts']} x {w['input_len']}), {w['output_len']} new tokens each:")
            for k in ("float32", "int8"):
                print(f"  {k:9s} {w[k]['output_tokens_per_s']:.1f} output tok/s ({w[k]['elapsed_s']:.1f} s)")
            print(f"  int8 / float32: {w['speedup']:.2f}x")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result
