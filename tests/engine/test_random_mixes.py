"""Random mixes of every scheduling and sampling feature in one offline engine, held to what must
hold whatever the mix: each request ends once (aborted iff aborted), a greedy or seeded request
gets what it gets alone in a plain engine, guided text obeys its grammar, deltas add up to the
output, and nothing is left behind. A stress run of ~1,300 such mixes found an aborted best_of
request that ended as completed; the seeds here are chosen so that, together, they reach every
feature the module's last test checks was exercised."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import jsonschema
import pytest
import torch

from pagedllm import LoRARequest, SamplingParams, StructuredOutputsParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.outputs import CompletionOutput, RequestOutput
from tests.lora.adapters import make_peft_adapter

SEEDS = [1, 11, 12, 13, 17, 20, 38, 39]
HARD_SEEDS = [109, 116, 117, 119]
# Per seed, what its mix exercised; the last test sums them.
EXERCISED: dict[tuple[int, bool], Counter] = {}

TEXTS = [
    "one two three four five one two three four five one two three",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Hello, my name is",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "A B C D A B C D A B",
    "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
]
SHARED_PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely, with no extra words at all. ",
    "System: the following is a conversation log between two robots about the weather. ",
]
CHOICES = ["positive", "negative", "neutral", 'it "depends"']
REGEXES = [r"\d{4}-\d{2}-\d{2}", r"(yes|no|maybe)( indeed)?", r"[a-z]{1,6}@[a-z]{1,5}\.com"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
EOS = 2


@dataclass(frozen=True)
class Spec:
    """One request of a mix; ``kind`` is greedy, seeded (both compared with a run alone) or random."""

    rid: str
    prompt: str | dict
    params: dict
    kind: str
    priority: int
    lora: LoRARequest | None
    output_kind: RequestOutputKind

    def sampling_params(self) -> SamplingParams:
        kw = dict(self.params)
        if "structured_outputs" in kw:
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        return SamplingParams(**kw)


@pytest.fixture(scope="module")
def loras(tiny_llama_tok, tmp_path_factory) -> list[LoRARequest]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_tok), dtype=torch.float32).eval()
    d = tmp_path_factory.mktemp("mix-adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a = make_peft_adapter(hf, d / "a", 4, ["q_proj", "v_proj"], seed=1, b_std=0.3)
    b = make_peft_adapter(hf, d / "b", 8, every, seed=2, b_std=0.3)
    return [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]


class Reference:
    """Plain engines (ample pool, no prefix caching, chunking, preemption or speculation) that
    run one request alone: the expensive half of the module, so engines and results are kept."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.engines: dict[tuple, LLMEngine] = {}
        self.results: dict[str, RequestOutput] = {}

    def run(self, spec: Spec, block_size: int, max_model_len: int) -> RequestOutput:
        key = repr((block_size, max_model_len, spec.lora, spec.prompt, spec.params))
        if key not in self.results:
            engine = self._engine(block_size, max_model_len, spec.lora is not None)
            params = spec.sampling_params()
            engine.add_request(spec.prompt, params, request_id="alone", lora_request=spec.lora)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        self.results[key] = out
        return self.results[key]

    def _engine(self, block_size: int, max_model_len: int, lora: bool) -> LLMEngine:
        key = (block_size, max_model_len, lora)
        if key not in self.engines:
            config = EngineConfig(model=str(self.model), dtype="float32", block_size=block_size,
                                  max_model_len=max_model_len, num_kv_blocks=2048 // block_size,
                                  max_num_batched_tokens=2048, enable_lora=lora, max_loras=2,
                                  max_lora_rank=8)  # fmt: skip
            self.engines[key] = LLMEngine(config, log_stats_interval=1e9)
        return self.engines[key]


@pytest.fixture(scope="module")
def reference(tiny_llama_tok):
    ref = Reference(tiny_llama_tok)
    yield ref
    for engine in ref.engines.values():
        engine.close()


