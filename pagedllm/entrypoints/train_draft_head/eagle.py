"""Training an EAGLE head on self-distillation data (``spec_decode/eagle.py`` runs it).

Each pair p = (token p + 1, feature f_p) should give a guess g ~ f_{p+1} (smooth L1 on every
position) whose draft-vocabulary logits put the target's greedy token first (cross-entropy on
answer positions). Inputs carry uniform noise, as EAGLE trains. Passes 2..n replay drafting
steps 2..n on the head's own guesses (``EagleHead.forward_train``), so the second and third
drafts are trained on the inputs they will see; pass i's loss weighs 0.8^(i-1).

The draft vocabulary (EAGLE-3) is the ``draft_vocab_size`` most frequent greedy tokens of the
training answers: drafting then reads that many rows of the LM head instead of all of them.
"""

from __future__ import annotations

import logging
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from pagedllm.entrypoints.train_draft_head.data import DistillData
from pagedllm.spec_decode.eagle import EagleConfig, EagleHead

logger = logging.getLogger("pagedllm.train")

PASS_DECAY = 0.8


def draft_vocabulary(data: DistillData, train: list[int], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent greedy answer tokens (ascending ids; ties to the lower id) and
    the share of training answer positions they cover."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for j in train:
        n = data.sequences[j][1]
        counts += torch.bincount(data.greedy[j][n - 1 :], minlength=vocab_size)
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    d2t = torch.tensor(sorted(order), dtype=torch.int64)
    return d2t, float(counts[d2t].sum()) / max(1, int(counts.sum()))


class _Batches:
    """Padded batches of whole sequences, similar lengths together, about ``tokens`` each."""

    def __init__(self, data: DistillData, embed: torch.Tensor, t2d: torch.Tensor):
        self.data, self.embed, self.t2d = data, embed, t2d

    @staticmethod
    def plan(data: DistillData, indices: list[int], tokens: int) -> list[list[int]]:
        batches: list[list[int]] = [[]]
        longest = 0
        for j in sorted(indices, key=lambda j: len(data.sequences[j][0])):
            n = len(data.sequences[j][0]) - 1
            if batches[-1] and max(longest, n) * (len(batches[-1]) + 1) > tokens:
                batches.append([])
                longest = 0
            batches[-1].append(j)
            longest = max(longest, n)
        return batches

    def tensors(self, batch: list[int], noise: float):
        """Pair inputs (embeddings, features), target features f_{p+1}, draft-vocabulary labels
        (-100: none), and the masks of real and of answer positions; [B, T(, hidden)]."""
        d = self.data
        T = max(len(d.sequences[j][0]) for j in batch) - 1
        B, H = len(batch), self.embed.shape[1]
        e, f, target = torch.zeros(B, T, H), torch.zeros(B, T, H), torch.zeros(B, T, H)
        labels = torch.full((B, T), -100, dtype=torch.int64)
        real = torch.zeros(B, T, dtype=torch.bool)
        answer = torch.zeros(B, T, dtype=torch.bool)
        for b, j in enumerate(batch):
            ids, n = d.sequences[j]
            L = len(ids) - 1
            feats = d.features[j].float()
            e[b, :L] = self.embed[torch.tensor(ids[1:])]
            f[b, :L], target[b, :L] = feats[:-1], feats[1:]
            labels[b, :L] = self.t2d[d.greedy[j][1:]]  # pair p drafts the target's choice after p + 1
            real[b, :L] = True
            answer[b, max(0, n - 2) : L] = True  # drafts of answer tokens (the first one included)
        if noise:
            f = f + torch.empty_like(f).uniform_(-noise, noise)
        return e, f, target, labels, real, answer


def evaluate(head: EagleHead, batches: _Batches, plan: list[list[int]], lm: torch.Tensor, steps: int) -> dict:
    """On answer positions: each drafting step's top-1 agreement with the target's greedy token
    (given the earlier ones right), and the share of starts whose first i drafts are all right
    (chained: what greedy verification accepts)."""
    right_total = np.zeros(steps)
    chained = np.zeros(steps)
    starts = 0
    head.eval()
    with torch.no_grad():
        for batch in plan:
            e, f, _, labels, _, answer = batches.tensors(batch, 0.0)
            guesses = head.forward_train(e, f, steps)
            T = e.shape[1]
            chain = torch.ones_like(answer)
            for i, g in enumerate(guesses):
                right = ((g @ lm).argmax(-1) == labels) & answer
                right_total[i] += int(right.sum())
                by_start = torch.zeros_like(right)
                by_start[:, : T - i] = right[:, i:]  # step i + 1 of the chain that starts at t sits at t + i
                chain &= by_start
                chained[i] += int(chain.sum())
            starts += int(answer.sum())
    head.train()
    return {"positions": starts, "top1_per_step": [round(float(x) / max(starts, 1), 4) for x in right_total],
            "accepted_in_a_row": [round(float(x) / max(starts, 1), 4) for x in chained]}  # fmt: skip


def train_eagle(data: DistillData, train: list[int], held_out: list[int], embed: torch.Tensor, lm_head_t: torch.Tensor,
                arch, args) -> tuple[EagleHead, dict]:  # fmt: skip
    """``embed`` [vocab, hidden] and ``lm_head_t`` [hidden, vocab]: the target's (frozen)."""
    torch.manual_seed(args.seed)
    vocab = int(lm_head_t.shape[1])
    size = args.draft_vocab_size if args.draft_vocab_size > 0 else vocab
    d2t, coverage = draft_vocabulary(data, train, vocab, size)
    draft_size = 0 if size >= vocab else len(d2t)
    t2d = torch.full((vocab,), -100, dtype=torch.int64)
    t2d[d2t] = torch.arange(len(d2t))
    lm = lm_head_t[:, d2t].contiguous()
    logger.info("draft vocabulary: %d tokens, %.2f%% of the training answers' greedy tokens", len(d2t), 100 * coverage)
    head = EagleHead(EagleConfig(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                 args.eagle_intermediate_size, vocab, float(arch.rope_theta), float(arch.rms_norm_eps),
                                 draft_size))  # fmt: skip
    if head.d2t is not None:
        head.d2t.copy_(d2t)
    batches = _Batches(data, embed, t2d)
    plan = _Batches.plan(data, train, args.tokens_per_step)
    eval_plan = _Batches.plan(data, held_out, args.tokens_per_step)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(plan)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05)
    weights = [PASS_DECAY**i for i in range(args.eagle_passes)]
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="training", unit="step")
    for epoch in range(args.epochs):
        rng.shuffle(plan)
        for batch in plan:
            e, f, target, labels, real, answer = batches.tensors(batch, args.eagle_noise)
            loss = torch.zeros(())
            for i, g in enumerate(head.forward_train(e, f, args.eagle_passes)):
                seen = real.clone()
                seen[:, :i] = False  # pass i + 1 starts at index i
                scored = answer & seen
                loss = loss + weights[i] * F.smooth_l1_loss(g[seen], target[seen])
                if scored.any():
                    loss = loss + weights[i] * args.eagle_ce_weight * F.cross_entropy(g[scored] @ lm, labels[scored])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opt.step()
            sched.step()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if held_out:
            scores = evaluate(head, batches, eval_plan, lm, max(3, args.eagle_passes))
            logger.info("epoch %d (%.0f s): held-out top-1 per drafting step %s, accepted in a row %s", epoch + 1,
                        time.perf_counter() - t0, scores["top1_per_step"], scores["accepted_in_a_row"])  # fmt: skip
    bar.close()
    scores = evaluate(head, batches, eval_plan, lm, max(3, args.eagle_passes)) if held_out else {}
    return head.requires_grad_(False).eval(), {"draft_vocab_coverage": round(coverage, 4), "held_out": scores}
