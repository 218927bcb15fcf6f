"""Run one peer engine (transformers or vLLM) on a workload, in a process of its own.

``bench throughput --compare`` starts this file with the peer's Python (vLLM lives in a venv of
its own, with its own torch), by path, so nothing of pagedllm is imported here: a fresh process
that only the peer has warmed. The job comes as JSON on stdin; the result is the last line of
stdout that starts with ``RESULT_MARK``, as JSON (vLLM logs to stdout at shutdown, after it).

    {"engine": "transformers" | "vllm", "model": dir, "gguf_file": name or null,
     "dtype": "float32", "prompts": [[token ids], ...], "output_len": 128}

Both are timed like pagedllm: model load and a warm-up excluded, then one batch of all prompts,
greedy, exactly ``output_len`` new tokens each, prefix caching off.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

RESULT_MARK = "PEER-RESULT "

def run_transformers(job: dict) -> dict:
    import torch
    import transformers

    kwargs = {"gguf_file": job["gguf_file"]} if job.get("gguf_file") else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"]), **kwargs)
    model.eval()
    ids = torch.tensor(job["prompts"])
    n = job["output_len"]

    def generate(batch: torch.Tensor, new: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0)  # fmt: skip

    generate(ids[:4], 4)
    start = time.perf_counter()
    out = generate(ids, n)
    elapsed = time.perf_counter() - start
    if out.shape[1] != ids.shape[1] + n:
        raise RuntimeError(f"transformers gave {out.shape[1] - ids.shape[1]} new tokens, not {n}")
    return {"engine": "transformers", "version": transformers.__version__, "elapsed_s": elapsed}


def run_vllm(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    n = job["output_len"]
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=len(job["prompts"][0]) + n + 16,
              enable_prefix_caching=False, max_num_seqs=len(prompts), seed=0)  # fmt: skip
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != n for o in outs):
        raise RuntimeError(f"vLLM did not give {n} new tokens for every prompt")
    return {"engine": "vllm", "version": vllm.__version__, "elapsed_s": elapsed}


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    result = {"transformers": run_transformers, "vllm": run_vllm}[job["engine"]](job)
    result["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print("\n" + RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