def random_config(rng: random.Random, model: Path, hard: bool) -> dict:
    """A small engine: the pool holds one longest request and little more, so mixes preempt."""
    max_model_len = rng.choice([48, 64, 100, 160])
    block_size = rng.choice([2, 4, 8, 16])
    config = dict(model=str(model), dtype="float32", block_size=block_size, max_model_len=max_model_len,
                  max_num_seqs=rng.choice([1, 2, 3, 4, 8, 16]), enable_prefix_caching=rng.random() < 0.6,
                  scheduling_policy=rng.choice(["fcfs", "priority"]),
                  preemption_mode=rng.choice(["recompute", "swap"]), seed=rng.randint(0, 5))  # fmt: skip
    if config["preemption_mode"] == "swap":
        config["swap_space"] = rng.choice([0.00002, 0.0001, 0.001, 0.01])  # GiB: a few blocks to many
    fewest = max_model_len // block_size + 1
    spare = 0 if hard else rng.choice([0, 0, 1, 2, 8, 30])
    config["num_kv_blocks"] = fewest if hard else rng.randint(fewest, fewest + spare)
    if rng.random() < 0.6:
        config["max_num_batched_tokens"] = rng.choice([8, 16, 24, 32, 64])
        if rng.random() < 0.5:
            config["long_prefill_token_threshold"] = rng.choice([4, 8, 16])
    if hard or rng.random() < 0.5:
        config["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": rng.randint(1, 5),
            "prompt_lookup_min": 1 if hard else rng.choice([1, 2]),
            "prompt_lookup_max": rng.choice([2, 3, 4]),
            "auto_length": not hard and rng.random() < 0.5,
            "disable_by_batch_size": 64 if hard else rng.choice([2, 8, 64]),
        }
    if rng.random() < 0.3:
        config.update(enable_lora=True, max_loras=rng.choice([1, 2]), max_lora_rank=8)
    return config


def random_prompt(rng: random.Random) -> str | dict:
    if rng.random() < 0.1:  # token ids, BOS and EOS among them
        ids = [rng.choice([1, EOS, rng.randint(3, 49151)]) for _ in range(rng.randint(1, 40))]
        return {"prompt_token_ids": ids}
    text = rng.choice(TEXTS)
    if rng.random() < 0.5:
        text = rng.choice(SHARED_PREFIXES) + text
    if rng.random() < 0.3:
        text += f" ({rng.randint(0, 99)})"
    return text * rng.randint(2, 3) if rng.random() < 0.15 else text


def random_params(rng: random.Random, tokenizer, hard: bool) -> tuple[dict, str]:
    """Sampling params as keyword arguments, and the request's kind. Hard mixes narrow the
    vocabulary (allowed tokens, strong biases) so that ngram drafts get accepted."""
    kind = rng.choices(["greedy", "seeded", "random"], [5, 4, 1])[0]
    kw: dict = {"temperature": 0.0} if kind == "greedy" else {"temperature": rng.choice([0.5, 0.8, 1.0, 1.3])}
    if kind != "greedy":
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([3, 20, 0])
        if rng.random() < 0.3:
            kw["top_p"] = rng.choice([0.9, 0.5])
        if rng.random() < 0.2:
            kw["min_p"] = 0.05
        if kind == "seeded":
            kw["seed"] = rng.randint(0, 10**6)
    kw["max_tokens"] = rng.choice([1, 2, 3, 5, 8, 16, 24, 40, 60, None])
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"] or 30)
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.35:
        kw["logprobs"] = rng.choice([0, 1, 3, 20])
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.choice([0, 2, 5])
    if rng.random() < 0.25:
        kw["stop"] = rng.sample([" the", "e", ".", "ing", "\n", " a", "th"], rng.randint(1, 2))
        kw["include_stop_str_in_output"] = rng.random() < 0.3
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randint(3, 49151) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randint(3, 49151): rng.choice([-100.0, 5.0, 20.0, 100.0]) for _ in range(3)}
    if rng.random() < 0.05:
        kw["allowed_token_ids"] = rng.sample(range(3, 2000), rng.randint(1, 30)) + [EOS]
    if rng.random() < 0.1:
        kw["bad_words"] = rng.sample([" the", "cat", " two", "ing", " a"], 2)
    if rng.random() < 0.1:
        kw["presence_penalty"] = 0.5
    if rng.random() < 0.05:
        kw["repetition_penalty"] = 1.2
    if rng.random() < 0.15:
        guide = rng.choice(["choice", "regex", "json"])
        kw["structured_outputs"] = {
            "choice": dict(choice=CHOICES),
            "regex": dict(regex=rng.choice(REGEXES)),
            "json": dict(json=SCHEMA, disable_any_whitespace=True),
        }[guide]
        kw["max_tokens"] = rng.choice([30, 60])
        kw.pop("min_tokens", None)
        kw.pop("bad_words", None)
    elif hard and rng.random() < 0.4:
        tokens = rng.sample(range(100, 40000), rng.randint(2, 4))
        kw["allowed_token_ids"] = tokens + ([EOS] if rng.random() < 0.3 else [])
        kw.pop("logit_bias", None)
        kw.pop("bad_words", None)
        if rng.random() < 0.5:  # stop strings the narrowed vocabulary can spell, across tokens
            a, b = rng.choice(tokens), rng.choice(tokens)
            if rng.random() < 0.5:
                stop = [tokenizer.decode([a, b]), tokenizer.decode([b])[1:]]
            else:
                stop = [tokenizer.decode([a, b, a])]
            kw["stop"] = [s for s in stop if s]
            kw["include_stop_str_in_output"] = rng.random() < 0.3
    elif hard and rng.random() < 0.5:
        tokens = rng.sample(range(100, 40000), rng.randint(2, 4))
        kw["logit_bias"] = {t: rng.choice([6.0, 10.0, 15.0, 30.0]) for t in tokens}
    if rng.random() < 0.07:
        width = rng.randint(2, 3)
        beam = dict(use_beam_search=True, temperature=0.0, best_of=width, n=rng.randint(1, width),
                    max_tokens=rng.choice([3, 8, 16]), ignore_eos=rng.random() < 0.5,
                    length_penalty=rng.choice([1.0, 0.5, 2.0]),
                    early_stopping=rng.choice([False, True, "never"]))  # fmt: skip
        return beam, "greedy"
    if kind != "random" and rng.random() < 0.2:
        kw["n"] = rng.randint(2, 3)
        if kind == "seeded" and rng.random() < 0.5:
            kw["best_of"] = kw["n"] + rng.randint(0, 2)
    return kw, kind


