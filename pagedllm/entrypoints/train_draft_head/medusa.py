"""Training Medusa heads on self-distillation data (``spec_decode/medusa.py`` runs them).

From the target's final hidden state at position t, head i guesses the token 2 + i positions
ahead: the target's greedy choice after position t + 1 + i (what greedy verification compares
the draft with, once the drafts before it were accepted). Only the heads train; the LM head
(its draft-vocabulary rows, as for EAGLE) stays frozen. Zero-initialised heads start as the
identity (h + SiLU(0) = h), i.e. as the target's own next-token guess, as Medusa does.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pagedllm.entrypoints.train_draft_head.data import DistillData
from pagedllm.entrypoints.train_draft_head.eagle import draft_vocabulary
from pagedllm.spec_decode.medusa import MedusaHeads

logger = logging.getLogger("pagedllm.train")


def positions(data: DistillData, indices: list[int], num_heads: int, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [N, hidden] of every answer-drafting position (the prompt's last token on) and
    their draft-vocabulary labels [N, num_heads] (-100: past the sequence or outside the
    draft vocabulary)."""
    feats, labels = [], []
    for j in indices:
        ids, n = data.sequences[j]
        L = len(ids)
        feats.append(data.features[j][n - 1 : L - 1])
        t = np.full((L - n, num_heads), -100, dtype=np.int64)
        greedy = data.greedy[j].numpy()
        for i in range(num_heads):
            ahead = greedy[n + i : L]  # the choice after position t + 1 + i, for t = n - 1 ..
            t[: len(ahead), i] = ahead
        labels.append(torch.from_numpy(t))
    y = torch.cat(labels)
    return torch.cat(feats).float(), torch.where(y >= 0, t2d[y.clamp(min=0)], y)


def accuracy(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, lm: torch.Tensor) -> dict:
    """Each head's top-1 on these positions, and the share whose first i heads are all right."""
    with torch.no_grad():
        right = torch.cat([(heads(x[s : s + 4096]) @ lm).argmax(-1) == y[s : s + 4096] for s in range(0, len(x), 4096)])
    chain = right.cumprod(dim=1).float().mean(0)
    valid = y != -100
    top1 = [(right[:, i] & valid[:, i]).sum().item() / max(1, valid[:, i].sum().item()) for i in range(y.shape[1])]
    return {"positions": len(x), "top1_per_head": [round(a, 4) for a in top1],
            "accepted_in_a_row": [round(float(c), 4) for c in chain]}  # fmt: skip


def train_medusa(data: DistillData, train: list[int], held_out: list[int], lm_head_t: torch.Tensor,
                 args) -> tuple[MedusaHeads, dict]:  # fmt: skip
    """Adam over the heads only; ``lm_head_t`` [hidden, vocab] stays frozen."""
    torch.manual_seed(args.seed)
    vocab = int(lm_head_t.shape[1])
    size = args.draft_vocab_size if args.draft_vocab_size > 0 else vocab
    d2t, coverage = draft_vocabulary(data, train, vocab, size)
    t2d = torch.full((vocab,), -100, dtype=torch.int64)
    t2d[d2t] = torch.arange(len(d2t))
    lm = lm_head_t[:, d2t].contiguous()
    heads = MedusaHeads(args.num_heads, int(lm_head_t.shape[0]), 0 if size >= vocab else len(d2t))
    if heads.d2t is not None:
        heads.d2t.copy_(d2t)
    for head in heads.heads:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    x, y = positions(data, train, args.num_heads, t2d)
    opt = torch.optim.Adam(heads.parameters(), lr=args.lr)
    n = x.shape[0]
    steps = args.epochs * -(-n // args.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.1)
    bar = tqdm(total=steps, desc="training", unit="step")
    for _ in range(args.epochs):
        order = torch.randperm(n)
        for start in range(0, n, args.batch_size):
            idx = order[start : start + args.batch_size]
            logits = heads(x[idx]) @ lm  # [b, heads, draft vocab]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[idx].reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    heads = heads.requires_grad_(False).eval()
    scores = accuracy(heads, *positions(data, held_out, args.num_heads, t2d), lm) if held_out else {}
    if scores:
        logger.info("held-out top-1 per head %s, accepted in a row %s", scores["top1_per_head"], scores["accepted_in_a_row"])
    return heads, {"draft_vocab_coverage": round(coverage, 4), "held_out": scores, "positions": n}
