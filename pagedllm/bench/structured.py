"""Structured outputs: does every output fit, and what does constraining cost?

``pagedllm bench structured --mode validity``: for a JSON schema (nested objects, arrays,
enums, required fields, number bounds), two regexes (ISO date, e-mail), a choice and an EBNF
grammar (arithmetic), N chat requests each, greedy and at temperature 0.8, with the
constraint and without it; then n=3 samples and a KV pool small enough to force preemption.
Each output is checked by an independent validator (jsonschema, ``re.fullmatch``, a
recursive-descent recogniser written here).

``pagedllm bench structured --mode overhead``: 64 sequences under a JSON schema against 64
free ones, same lengths (every sequence decodes exactly ``--output-len`` tokens), in one
process; reports the time per step and the share spent filling bitmasks and advancing
matchers.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from pagedllm.entrypoints.arg_types import comma_list, positive_int, result_path

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
DATE_REGEX = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL_REGEX = r"[a-z]{1,12}\.?[a-z]{0,8}@[a-z]{2,10}\.(com|org|net)"
SENTIMENTS = ["positive", "negative", "neutral"]
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]? | "0"
"""
_REVIEWS = ["the food was cold", "I loved every minute", "it was fine, nothing special", "worst service ever",
            "the staff were friendly", "average at best", "I will come back", "never again", "it arrived on time",
            "the screen broke after a day"]  # fmt: skip


