"""``pagedllm train-draft-head``: train speculative-decoding heads for a model on this CPU.

Self-distillation, as Medusa-2 and EAGLE train without the original data: the target model
answers varied instructions (greedy, so the heads learn the tokens temperature-0 decoding
will verify), its final hidden state at every answer position is recorded, and each head i
learns to predict the token 2 + i positions ahead through the target's frozen LM head. Only
the heads' weights are trained (a hidden x hidden matrix and a bias each), so the result is a
few MB: ``config.json`` + ``heads.safetensors``, loaded by ``speculative_config={"method":
"medusa", "model": DIR}``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pagedllm.attention.backend import paged_metadata
from pagedllm.attention.kv_cache_dtype import allocate_pool
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.medusa import MedusaHeads

logger = logging.getLogger("pagedllm.train")

# Instructions are made of a task and a subject (none is one of the benchmark's chat prompts),
# so a few hundred varied prompts come without a dataset download.
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


def training_prompts(n: int, seed: int) -> list[str]:
    pairs = [t.format(s) for t, s in itertools.product(TASKS, SUBJECTS)]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=["medusa"], default="medusa", help="the kind of heads (default: %(default)s)")
    p.add_argument("--model", default=None, help="the target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True, help="directory to write config.json and heads.safetensors to")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads: tokens 2..n+1 ahead (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=320, help="instructions the target answers (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=160, help="answer length cap (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the recorded positions (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="positions per optimizer step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)


@torch.inference_mode()
def record_hidden(llm: LLM, sequences: list[tuple[list[int], int]]) -> tuple[torch.Tensor, list[np.ndarray]]:
    """The target's final hidden state at every answer position of each (token ids, prompt
    length) sequence, from one forward per sequence over a private KV pool (the engine's pool
    and its cached prefixes stay untouched). Returns [positions, hidden] and, per sequence, the
    token ids that follow its recorded positions."""
    runner = llm.llm_engine.runner
    model, arch, bs = runner.model, runner.arch, 16
    longest = max(len(ids) for ids, _ in sequences)
    num_blocks = -(-longest // bs)
    shape = (num_blocks, bs, arch.num_kv_heads, arch.head_dim)
    caches = [(allocate_pool(runner.kv_spec, shape, runner.device), allocate_pool(runner.kv_spec, shape, runner.device))
              for _ in range(arch.num_layers)]  # fmt: skip
    table = np.arange(num_blocks, dtype=np.int64)[None]
    features, futures = [], []
    for ids, prompt_len in tqdm(sequences, desc="hidden states", unit="seq"):
        meta, positions = paged_metadata(table, np.zeros(1, np.int64), np.array([len(ids)]), bs, runner.device)
        hidden = model(torch.tensor(ids), torch.from_numpy(positions), caches, runner.backend, meta)
        # Position t (from the prompt's last token on) predicts t + 1 (the LM head) and, with
        # head i, t + 2 + i: keep the tokens after t.
        features.append(hidden[prompt_len - 1 : len(ids) - 1].float().clone())
        futures.append(np.asarray(ids[prompt_len:], dtype=np.int64))
    return torch.cat(features), futures


def head_targets(futures: list[np.ndarray], num_heads: int) -> torch.Tensor:
    """[positions, num_heads]: the token 2 + i ahead of each recorded position (-100: none)."""
    rows = []
    for f in futures:  # f[j] is the token after recorded position j
        t = np.full((len(f), num_heads), -100, dtype=np.int64)
        for i in range(num_heads):
            ahead = f[1 + i :]
            t[: len(ahead), i] = ahead
        rows.append(t)
    return torch.from_numpy(np.concatenate(rows))


def train_medusa(features: torch.Tensor, targets: torch.Tensor, lm_head_t: torch.Tensor, args) -> tuple[MedusaHeads, list[float]]:
    """Adam over the heads only; the LM head (``lm_head_t`` [hidden, vocab]) stays frozen.
    Zero-initialised heads start as the identity (h + SiLU(0) = h), i.e. from the target's own
    next-token guess, as Medusa does."""
    torch.manual_seed(args.seed)
    heads = MedusaHeads(args.num_heads, features.shape[1])
    for head in heads.heads:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    opt = torch.optim.Adam(heads.parameters(), lr=args.lr)
    n = features.shape[0]
    steps = args.epochs * -(-n // args.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.1)
    accuracy: list[float] = []
    bar = tqdm(total=steps, desc="training", unit="step")
    for _ in range(args.epochs):
        order = torch.randperm(n)
        for start in range(0, n, args.batch_size):
            idx = order[start : start + args.batch_size]
            x, y = features[idx], targets[idx]
            logits = heads(x) @ lm_head_t  # [b, heads, vocab]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    with torch.no_grad():  # top-1 accuracy per head on the last 2,048 positions seen (a sanity check, not a held-out score)
        x, y = features[-2048:], targets[-2048:]
        pred = (heads(x) @ lm_head_t).argmax(-1)
        for i in range(args.num_heads):
            valid = y[:, i] != -100
            accuracy.append(float((pred[valid, i] == y[valid, i]).float().mean()))
    return heads.requires_grad_(False).eval(), accuracy


def run(args: argparse.Namespace) -> int:
    if args.num_heads < 1 or args.num_prompts < 1 or args.epochs < 1 or args.batch_size < 1:
        raise ValueError("--num-heads, --num-prompts, --epochs and --batch-size must be positive")
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="float32", log_stats_interval=1e9)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for p in training_prompts(args.num_prompts, args.seed)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=args.max_tokens))
    sequences = [(list(p) + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outs)]
    t_gen = time.perf_counter()
    features, futures = record_hidden(llm, sequences)
    targets = head_targets(futures, args.num_heads)
    model = llm.llm_engine.runner.model
    with torch.inference_mode():  # the LM head as a dense [hidden, vocab] matrix, whatever form it is stored in
        lm_head_t = model.compute_logits(torch.eye(features.shape[1]))
    # Out of inference mode, so autograd may save them.
    features, lm_head_t = features.clone(), lm_head_t.clone()
    t_rec = time.perf_counter()
    heads, accuracy = train_medusa(features, targets, lm_head_t, args)
    t_train = time.perf_counter()
    meta = {
        "vocab_size": int(lm_head_t.shape[1]),
        "target": str(llm.llm_engine.source.path.name),
        "trained_on": {"prompts": args.num_prompts, "positions": int(features.shape[0]), "epochs": args.epochs,
                       "max_tokens": args.max_tokens, "lr": args.lr, "batch_size": args.batch_size},
        "top1_accuracy_per_head": [round(a, 4) for a in accuracy],
        "minutes": {"generate": round((t_gen - t0) / 60, 2), "hidden_states": round((t_rec - t_gen) / 60, 2),
                    "train": round((t_train - t_rec) / 60, 2)},
    }  # fmt: skip
    heads.save(Path(args.output), meta)
    print(f"wrote {args.output}: {args.num_heads} heads, {features.shape[0]} positions, top-1 accuracy per head "
          f"{', '.join(f'{a:.1%}' for a in accuracy)}; {(t_train - t0) / 60:.1f} min "
          f"(generate {meta['minutes']['generate']}, hidden states {meta['minutes']['hidden_states']}, "
          f"train {meta['minutes']['train']})")  # fmt: skip
    return 0
