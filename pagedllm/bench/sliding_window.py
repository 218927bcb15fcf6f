"""KV memory of one long generation with and without freeing the blocks behind sliding windows.

    python -m pagedllm.bench.sliding_window --model PATH.gguf [--prompt-len 200] [--output-len 1500]

Runs one greedy request (EOS ignored) twice in fresh engines: as served (sliding groups return
their blocks behind the window) and with that freeing switched off (every layer keeps every
block, as before KV-cache groups). Reports the peak pool blocks held (sampled after every
allocation), their bytes, decode tokens/s, and whether both runs produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def run(model: str, prompt_len: int, output_len: int, freeing: bool, **engine_kwargs) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, log_stats_interval=1e9, **engine_kwargs)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    vocab = engine.arch.vocab_size
    prompt = [(7919 * i + 13) % (vocab - 100) + 100 for i in range(prompt_len)]  # fixed, tokenizer-free
    llm.generate([{"prompt_token_ids": prompt[:8]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if not freeing:
        kv.remove_skipped_blocks = lambda *args, **kwargs: 0  # type: ignore[method-assign]
    peak = 0
    allocate = kv.allocate_slots

    def tracked(*args, **kwargs):
        nonlocal peak
        ok = allocate(*args, **kwargs)
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        return ok

    kv.allocate_slots = tracked  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    sizes_bytes = engine.runner.slot_caches[0][0][0].nbytes * 2 * len(engine.runner.slot_caches)  # one block
    return {
        "freeing": freeing,
        "groups": kv.num_groups,
        "layers_per_block": len(engine.runner.slot_caches),
        "peak_blocks": peak,
        "block_bytes": sizes_bytes,
        "peak_kv_bytes": peak * sizes_bytes,
        "blocks_freed_behind_window": kv.num_skipped_total,
        "tokens_per_s": output_len / elapsed,
        "tokens": out.outputs[0].token_ids,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=1500)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args()
    kwargs = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.output_len + 16,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)  # fmt: skip
    results = [run(args.model, args.prompt_len, args.output_len, freeing, **kwargs) for freeing in (True, False)]
    same = results[0].pop("tokens") == results[1].pop("tokens")
    print(json.dumps({"cpu": cpu_name(), "prompt_len": args.prompt_len, "output_len": args.output_len,
                      "same_tokens": same, "runs": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
