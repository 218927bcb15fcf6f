"""Self-distillation data for drafting heads: instructions, the target's greedy answers, and the
target's own features and greedy choices at every position.

No dataset download. Instructions come from two sources:
- templated ones (a task and a subject, a few hundred combinations);
- instructions the target writes itself: sampling from the chat template's opening of a user
  turn makes an instruct model write a user's message (the "Magpie" observation), which gives
  far more varied requests than any template.

The target answers them greedily, in batches (optionally in an int8 fast mode, twice as fast:
docs/quantization.md). A batched exact forward over each prompt + answer then records, at every
position, the target's final hidden state (what EAGLE reads) and its argmax next token: the
token greedy verification compares drafts with. Labels come from that exact pass, so a fast-mode
answer that strays from exact greedy decoding still teaches the exact target's choices.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pagedllm.attention.backend import paged_metadata
from pagedllm.attention.kv_cache_dtype import allocate_pool
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.train")

DATA_VERSION = 2  # bump when what is generated for the same arguments changes

# Instructions made of a task and a subject (none is one of the benchmark's chat prompts).
TASKS = [
    "Explain {} to a ten-year-old.", "Write a short story about {}.", "List five facts about {}.",
    "What are the pros and cons of {}?", "Write a haiku about {}.", "Give three tips related to {}.",
    "Describe the history of {} in a paragraph.", "Write an email to a friend about {}.",
    "What questions should I ask an expert on {}?", "Compare {} with something similar and explain the difference.",
    "Write a Python function related to {} and explain it.", "Summarize what people should know about {}.",
]  # fmt: skip
SUBJECTS = [
    "photosynthesis", "the ocean", "volcanoes", "a lost cat", "learning to cook", "electric cars", "the stock market",
    "black holes", "gardening", "the Roman Empire", "coffee", "sleep", "recycling", "bicycles", "friendship",
    "machine learning", "the weather", "chess", "rainforests", "a rainy day in Paris", "public speaking", "bees",
    "sorting algorithms", "the human heart", "music theory", "time management", "dinosaurs", "the moon landing",
    "saving money", "dogs", "the internet", "mountains", "a robot who wants to paint", "healthy breakfasts",
    "earthquakes", "the French language", "trains", "a birthday party", "solar energy", "libraries",
]  # fmt: skip

# Sampling the target's own user messages: varied, but mostly on topic.
SELF_PROMPT_PARAMS = dict(temperature=0.8, top_p=0.95, max_tokens=96)
MIN_SELF_PROMPT_TOKENS = 4


@dataclass
class DistillData:
    sequences: list[tuple[list[int], int]]  # (prompt + answer token ids, prompt length)
    features: list[torch.Tensor]  # [len, hidden] bf16: the target's final hidden state at each position
    greedy: list[torch.Tensor]  # [len] int64: the target's argmax next token after each position

    @property
    def num_positions(self) -> int:
        return sum(len(ids) for ids, _ in self.sequences)


def templated_instructions(n: int, seed: int) -> list[str]:
    pairs = [t.format(s) for t, s in itertools.product(TASKS, SUBJECTS)]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def _user_turn_opening(tok) -> list[int]:
    """The chat template's tokens up to where a user's message starts."""
    marker = "\x00PAGEDLLM_USER\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=False)
    if marker not in text:
        raise ValueError("the model's chat template does not show the user's message: cannot write instructions with it")
    return tok.encode(text[: text.index(marker)], add_special_tokens=False)


def self_written_instructions(llm: LLM, n: int, seed: int) -> list[str]:
    """Up to ``n`` distinct user messages the target writes itself (those it ended on its own)."""
    if n <= 0:
        return []
    opening = _user_turn_opening(llm.get_tokenizer())
    params = [SamplingParams(seed=seed * 1_000_003 + i, **SELF_PROMPT_PARAMS) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": opening}] * n, params)
    found: dict[str, None] = {}
    for o in outs:
        c = o.outputs[0]
        text = c.text.strip()
        if c.finish_reason == "stop" and len(c.token_ids) >= MIN_SELF_PROMPT_TOKENS and text:
            found.setdefault(text)
    return list(found)


def answers(llm: LLM, instructions: list[str], max_tokens: int) -> list[tuple[list[int], int]]:
    """(chat prompt + greedy answer token ids, prompt length) per instruction."""
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for p in instructions]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    return [(list(p) + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outs)]


def generate_sequences(model: str | None, source: Path, args, cache: Path) -> list[tuple[list[int], int]]:
    """The training sequences for these arguments: from the cache directory when an earlier run
    made them (training another head on the same data costs no generation), else generated
    with a model loaded for it in ``args.generation_activation_dtype``."""
    stat = source.stat()
    key = hashlib.sha256(json.dumps([
        DATA_VERSION, str(source.resolve()), stat.st_size, stat.st_mtime_ns, args.num_prompts, args.num_self_prompts,
        args.max_tokens, args.seed, args.generation_activation_dtype, TASKS, SUBJECTS, SELF_PROMPT_PARAMS,
    ]).encode()).hexdigest()[:16]  # fmt: skip
    path = cache / "draft-head-data" / f"{key}.json"
    if path.is_file():
        logger.info("self-distillation answers from %s", path)
        return [(ids, n) for ids, n in json.loads(path.read_text())]
    llm = LLM(model, dtype="float32", activation_dtype=args.generation_activation_dtype, log_stats_interval=1e9)
    instructions = templated_instructions(args.num_prompts, args.seed)
    written = self_written_instructions(llm, args.num_self_prompts, args.seed)
    logger.info("%d templated instructions, %d written by the model (of %d asked)", len(instructions), len(written),
                args.num_self_prompts)  # fmt: skip
    instructions += written
    random.Random(args.seed).shuffle(instructions)
    sequences = answers(llm, instructions, args.max_tokens)
    del llm
    gc.collect()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sequences))
    tmp.replace(path)
    return sequences


@torch.inference_mode()
def record(llm: LLM, sequences: list[tuple[list[int], int]], token_budget: int = 2048) -> DistillData:
    """Features and greedy labels at every position of every sequence, from flattened exact
    forwards of up to ``token_budget`` tokens (a sequence longer than that alone) over a
    private KV pool: the engine's pool and its cached prefixes stay untouched. Batch
    invariance makes each row what the engine computes for it at drafting time."""
    runner = llm.llm_engine.runner
    model, arch, bs = runner.model, runner.arch, 16
    batches: list[list[int]] = [[]]
    used = 0
    for j, (ids, _) in enumerate(sequences):
        if batches[-1] and used + len(ids) > token_budget:
            batches.append([])
            used = 0
        batches[-1].append(j)
        used += len(ids)
    longest = max(len(ids) for ids, _ in sequences)
    per_seq = -(-longest // bs)
    most = max(len(b) for b in batches)
    shape = (most * per_seq, bs, arch.num_kv_heads, arch.head_dim)
    caches = [(allocate_pool(runner.kv_spec, shape, runner.device), allocate_pool(runner.kv_spec, shape, runner.device))
              for _ in range(arch.num_layers)]  # fmt: skip
    features: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    greedy: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for batch in tqdm(batches, desc="features", unit="batch"):
        ids = [sequences[j][0] for j in batch]
        lens = np.array([len(x) for x in ids], dtype=np.int64)
        table = np.arange(len(batch) * per_seq, dtype=np.int64).reshape(len(batch), per_seq)
        meta, positions = paged_metadata(table, np.zeros(len(batch), np.int64), lens, bs, runner.device)
        tokens = torch.tensor([t for x in ids for t in x], device=runner.device)
        hidden = model(tokens, torch.from_numpy(positions).to(runner.device), caches, runner.backend, meta).float()
        best = torch.cat([model.compute_logits(hidden[i : i + 512]).argmax(-1) for i in range(0, hidden.shape[0], 512)])
        start = 0
        for j, n in zip(batch, lens.tolist()):
            features[j] = hidden[start : start + n].to(torch.bfloat16).cpu()
            greedy[j] = best[start : start + n].cpu()
            start += n
    return DistillData(sequences, features, greedy)