def valid_json(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def valid_arith(text: str) -> bool:
    """A recursive-descent recogniser of ARITH_EBNF's language, apart from any grammar engine."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def num() -> bool:
        nonlocal pos
        if peek() == "0":
            pos += 1
            return True
        if peek() and peek() in "123456789":
            pos += 1
            if peek() and peek().isdigit():
                pos += 1
            return True
        return False

    def factor() -> bool:
        nonlocal pos
        if peek() == "(":
            pos += 1
            if not expr() or peek() != ")":
                return False
            pos += 1
            return True
        return num()

    def chain(operand: Callable[[], bool], ops: str) -> bool:
        nonlocal pos
        if not operand():
            return False
        while peek() and peek() in ops:
            pos += 1
            if not operand():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


@dataclass
class Task:
    name: str
    constraint: dict[str, Any]  # StructuredOutputsParams fields
    prompt: Callable[[int], str]
    check: Callable[[str], bool]
    max_tokens: int


TASKS = [
    Task("json_schema", {"json": PERSON_SCHEMA},
         lambda i: f"Describe fictional person number {i} as a JSON object with name, age, score, role, tags and address.",
         lambda t: valid_json(t, PERSON_SCHEMA), 256),
    Task("regex_date", {"regex": DATE_REGEX},
         lambda i: f"On what date did historical event number {i} happen? Answer with the date only, as YYYY-MM-DD.",
         lambda t: re.fullmatch(DATE_REGEX, t) is not None, 24),
    Task("regex_email", {"regex": EMAIL_REGEX},
         lambda i: f"Write an e-mail address for user number {i} of our shop.",
         lambda t: re.fullmatch(EMAIL_REGEX, t) is not None, 48),
    Task("choice", {"choice": SENTIMENTS},
         lambda i: f"Is this review positive, negative or neutral? Review: '{_REVIEWS[i % len(_REVIEWS)]}' (#{i})",
         lambda t: t in SENTIMENTS, 16),
    Task("ebnf_arithmetic", {"grammar": ARITH_EBNF},
         lambda i: f"Write an arithmetic expression whose value is {i}.",
         valid_arith, 64),
]  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["validity", "overhead"], default="validity")
    p.add_argument("--num-requests", type=positive_int, default=50, help="validity: requests per task and temperature")
    p.add_argument("--tasks", type=comma_list(*(t.name for t in TASKS)), default=",".join(t.name for t in TASKS), help="validity: comma-separated task names")
    p.add_argument("--output-len", type=positive_int, default=128, help="overhead: tokens per sequence")
    p.add_argument("--num-seqs", type=positive_int, default=64, help="overhead: sequences per run")
    p.add_argument("--save-result", type=result_path, default=None, help="write the result as JSON to this file")


def _chat_prompts(llm: Any, texts: list[str]) -> list[dict]:
    from pagedllm.engine.chat import render_chat

    return [{"prompt_token_ids": render_chat(llm.get_tokenizer(), [{"role": "user", "content": t}])} for t in texts]


def _count(outs: list[Any], check: Callable[[str], bool]) -> tuple[int, int, list[str]]:
    texts = [c.text for o in outs for c in o.outputs]
    bad = [t for t in texts if not check(t)]
    return len(texts) - len(bad), len(texts), bad[:3]


def run_validity(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(**engine_kwargs)
    wanted = args.tasks.split(",")
    rows = []
    for task in [t for t in TASKS if t.name in wanted]:
        prompts = _chat_prompts(llm, [task.prompt(i) for i in range(args.num_requests)])
        for temperature in (0.0, 0.8):
            for constrained in (True, False):
                so = StructuredOutputsParams(**task.constraint) if constrained else None
                params = SamplingParams(temperature=temperature, seed=0, max_tokens=task.max_tokens, structured_outputs=so)
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                ok, total, bad = _count(outs, task.check)
                rows.append({"task": task.name, "temperature": temperature, "constrained": constrained, "valid": ok,
                             "total": total, "seconds": time.perf_counter() - start, "invalid_examples": bad})  # fmt: skip
                print(f"{task.name:16s} T={temperature:.1f} {'constrained' if constrained else 'free':11s} "
                      f"{ok:3d}/{total} valid ({rows[-1]['seconds']:.1f} s)", flush=True)  # fmt: skip
    # n = 3 samples each, and a KV pool small enough that requests preempt each other.
    task = TASKS[0]
    prompts = _chat_prompts(llm, [task.prompt(i) for i in range(args.num_requests)])
    so = StructuredOutputsParams(**task.constraint)
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=task.max_tokens, structured_outputs=so),
                        use_tqdm=False)  # fmt: skip
    ok, total, bad = _count(outs, task.check)
    rows.append({"task": "json_schema n=3", "temperature": 0.8, "constrained": True, "valid": ok, "total": total, "invalid_examples": bad})
    print(f"{'json_schema n=3':16s} T=0.8 constrained {ok:3d}/{total} valid", flush=True)
    del llm
    small = LLM(**{**engine_kwargs, "num_kv_blocks": 40, "max_num_seqs": 16})
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=task.max_tokens, structured_outputs=so), use_tqdm=False)
    ok, total, bad = _count(outs, task.check)
    preemptions = small.llm_engine.num_preemptions_total
    rows.append({"task": "json_schema preempted", "temperature": 0.0, "constrained": True, "valid": ok, "total": total,
                 "num_preemptions": preemptions, "invalid_examples": bad})  # fmt: skip
    print(f"{'json_schema, 40 KV blocks':16s} T=0.0 constrained {ok:3d}/{total} valid ({preemptions} preemptions)", flush=True)
    return {"mode": "validity", "rows": rows}


def run_overhead(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams, StructuredOutputsParams

    n, length = args.num_seqs, args.output_len
    llm = LLM(**{**engine_kwargs, "max_num_seqs": max(n, engine_kwargs.get("max_num_seqs") or 0)})
    engine = llm.llm_engine
    # Long enough that no sequence's grammar ends before `length` tokens: all decode equally.
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": length, "maxItems": length}
    so = StructuredOutputsParams(json=schema)
    prompts = _chat_prompts(llm, [f"List {length} numbers as a JSON array (#{i})." for i in range(n)])
    timers = {"bitmask": 0.0, "accept": 0.0}

    def timed(name: str, fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] += time.perf_counter() - t0

        return wrapper

    engine.structured.bitmask = timed("bitmask", engine.structured.bitmask)
    engine.structured.accept = timed("accept", engine.structured.accept)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so), use_tqdm=False)  # compile, warm up
    result: dict[str, Any] = {"mode": "overhead", "num_seqs": n, "output_len": length}
    for name, params in (
        ("free", SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True)),
        ("json_schema", SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True, structured_outputs=so)),
        ("free_again", SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True)),
    ):
        timers.update(bitmask=0.0, accept=0.0)
        steps0 = engine.scheduler.num_steps
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = engine.scheduler.num_steps - steps0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == n * length, f"{name}: {tokens} tokens, expected {n * length}"
        if name == "json_schema":
            assert all(o.outputs[0].text.startswith("[") for o in outs)
        result[name] = {"seconds": elapsed, "steps": steps, "ms_per_step": 1000 * elapsed / steps,
                        "output_tokens_per_s": tokens / elapsed, "bitmask_s": timers["bitmask"], "accept_s": timers["accept"]}  # fmt: skip
        print(f"{name:12s} {elapsed:6.1f} s, {steps} steps, {result[name]['ms_per_step']:.1f} ms/step, "
              f"{tokens / elapsed:.0f} tok/s (bitmask fill {timers['bitmask']:.2f} s, matcher accept {timers['accept']:.2f} s)",
              flush=True)  # fmt: skip
    free = (result["free"]["ms_per_step"] + result["free_again"]["ms_per_step"]) / 2
    result["overhead_pct"] = 100 * (result["json_schema"]["ms_per_step"] / free - 1)
    print(f"constrained step time vs free (mean of the two free runs): {result['overhead_pct']:+.1f}%")
    return result


def run(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    result = run_validity(args, engine_kwargs) if args.mode == "validity" else run_overhead(args, engine_kwargs)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return result
