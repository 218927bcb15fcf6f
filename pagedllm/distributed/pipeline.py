"""Pipeline stages: a stage runs its layers and hands the hidden state on by point-to-point.

Between stages travel two [num_tokens, hidden] tensors, stacked into one message: the last
sublayer's output ``x`` and the residual stream, since each layer boundary first adds ``x``
into the residual and normalises that (``RMSNorm(x, residual)``). The receiving stage
applies its first layer's input norm to them, as the undivided model would at that boundary.
Every stage knows the step's token count from the same SchedulerOutput, so the receive
buffer's shape needs no message of its own. Only the last stage returns hidden states (and
samples); the others return None.

Within one batch stage s + 1 waits for stage s; the engine keeps one batch per stage in
flight (``LLMEngine._step_pipelined``) so the stages work on different batches at once.
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.distributed as dist
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.distributed.parallel_state import ParallelContext, RankInfo


@torch.inference_mode()
def _stage_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list,
    backend: AttentionBackend,
    meta: AttentionMetadata,
    *,
    ctx: ParallelContext,
) -> torch.Tensor | None:
    info = ctx.info
    layers = model.layers
    n = input_ids.shape[0]
    if info.is_first_stage:
        residual = model.embed_tokens(input_ids)
        x = layers[0].input_layernorm.forward(residual)
    else:
        buf = torch.empty(2, n, model.arch.hidden_size, dtype=model.norm.weight.dtype)
        dist.recv(buf, src=info.prev_rank)
        residual = buf[1]
        x = layers[0].input_layernorm.forward(buf[0], residual)
    last = len(layers) - 1
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
        x = layer.self_attn.forward(x, positions, model.layer_ropes[i], kv_cache, backend, meta)
        x = layer.post_attention_layernorm.forward(x, residual)
        x = layer.mlp.forward(x)
        if i < last:
            x = layers[i + 1].input_layernorm.forward(x, residual)
    if info.is_last_stage:
        return model.norm.forward(x, residual)
    dist.send(torch.stack([x, residual]).contiguous(), dst=info.next_rank)
    return None


class _NotOnThisStage(nn.Module):
    """Stands in for the embedding (stages after the first) or the LM head (stages before the
    last): the stage never calls it, and its weights are released."""

    def __init__(self, what: str, stage: int, num_stages: int):
        super().__init__()
        self.what, self.stage, self.num_stages = what, stage, num_stages

    def forward(self, *args):
        raise RuntimeError(f"pipeline stage {self.stage} of {self.num_stages} holds no {self.what}")


def install(model: nn.Module, ctx: ParallelContext) -> None:
    """Make a stage-built model (its layers only) run as its pipeline stage."""
    model.forward = MethodType(lambda self, *args: _stage_forward(self, *args, ctx=ctx), model)


def release_unused(model: nn.Module, info: RankInfo) -> None:
    """Drop what the stage never runs: the model is built whole at its ends
    (``from_hf_state_dict`` wants every weight; a tied head and embedding share one table
    until one of them is dropped). Called by the loader before it lays the blocks out."""
    if not info.is_first_stage:
        model.embed_tokens = _NotOnThisStage("embedding", info.pp_rank, info.pp)
    if not info.is_last_stage:
        model.lm_head = _NotOnThisStage("LM head", info.pp_rank, info.pp)
