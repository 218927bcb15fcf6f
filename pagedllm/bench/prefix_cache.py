"""Prefix-cache benchmark: ``pagedllm bench prefix-cache``.

A ~2,000-token shared system prompt and two different questions, one after the other: the
second request finds the system prompt's blocks in the cache, so its time to first token
is mostly the question. Prints both TTFTs, their ratio and the second prompt's cache hit rate.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.bench.common import report
from pagedllm.entrypoints.arg_types import positive_int, result_path

_FACT = (
    "Policy {i}: support agents answer politely, cite the knowledge base article number, never promise "
    "refunds without a ticket, and escalate outages to the on-call engineer within ten minutes."
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system-tokens", type=positive_int, default=2000, help="approximate length of the shared prompt")
    p.add_argument("--save-result", type=result_path, default=None, help="write the result as JSON to this file")


def _ttft(engine, prompt_ids: list[int], request_id: str) -> float:
    from pagedllm import SamplingParams
    from pagedllm.engine.output_processor import RequestOutputKind

    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=1), request_id, RequestOutputKind.DELTA)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and any(c.token_ids for c in out.outputs):
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM

    llm = LLM(**engine_kwargs)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    system, i = "", 0
    while len(tok.encode(system)) < args.system_tokens:
        system += _FACT.format(i=i) + " "
        i += 1

    def chat(question: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)

    _ttft(engine, tok.encode("warm up")[:4], "warmup")
    q1, q2 = chat("How fast must outages be escalated?"), chat("Can I promise a refund?")
    first = _ttft(engine, q1, "first")
    stats = engine.stats
    hits, queries = stats.prefix_hits_total, stats.prefix_queries_total
    second = _ttft(engine, q2, "second")
    hits, queries = stats.prefix_hits_total - hits, stats.prefix_queries_total - queries  # the second request's own
    result = {
        "prompt_tokens": [len(q1), len(q2)],
        "ttft_first_s": first,
        "ttft_second_s": second,
        "ratio": first / second,
        "prefix_cache_hit_rate": hits / max(1, queries),  # of the second request's prompt
    }
    line = (
        f"TTFT first {first * 1000:.1f} ms, second {second * 1000:.1f} ms: {result['ratio']:.1f}x faster; "
        f"the second prompt's prefix cache hits: {hits} of {queries} tokens ({100 * result['prefix_cache_hit_rate']:.1f}%)"
    )
    return report(result, line, args.save_result)
