"""``pagedllm train-draft-head``: train speculative-decoding heads for a model on this CPU.

Self-distillation, as Medusa-2 and EAGLE train without the original data (``data.py``): the
target answers instructions (templated, and ones it writes itself), and an exact pass records
its features and greedy choices at every position. Then ``eagle.py`` or ``medusa.py`` trains
the heads with the target's embeddings and LM head frozen, and a held-out share of the
sequences scores them. The result is a few MB: ``config.json`` + a safetensors file, loaded
by ``speculative_config={"method": "eagle" | "medusa", "model": DIR}``.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch

from pagedllm.config import cache_dir
from pagedllm.entrypoints.arg_types import non_negative_float, non_negative_int, output_dir, positive_float, positive_int
from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.train_draft_head.data import generate_sequences, record
from pagedllm.entrypoints.train_draft_head.eagle import train_eagle
from pagedllm.entrypoints.train_draft_head.medusa import train_medusa
from pagedllm.model.loader import resolve_model

logger = logging.getLogger("pagedllm.train")

HELD_OUT_SHARE = 0.05  # of the sequences, scored and never trained on


def add_args(p: argparse.ArgumentParser) -> None:
    d = " (default: %(default)s)"
    p.add_argument("--method", choices=["medusa", "eagle"], default="medusa", help="the kind of heads" + d)
    p.add_argument("--model", default=None, help="the target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--output", type=output_dir, required=True, help="directory to write config.json and the weights to")
    p.add_argument("--num-heads", type=positive_int, default=4, help="Medusa heads: tokens 2..n+1 ahead" + d)
    p.add_argument("--num-prompts", type=positive_int, default=480, help="templated instructions the target answers" + d)
    p.add_argument("--num-self-prompts", type=non_negative_int, default=1536,
                   help="instructions the target is asked to write itself; those it finishes are answered too" + d)
    p.add_argument("--max-tokens", type=positive_int, default=256, help="answer length cap" + d)
    p.add_argument("--generation-activation-dtype", choices=["float32", "int8", "int16"], default="int8",
                   help="the mode answers are generated in; labels always come from the exact model" + d)
    p.add_argument("--draft-vocab-size", type=non_negative_int, default=8192,
                   help="heads draft from this many most frequent answer tokens, reading only their LM-head "
                        "rows; 0: all" + d)  # fmt: skip
    p.add_argument("--epochs", type=positive_int, default=2, help="passes over the training data" + d)
    p.add_argument("--batch-size", type=positive_int, default=256, help="Medusa: positions per optimizer step" + d)
    p.add_argument("--tokens-per-step", type=positive_int, default=4096, help="EAGLE: padded tokens per optimizer step" + d)
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate" + d)
    p.add_argument("--eagle-intermediate-size", type=positive_int, default=768,
                   help="EAGLE: the MLP width of its decoder layer" + d)
    p.add_argument("--eagle-passes", type=positive_int, default=3,
                   help="EAGLE: drafting steps replayed in training, each on the previous one's guesses" + d)
    p.add_argument("--eagle-ce-weight", type=non_negative_float, default=0.5,
                   help="EAGLE: weight of the token loss beside the feature loss" + d)
    p.add_argument("--eagle-noise", type=non_negative_float, default=0.1, help="EAGLE: uniform noise on input features" + d)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    positive = ["num_heads", "num_prompts", "max_tokens", "epochs", "batch_size", "tokens_per_step",
                "eagle_intermediate_size", "eagle_passes"]  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_self_prompts < 0 or args.draft_vocab_size < 0:
        raise ValueError("--num-self-prompts and --draft-vocab-size must not be negative")
    t0 = time.perf_counter()
    source = resolve_model(args.model).path
    sequences = generate_sequences(args.model, source, args, cache_dir())
    t_gen = time.perf_counter()
    llm = LLM(args.model, dtype="float32", log_stats_interval=1e9)
    data = record(llm, sequences)
    model = llm.llm_engine.runner.model
    with torch.inference_mode():  # the frozen embeddings and LM head, dense, whatever form they are stored in
        lm_head_t = model.compute_logits(torch.eye(model.arch.hidden_size)).clone()
        embed = model.embed_tokens(torch.arange(model.arch.vocab_size)).float().clone() if args.method == "eagle" else None
    t_rec = time.perf_counter()
    order = list(range(len(sequences)))
    random.Random(args.seed).shuffle(order)
    n_held = max(1, int(len(order) * HELD_OUT_SHARE)) if len(order) > 1 else 0
    held_out, train = order[:n_held], order[n_held:]
    if args.method == "medusa":
        heads, scores = train_medusa(data, train, held_out, lm_head_t, args)
        num_positions = scores.pop("positions")
    else:
        heads, scores = train_eagle(data, train, held_out, embed, lm_head_t, model.arch, args)
        num_positions = sum(len(data.sequences[j][0]) - 1 for j in train)
    t_train = time.perf_counter()
    trained_on = {k: getattr(args, k) for k in ("num_prompts", "num_self_prompts", "max_tokens", "generation_activation_dtype",
                                                 "epochs", "lr", "draft_vocab_size", "seed")}  # fmt: skip
    if args.method == "eagle":
        trained_on |= {k: getattr(args, k) for k in ("tokens_per_step", "eagle_passes", "eagle_ce_weight", "eagle_noise")}
    else:
        trained_on["batch_size"] = args.batch_size
    meta = {
        "vocab_size": int(lm_head_t.shape[1]),
        "target": str(source.name),
        "trained_on": trained_on | {"sequences": len(train), "positions": num_positions},
        **scores,
        "minutes": {"generate": round((t_gen - t0) / 60, 2), "features": round((t_rec - t_gen) / 60, 2),
                    "train": round((t_train - t_rec) / 60, 2)},
    }  # fmt: skip
    heads.save(Path(args.output), meta)
    row = scores.get("held_out", {}).get("accepted_in_a_row")
    print(f"wrote {args.output}: {args.method}, {num_positions} training positions"
          + (f", held-out drafts accepted in a row {row}" if row else "")
          + f"; {(t_train - t0) / 60:.1f} min (generate {meta['minutes']['generate']}, features "
          f"{meta['minutes']['features']}, train {meta['minutes']['train']})")  # fmt: skip
    return 0