def obeys(guide: dict, text: str) -> bool:
    if "choice" in guide:
        return text in guide["choice"]
    if "regex" in guide:
        return re.fullmatch(guide["regex"], text) is not None
    try:
        jsonschema.validate(json.loads(text), guide["json"])
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def logprobs_record(positions: list | None) -> list | None:
    if positions is None:
        return None
    return [None if pos is None else sorted((t, lp.logprob) for t, lp in pos.items()) for pos in positions]


def completion_record(c: CompletionOutput) -> tuple:
    logprobs = logprobs_record(c.logprobs)
    return list(c.token_ids), logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason, c.text


@dataclass
class Stream:
    """A request's outputs as a caller sees them: each sample's latest completion, with the
    deltas summed into it; cumulative outputs are checked to only grow."""

    kind: RequestOutputKind
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    finals: list[RequestOutput] = field(default_factory=list)

    def take(self, out: RequestOutput) -> list[str]:
        """Fold ``out`` in; a final output becomes the whole request's. Returns problems."""
        problems = [f"{out.request_id}: an output after its final one"] if self.finals else []
        delta = self.kind is RequestOutputKind.DELTA
        if out.prompt_logprobs is not None and delta:
            if self.prompt_logprobs is not None:
                problems.append(f"{out.request_id}: prompt logprobs sent twice as deltas")
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            seen = self.completions.get(c.index)
            if seen is not None and seen.finish_reason is not None and delta:
                problems.append(f"{out.request_id}[{c.index}]: a delta after the sample finished")
            if delta and seen is not None:
                logprobs = seen.logprobs if c.logprobs is None else (seen.logprobs or []) + c.logprobs
                c = replace(c, token_ids=seen.token_ids + c.token_ids, text=seen.text + c.text,
                            logprobs=logprobs)  # fmt: skip
            elif seen is not None and c.token_ids[: len(seen.token_ids)] != seen.token_ids:
                problems.append(f"{out.request_id}[{c.index}]: cumulative tokens rewritten")
            self.completions[c.index] = c
        if out.finished:
            if delta:  # the samples that ended earlier sent their last delta before this one
                out = replace(out, outputs=[self.completions[i] for i in sorted(self.completions)],
                              prompt_logprobs=self.prompt_logprobs)  # fmt: skip
            self.finals.append(out)
        return problems


