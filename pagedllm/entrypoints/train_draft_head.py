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
import hashlib
import itertools
import json
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
from pagedllm.config import cache_dir
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.eagle import EagleConfig, EagleHead
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
    p.add_argument("--method", choices=["medusa", "eagle"], default="medusa", help="the kind of heads (default: %(default)s)")
    p.add_argument("--model", default=None, help="the target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output", required=True, help="directory to write config.json and heads.safetensors to")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads: tokens 2..n+1 ahead (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=240, help="instructions the target answers (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the recorded positions (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=256, help="positions per optimizer step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--eagle-intermediate-size", type=int, default=768,
                   help="EAGLE: the MLP width of its decoder layer (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)


def self_distillation_data(llm: LLM, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer token ids, prompt length) per training instruction. The answers
    are kept in the cache directory, keyed by model and arguments, so training other heads (or
    again) on the same model does not regenerate them."""
    source = llm.llm_engine.source.path
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{args.num_prompts}|{args.max_tokens}|"
                         f"{args.seed}|{TASKS}|{SUBJECTS}".encode()).hexdigest()[:16]  # fmt: skip
    path = cache_dir() / "draft-head-data" / f"{key}.json"
    if path.is_file():
        logger.info("self-distillation answers from %s", path)
        return [(ids, n) for ids, n in json.loads(path.read_text())]
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for p in training_prompts(args.num_prompts, args.seed)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=args.max_tokens))
    sequences = [(list(p) + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sequences))
    tmp.replace(path)
    return sequences


@torch.inference_mode()
def record_hidden(llm: LLM, sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """The target's final hidden state [len, hidden] at every position of each (token ids,
    prompt length) sequence, from one forward per sequence over a private KV pool (the
    engine's pool and its cached prefixes stay untouched)."""
    runner = llm.llm_engine.runner
    model, arch, bs = runner.model, runner.arch, 16
    longest = max(len(ids) for ids, _ in sequences)
    num_blocks = -(-longest // bs)
    shape = (num_blocks, bs, arch.num_kv_heads, arch.head_dim)
    caches = [(allocate_pool(runner.kv_spec, shape, runner.device), allocate_pool(runner.kv_spec, shape, runner.device))
              for _ in range(arch.num_layers)]  # fmt: skip
    table = np.arange(num_blocks, dtype=np.int64)[None]
    hidden_states = []
    for ids, _ in tqdm(sequences, desc="hidden states", unit="seq"):
        meta, positions = paged_metadata(table, np.zeros(1, np.int64), np.array([len(ids)]), bs, runner.device)
        hidden = model(torch.tensor(ids), torch.from_numpy(positions), caches, runner.backend, meta)
        hidden_states.append(hidden.float().clone())
    return hidden_states


def medusa_data(sequences: list[tuple[list[int], int]], hidden: list[torch.Tensor]) -> tuple[torch.Tensor, list[np.ndarray]]:
    """Position t (from the prompt's last token on) predicts t + 1 (the LM head) and, with head
    i, t + 2 + i: the features of those positions and, per sequence, the tokens after them."""
    features = torch.cat([h[n - 1 : len(ids) - 1] for (ids, n), h in zip(sequences, hidden)])
    futures = [np.asarray(ids[n:], dtype=np.int64) for ids, n in sequences]
    return features, futures


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


def train_eagle(sequences, hidden, embeds, lm_head_t, arch, args) -> tuple[EagleHead, list[float]]:
    """Teacher-forced over whole sequences: pair t = (token t + 1, feature f_t) -> g ~ f_{t+1}
    (smooth L1 on every position) whose LM-head logits should give token t + 2 (cross-entropy
    on answer positions). Input features get uniform noise (+-0.1), as EAGLE does, since at
    drafting time later pairs carry the head's own guesses."""
    torch.manual_seed(args.seed)
    head = EagleHead(EagleConfig(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                 args.eagle_intermediate_size, int(lm_head_t.shape[1]), float(arch.rope_theta),
                                 float(arch.rms_norm_eps)))  # fmt: skip
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr)
    seqs_per_step = max(1, args.batch_size // 32)
    steps = args.epochs * -(-len(sequences) // seqs_per_step)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.1)

    def example(j: int, noise: bool):
        ids, n = sequences[j]
        f = hidden[j][:-1]
        if noise:
            f = f + torch.empty_like(f).uniform_(-0.1, 0.1)
        labels = torch.full((len(ids) - 1,), -100, dtype=torch.int64)
        labels[max(0, n - 2) : len(ids) - 2] = torch.tensor(ids[max(2, n) :])  # pair t predicts token t + 2
        return embeds[j], f, hidden[j][1:], labels

    bar = tqdm(total=steps, desc="training", unit="step")
    for _ in range(args.epochs):
        order = torch.randperm(len(sequences)).tolist()
        for start in range(0, len(order), seqs_per_step):
            loss = 0.0
            for j in order[start : start + seqs_per_step]:
                e, f, f_next, labels = example(j, noise=True)
                g = head.forward_dense(e, f)
                reg = F.smooth_l1_loss(g, f_next)
                ce = F.cross_entropy(g @ lm_head_t, labels, ignore_index=-100) if (labels != -100).any() else 0.0
                loss = loss + (reg + 0.5 * ce) / seqs_per_step
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{float(loss):.3f}")
    bar.close()
    correct = total = 0
    with torch.no_grad():  # top-1 of the first draft on the last sequences (a sanity check, not a held-out score)
        for j in order[-16:]:
            e, f, _, labels = example(j, noise=False)
            pred = (head.forward_dense(e, f) @ lm_head_t).argmax(-1)
            valid = labels != -100
            correct += int((pred[valid] == labels[valid]).sum())
            total += int(valid.sum())
    return head.requires_grad_(False).eval(), [correct / max(total, 1)]


def run(args: argparse.Namespace) -> int:
    if args.num_heads < 1 or args.num_prompts < 1 or args.epochs < 1 or args.batch_size < 1:
        raise ValueError("--num-heads, --num-prompts, --epochs and --batch-size must be positive")
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="float32", log_stats_interval=1e9)
    sequences = self_distillation_data(llm, args)
    t_gen = time.perf_counter()
    hidden = record_hidden(llm, sequences)
    model = llm.llm_engine.runner.model
    with torch.inference_mode():  # the LM head as a dense [hidden, vocab] matrix, whatever form it is stored in
        lm_head_t = model.compute_logits(torch.eye(model.arch.hidden_size))
    lm_head_t = lm_head_t.clone()  # out of inference mode, so autograd may save it
    t_rec = time.perf_counter()
    if args.method == "medusa":
        features, futures = medusa_data(sequences, hidden)
        heads, accuracy = train_medusa(features.clone(), head_targets(futures, args.num_heads), lm_head_t, args)
        num_positions = int(features.shape[0])
    else:
        with torch.inference_mode():
            embeds = [model.embed_tokens(torch.tensor(ids[1:])).float() for ids, _ in sequences]
        heads, accuracy = train_eagle(sequences, [h.clone() for h in hidden], [e.clone() for e in embeds], lm_head_t,
                                      model.arch, args)  # fmt: skip
        num_positions = sum(len(ids) - 1 for ids, _ in sequences)
    t_train = time.perf_counter()
    meta = {
        "vocab_size": int(lm_head_t.shape[1]),
        "target": str(llm.llm_engine.source.path.name),
        "trained_on": {"prompts": args.num_prompts, "positions": num_positions, "epochs": args.epochs,
                       "max_tokens": args.max_tokens, "lr": args.lr, "batch_size": args.batch_size},
        "top1_accuracy_per_head": [round(a, 4) for a in accuracy],
        "minutes": {"generate": round((t_gen - t0) / 60, 2), "hidden_states": round((t_rec - t_gen) / 60, 2),
                    "train": round((t_train - t_rec) / 60, 2)},
    }  # fmt: skip
    heads.save(Path(args.output), meta)
    print(f"wrote {args.output}: {args.method}, {num_positions} positions, top-1 accuracy "
          f"{', '.join(f'{a:.1%}' for a in accuracy)}; {(t_train - t0) / 60:.1f} min "
          f"(generate {meta['minutes']['generate']}, hidden states {meta['minutes']['hidden_states']}, "
          f"train {meta['minutes']['train']})")  # fmt: skip
    return 0
