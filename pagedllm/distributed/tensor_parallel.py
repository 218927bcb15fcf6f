"""The collectives a tensor-parallel shard adds to a model built from its own weights.

``install(model, ctx, vocab_start, vocab_size)`` turns a model built from a rank's shard
(``sharding.shard_state``) into its tensor-parallel form, without touching the model code:

- o_proj and down_proj become ``RowParallelLinear`` (the same object, its class swapped): the
  partial sums of every rank are all-reduced, one all-reduce each per layer;
- a mixture-of-experts block becomes ``ParallelMoeBlock``: its experts' down_proj stay plain
  (each a partial sum over the rank's slice of the expert width), and the block's weighted
  sum of them is all-reduced once, however many experts the step hit;
- the embedding looks up only the rank's vocabulary rows (zeros elsewhere), all-reduced;
- ``compute_logits`` all-gathers every rank's vocabulary slice into the full logits.

Every rank then holds the same hidden states after each all-reduce (gloo's sum gives every
rank the same bits), and every rank of the last stage the same full logits, so each samples
the same tokens from the same seeded sampler and the runners' request states stay in step.
The one-call native decoder stack has no all-reduce, so it refuses a model with
``tp_size > 1`` (``fused_stack.why_not``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.model.linear import Linear
from pagedllm.model.moe import SparseMoeBlock


def all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group in place (timed into the context).

    Two ranks swap their partial sums (isend + recv) and each adds the other's: on gloo over
    loopback that took 0.20 ms for one token's 576 floats where ``all_reduce`` took 1.06-1.5
    ms (measured on this 2-core machine), and a decode step runs two per layer. Addition is
    commutative, so both ranks hold the same bits. Bigger groups use gloo's all_reduce."""
    start = time.perf_counter()
    info = ctx.info
    if info.tp == 2:
        peer = info.rank + 1 - 2 * info.tp_rank  # the other rank of this stage
        theirs = torch.empty_like(x)
        sent = dist.isend(x, peer)
        dist.recv(theirs, peer)
        sent.wait()
        x.add_(theirs)
    else:
        dist.all_reduce(x, group=ctx.tp_group)
    ctx.allreduce_seconds += time.perf_counter() - start
    ctx.allreduce_calls += 1
    return x


class RowParallelLinear(Linear):
    """A Linear holding the rank's input columns: its output is a partial sum until
    all-reduced. Set by class swap (``install``), so the packed / panel / quant forms stay."""

    tp_ctx: ParallelContext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x).contiguous(), self.tp_ctx)


class ParallelMoeBlock(SparseMoeBlock):
    """A mixture-of-experts block holding the rank's slice of every expert (router whole):
    one all-reduce of the block's output instead of one per expert. Set by class swap."""

    tp_ctx: ParallelContext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x).contiguous(), self.tp_ctx)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [vocab_start, vocab_start + rows) of the embedding table; other tokens
    look up zeros, and the all-reduce fills them in from their rank."""

    def __init__(self, local: nn.Module, vocab_start: int, ctx: ParallelContext):
        super().__init__()
        self.local = local
        self.vocab_start = vocab_start
        self.num_rows = local.num_embeddings
        self.ctx = ctx

    @property
    def embedding_dim(self) -> int:
        return self.local.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        rows = self.local(local.masked_fill(outside, 0))
        rows = rows.masked_fill(outside.unsqueeze(-1), 0).contiguous()
        return all_reduce(rows, self.ctx)


def _gathered_logits(hidden: torch.Tensor, *, local_logits: Callable[[torch.Tensor], torch.Tensor],
                     ctx: ParallelContext, vocab_size: int, per_rank: int) -> torch.Tensor:  # fmt: skip
    """Full fp32 logits: every rank's slice (padded to ``per_rank`` columns) all-gathered."""
    part = local_logits(hidden)
    if part.shape[1] < per_rank:
        part = torch.nn.functional.pad(part, (0, per_rank - part.shape[1]))
    parts = [torch.empty_like(part) for _ in range(ctx.info.tp)]
    start = time.perf_counter()
    dist.all_gather(parts, part.contiguous(), group=ctx.tp_group)
    ctx.allreduce_seconds += time.perf_counter() - start
    return torch.cat(parts, dim=1)[:, :vocab_size]


def install(model: nn.Module, ctx: ParallelContext, vocab_start: int, vocab_size: int) -> None:
    """Make a shard-built model tensor parallel (see the module docstring)."""
    tp = ctx.info.tp
    model.tp_size = tp  # read by fused_stack.why_not
    for layer in model.layers:
        mlp = layer.mlp
        row_parallel = [layer.self_attn.o_proj]
        if isinstance(mlp, SparseMoeBlock):  # its experts' down_proj stay partial sums
            mlp.__class__ = ParallelMoeBlock
            mlp.tp_ctx = ctx
        else:
            row_parallel.append(mlp.down_proj)
        for linear in row_parallel:
            linear.__class__ = RowParallelLinear
            linear.tp_ctx = ctx
    if ctx.info.is_first_stage:  # (later pipeline stages hold no embedding: pipeline.release_unused)
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, vocab_start, ctx)
    per_rank = -(-vocab_size // tp)
    local_logits = model.compute_logits
    model.compute_logits = partial(_gathered_logits, local_logits=local_logits, ctx=ctx, vocab_size=vocab_size,
                                   per_rank=per_rank)  # fmt: skip