class Mix:
    """Drives one engine through a workload: adds requests (some between steps), aborts some,
    and records every output."""

    def __init__(self, engine: LLMEngine, rng: random.Random, specs: list[Spec]) -> None:
        self.engine, self.rng = engine, rng
        self.pending = list(specs)
        self.added: dict[str, Spec] = {}
        self.streams: dict[str, Stream] = {}
        self.aborted: set[str] = set()
        self.aborted_live: set[str] = set()  # picked among running requests, not added to be aborted
        self.problems: list[str] = []

    def add(self) -> Spec | None:
        spec = self.pending.pop(0)
        try:
            self.engine.add_request(spec.prompt, spec.sampling_params(), request_id=spec.rid,
                                    output_kind=spec.output_kind, priority=spec.priority,
                                    lora_request=spec.lora)  # fmt: skip
        except ValueError:  # refused up front (best_of beyond max_num_seqs, a prompt too long...)
            return None
        self.added[spec.rid] = spec
        self.streams[spec.rid] = Stream(spec.output_kind)
        return spec

    def abort(self, rid: str) -> None:
        self.aborted.add(rid)
        self.collect(self.engine.abort_request(rid))

    def collect(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.problems += self.streams[out.request_id].take(out)

    def run(self, add_all: bool) -> None:
        for _ in range(len(self.pending) if add_all else self.rng.randint(1, len(self.pending))):
            self.add()
        steps = 0
        while self.engine.has_unfinished_requests() or self.pending:
            if self.pending and self.rng.random() < 0.3:
                self.add()
            live = [rid for rid, s in self.streams.items() if not s.finals and rid not in self.aborted]
            if live and self.rng.random() < 0.06:
                victim = self.rng.choice(live)
                self.abort(victim)
                self.aborted_live.add(victim)
            if self.rng.random() < 0.03:  # an ended or unknown request: nothing to abort
                ended = [rid for rid, s in self.streams.items() if s.finals]
                if self.engine.abort_request(self.rng.choice([*ended, "unknown"])):
                    self.problems.append("aborting an ended request returned outputs")
            if self.rng.random() < 0.03:
                self.engine.reset_prefix_cache()
            if self.pending and self.rng.random() < 0.05:  # added and aborted before any step
                spec = self.add()
                if spec is not None:
                    self.abort(spec.rid)
            self.collect(self.engine.step())
            steps += 1
            assert steps < 5000, "the engine did not finish"


def check_final(spec: Spec, out: RequestOutput, aborted: bool, max_model_len: int) -> list[str]:
    """What holds for any request's final output, deterministic or not."""
    problems = []
    sp = spec.sampling_params()
    reasons = [c.finish_reason for c in out.outputs]
    if aborted:
        # best_of's picks are chosen among unfinished samples: none may read as completed.
        if "abort" not in reasons or any(r in ("error", None) for r in reasons):
            problems.append(f"{spec.rid}: aborted, yet it ended with {reasons}")
        if "best_of" in spec.params and set(reasons) != {"abort"}:
            problems.append(f"{spec.rid}: an aborted best_of request's picks ended with {reasons}")
        return problems
    if any(r in ("abort", "error", None) for r in reasons) or len(out.outputs) != sp.n:
        return [f"{spec.rid}: ended with {reasons}, n={sp.n} ({out.error})"]
    for c in out.outputs:
        count, at_limit = len(c.token_ids), len(out.prompt_token_ids) + len(c.token_ids) >= max_model_len
        if sp.max_tokens is not None and count > sp.max_tokens:
            problems.append(f"{spec.rid}: {count} tokens, more than max_tokens {sp.max_tokens}")
        if c.finish_reason == "length" and count != sp.max_tokens and not at_limit:
            problems.append(f"{spec.rid}: a length finish after {count} tokens")
        if count < sp.min_tokens and not at_limit:
            problems.append(f"{spec.rid}: {count} tokens, fewer than min_tokens {sp.min_tokens}")
        stop = c.stop_reason
        if isinstance(stop, str) and sp.include_stop_str_in_output and not c.text.endswith(stop):
            problems.append(f"{spec.rid}: text {c.text!r} does not end with its stop string {stop!r}")
        if sp.stop and not sp.include_stop_str_in_output and sp.min_tokens == 0:
            problems += [f"{spec.rid}: stop string {s!r} in {c.text!r}" for s in sp.stop if s in c.text]
        # Beam search reports an EOS as the stop reason and leaves it out of the tokens.
        if isinstance(stop, int) and not sp.use_beam_search and c.token_ids[-1:] != [stop]:
            problems.append(f"{spec.rid}: stop_reason {stop} but last token {c.token_ids[-1:]}")
        if sp.logprobs is not None and (c.logprobs is None or len(c.logprobs) != count):
            problems.append(f"{spec.rid}: {c.logprobs and len(c.logprobs)} logprobs for {count} tokens")
        guide = spec.params.get("structured_outputs")
        if guide is not None and c.finish_reason == "stop" and stop is None:
            # A token-id prompt may end inside a UTF-8 character: the text then starts with U+FFFD.
            text = c.text.lstrip("\ufffd") if isinstance(spec.prompt, dict) else c.text
            if not obeys(guide, text):
                problems.append(f"{spec.rid}: guided output {c.text!r} breaks {guide}")
    return problems


def run_mix(seed: int, hard: bool, model: Path, loras: list[LoRARequest],
            reference: Reference) -> tuple[list[str], Counter]:  # fmt: skip
    """Run seed's mix; returns the problems found and what the mix exercised."""
    rng = random.Random(seed)
    config = random_config(rng, model, hard)
    engine = LLMEngine(EngineConfig(**config), log_stats_interval=1e9)
    tokenizer = engine.get_tokenizer()
    specs = []
    for i in range(rng.randint(4, 24)):
        params, kind = random_params(rng, tokenizer, hard)
        lora = rng.choice([None, *loras]) if config.get("enable_lora") else None
        priority = rng.randint(-3, 3) if config["scheduling_policy"] == "priority" else 0
        output_kind = rng.choice(list(RequestOutputKind))
        specs.append(Spec(f"r{i}", random_prompt(rng), params, kind, priority, lora, output_kind))
    mix = Mix(engine, rng, specs)
    try:
        mix.run(add_all=hard)
        kv, scheduler = engine.kv_cache_manager, engine.scheduler
        recompute = config["preemption_mode"] == "recompute"
        exercised = Counter(
            preempted_by_recompute=recompute and engine.num_preemptions_total > 0,
            swapped=kv.num_swap_outs > 0,
            accepted_drafts=engine.stats.spec_total.num_accepted_tokens > 0,
        )
        problems = mix.problems
        problems += [f"{rid}: ended {len(s.finals)} times" for rid, s in mix.streams.items()
                     if len(s.finals) != 1]  # fmt: skip
        kv.check_integrity()
        if kv.num_free_blocks != kv.num_blocks or engine.has_unfinished_requests():
            problems.append(f"left behind: {kv.num_free_blocks}/{kv.num_blocks} blocks free")
        if scheduler.running or scheduler.waiting or scheduler.requests:
            problems.append(f"the scheduler still holds {list(scheduler.requests)}")
        swap = kv.swap_pool
        if swap is not None and swap.num_free_blocks != swap.num_blocks:
            problems.append(f"swap pool: {swap.num_free_blocks}/{swap.num_blocks} blocks free")
    finally:
        engine.close()
    for rid, spec in mix.added.items():
        if len(mix.streams[rid].finals) != 1:
            continue
        out = mix.streams[rid].finals[0]
        problems += check_final(spec, out, rid in mix.aborted, config["max_model_len"])
        exercised["best_of_aborted"] += "best_of" in spec.params and rid in mix.aborted_live
        if rid in mix.aborted or spec.kind == "random":
            continue
        alone = reference.run(spec, config["block_size"], config["max_model_len"])
        got, want = [completion_record(c) for c in out.outputs], [completion_record(c) for c in alone.outputs]
        if got != want or logprobs_record(out.prompt_logprobs) != logprobs_record(alone.prompt_logprobs):
            problems.append(f"{rid} differs from its run alone:\n  mix   {got}\n  alone {want}\n  {spec}")
        exercised["compared"] += 1
        exercised["prefix_cache_hit"] += out.num_cached_tokens > 0
        exercised["preempted_compared"] += out.num_preemptions > 0
        exercised["guided"] += "structured_outputs" in spec.params
        exercised["lora"] += spec.lora is not None
        exercised["beam"] += bool(spec.params.get("use_beam_search"))
        exercised["delta"] += spec.output_kind is RequestOutputKind.DELTA
    return problems, exercised


@pytest.mark.parametrize("seed, hard", [(s, False) for s in SEEDS] + [(s, True) for s in HARD_SEEDS])
def test_a_random_mix_keeps_every_invariant(seed, hard, tiny_llama_tok, loras, reference):
    """Hard mixes: ngram speculation on, the smallest pool, every request added at once."""
    problems, exercised = run_mix(seed, hard, tiny_llama_tok, loras, reference)
    EXERCISED[seed, hard] = exercised
    assert not problems, "\n".join(problems)


def test_the_seeds_exercise_every_feature():
    """The seeds were chosen for what their mixes reach: a change to the engine or to the mixes
    that stops them reaching a feature must show here, not as a quietly narrower test."""
    if len(EXERCISED) < len(SEEDS) + len(HARD_SEEDS):
        pytest.skip("counts only after every seed's mix has run (the whole module)")
    total = sum(EXERCISED.values(), Counter())
    wanted = ["preempted_by_recompute", "swapped", "preempted_compared", "prefix_cache_hit",
              "accepted_drafts", "guided", "lora", "beam", "best_of_aborted", "delta"]  # fmt: skip
    assert [w for w in wanted if total[w] == 0] == [], total
