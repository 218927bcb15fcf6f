"""Which slice of every weight a rank holds, cut from the loaded state dict before the model
is built, so a rank only ever builds (and keeps) its own shard.

Tensor parallel (tp ranks of one pipeline stage):

- attention: heads are split by KV group, so a rank's query heads always sit with their
  KV head (GQA). With ``num_kv_heads >= tp`` the KV heads are cut into ``tp`` contiguous runs,
  the first ranks taking one more when they do not divide: SmolLM2-135M (9 query heads, 3 KV
  heads, groups of 3) at tp=2 gives rank 0 KV heads {0, 1} = query heads 0-5 and rank 1 KV
  head {2} = query heads 6-8. With ``num_kv_heads < tp`` each KV head is replicated on
  ``tp / num_kv_heads`` ranks, which split its group's query heads.
- q/k/v and gate/up are column parallel (the rank's output rows: free for GGUF blocks too);
  o_proj and down_proj are row parallel (the rank's input columns; one all-reduce after each).
  GGUF blocks run along the input dimension, so a row-parallel cut must fall on a block
  boundary (32 weights, 256 for K-quants): the MLP width is cut on such boundaries, and an
  attention cut that is not aligned falls back to the dequantized (fp32) weight.
  Phi-3's fused ``qkv_proj`` ([q; k; v] rows) and ``gate_up_proj`` ([gate; up] rows) are cut
  part by part and the rank's rows of each part concatenated in the same order, so the
  rank's fused weight is what the unfused cut would have fused.
- mixture of experts (Qwen3-MoE): the router is replicated (every rank routes the same
  tokens to the same experts); each expert's gate/up keeps the rank's slice of the expert
  width and its down_proj the same input columns, so a rank's block output is a partial sum,
  all-reduced once per layer (``tensor_parallel.install``).
- embedding and LM head are vocab parallel: contiguous runs of ``ceil(vocab / tp)`` rows.

Pipeline parallel: stage s holds layers ``[start, end)`` (as even as possible, the first
stages taking one more), renumbered from 0. The embedding and LM head are loaded on every
stage (the model is built whole at its ends); ``pipeline.install`` then releases the
embedding on all but the first stage and the LM head on all but the last.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedllm.kernels.gguf_ops import GGUF_TYPES
from pagedllm.model.arch import ModelArch
from pagedllm.quantization.weights import QuantizedWeight, cat_rows, dequantize, segments

logger = logging.getLogger("pagedllm.distributed")


@dataclass(frozen=True)
class HeadShard:
    """One tensor-parallel rank's attention heads: query heads [q_start, q_end), KV heads
    [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def split_even(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, end) of ``parts`` contiguous runs covering ``n``, cut at multiples of ``align``,
    as even as possible with the first runs the longer ones."""
    units, rest = divmod(n, align)
    if rest:
        raise ValueError(f"{n} is not a multiple of {align}")
    base, extra = divmod(units, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + (base + (r < extra)) * align
        bounds.append((start, end))
        start = end
    return bounds


def head_shards(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    """Every tp rank's heads, by KV group (see the module docstring)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        return [HeadShard(a * group, b * group, a, b) for a, b in split_even(num_kv_heads, tp)]
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide or be a multiple of the model's "
                         f"{num_kv_heads} KV heads")  # fmt: skip
    replicas = tp // num_kv_heads
    if group % replicas:
        raise ValueError(f"tensor_parallel_size ({tp}): each of the {num_kv_heads} KV heads would be shared by "
                         f"{replicas} ranks, which cannot split its {group} query heads evenly")  # fmt: skip
    per = group // replicas
    return [HeadShard(r * per, (r + 1) * per, r // replicas, r // replicas + 1) for r in range(tp)]


def layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) exceeds the model's {num_layers} layers")
    return split_even(num_layers, pp)


def vocab_range(vocab_size: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """The rank's rows of the embedding and LM head: runs of ceil(vocab / tp) (the last may be
    shorter), so the gathered logits are equal-sized pieces."""
    per = -(-vocab_size // tp)
    return min(tp_rank * per, vocab_size), min((tp_rank + 1) * per, vocab_size)


def check_supported(arch: ModelArch, tp: int, pp: int) -> None:
    """Refuse what the sharding does not cover, naming the field."""
    if tp > 1:
        if arch.num_experts and arch.architecture != "qwen3_moe":
            raise ValueError(
                f"tensor_parallel_size > 1 supports the qwen3_moe mixture of experts, not {arch.architecture}"
            )
        head_shards(arch.num_heads, arch.num_kv_heads, tp)
    if pp > 1:
        if arch.architecture not in ("llama", "mistral", "qwen2", "qwen3") or arch.sliding_window is not None:
            raise ValueError(f"pipeline_parallel_size > 1 supports Llama-family models without sliding windows, "
                             f"not {arch.architecture}")  # fmt: skip
        layer_ranges(arch.num_layers, pp)


def _rows(w: Any, start: int, end: int) -> Any:
    """Output rows [start, end) of a weight (dense, GGUF blocks, or row segments). A dense
    slice is copied, so the whole tensor is freed with the state dict; GGUF rows stay views of
    the memory-mapped file (only the pages a rank reads become resident)."""
    if isinstance(w, torch.Tensor):
        return w[start:end].clone() if (start, end) != (0, w.shape[0]) else w
    out, offset = [], 0
    for seg in segments(w):
        a, b = max(start, offset), min(end, offset + seg.out_features)
        if a < b:
            out.append(QuantizedWeight(seg.qtype, seg.data[a - offset : b - offset], seg.in_features))
        offset += seg.out_features
    return out[0] if len(out) == 1 else out


def _cols(w: Any, start: int, end: int, name: str) -> Any:
    """Input columns [start, end) of a weight; GGUF blocks are cut at block boundaries, or the
    weight falls back to its dequantized values when the cut is not aligned."""
    if isinstance(w, torch.Tensor):
        return w[:, start:end].contiguous()
    segs = segments(w)
    out = []
    for seg in segs:
        _, block, size = GGUF_TYPES[seg.qtype]
        if start % block or end % block:
            logger.warning("%s: tensor-parallel cut [%d, %d) is not on %s block boundaries (%d): kept dequantized",
                           name, start, end, seg.qtype, block)  # fmt: skip
            return dequantize(w)[:, start:end].contiguous()
        data = seg.data[:, start // block * size : end // block * size].contiguous()
        out.append(QuantizedWeight(seg.qtype, data, end - start))
    return out[0] if len(out) == 1 else out


def _row_align(w: Any) -> int:
    """The block size a row-parallel cut of this weight must respect."""
    if isinstance(w, torch.Tensor):
        return 1
    return max(GGUF_TYPES[s.qtype][1] for s in segments(w))


def _fused_rows(w: Any, parts: list[int], cuts: list[tuple[int, int]]) -> Any:
    """The rows [a, b) of each part of a weight fused by rows (part sizes ``parts``, cut
    ``cuts``), concatenated in the parts' order: Phi-3's [q; k; v] and [gate; up]."""
    out, offset = [], 0
    for size, (a, b) in zip(parts, cuts):
        out.append(_rows(w, offset + a, offset + b))
        offset += size
    return cat_rows(out)  # GGUF rows: one block tensor again (a copy of this rank's rows only)


def _width_cut(width: int, down: Any, tp_rank: int, tp: int) -> tuple[int, int]:
    """The rank's [start, end) of an MLP width, on the row-parallel ``down`` weight's block
    boundaries when they divide it evenly (``_cols`` dequantizes otherwise)."""
    align = _row_align(down) if down is not None else 1
    if width % (align * tp):
        align = 1
    return split_even(width, tp, align)[tp_rank]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_DOWN = re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$")


def shard_state(
    arch: ModelArch, state: dict[str, Any], tp_rank: int, tp: int, pp_rank: int, pp: int
) -> tuple[ModelArch, dict[str, Any]]:
    """The rank's architecture (its heads, MLP width, vocabulary rows and layers) and weights.

    Everything not listed is replicated (norms, q/k norms, RoPE tables). The returned arch is
    what the model is built from; the KV cache follows its ``num_kv_heads`` and layers.
    """
    check_supported(arch, tp, pp)
    heads = head_shards(arch.num_heads, arch.num_kv_heads, tp)[tp_rank]
    first, last = layer_ranges(arch.num_layers, pp)[pp_rank]
    hd = arch.head_dim
    inter = expert = None
    if tp > 1:
        dense_down = next((w for n, w in state.items() if n.endswith(".mlp.down_proj.weight")), None)
        inter = _width_cut(arch.intermediate_size, dense_down, tp_rank, tp)
        if arch.num_experts:
            expert_down = next((w for n, w in state.items() if _EXPERT_DOWN.search(n)), None)
            expert = _width_cut(arch.moe_intermediate_size, expert_down, tp_rank, tp)
    v0, v1 = vocab_range(arch.vocab_size, tp_rank, tp)
    out: dict[str, Any] = {}
    for name, w in state.items():
        m = _LAYER.match(name)
        if m is None:
            if tp > 1 and name in ("model.embed_tokens.weight", "lm_head.weight"):
                w = _rows(w, v0, v1)
            out[name] = w
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if not first <= layer < last:
            continue
        if tp > 1:
            if rest.startswith("self_attn.qkv_proj."):  # Phi-3: [q; k; v]
                q_size, kv_size = arch.num_heads * hd, arch.num_kv_heads * hd
                q, kv = (heads.q_start * hd, heads.q_end * hd), (heads.kv_start * hd, heads.kv_end * hd)
                w = _fused_rows(w, [q_size, kv_size, kv_size], [q, kv, kv])
            elif rest == "mlp.gate_up_proj.weight":  # Phi-3: [gate; up]
                w = _fused_rows(w, [arch.intermediate_size] * 2, [inter] * 2)
            elif rest.startswith("mlp.experts."):
                w = _shard_expert(rest, w, arch.moe_intermediate_size, expert, name)
            elif rest.startswith("self_attn.q_proj."):
                w = _rows(w, heads.q_start * hd, heads.q_end * hd)
            elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                w = _rows(w, heads.kv_start * hd, heads.kv_end * hd)
            elif rest == "self_attn.o_proj.weight":
                w = _cols(w, heads.q_start * hd, heads.q_end * hd, name)
            elif rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
                w = _rows(w, *inter)
            elif rest == "mlp.down_proj.weight":
                w = _cols(w, *inter, name)
            elif rest.endswith("_proj.bias") and rest.startswith(("self_attn.o_proj", "mlp.down_proj")):
                w = w if tp_rank == 0 else torch.zeros_like(w)  # a row-parallel bias is added once
        out[f"model.layers.{layer - first}.{rest}"] = w
    layer_types = arch.layer_types[first:last] if arch.layer_types is not None else None
    local = replace(
        arch,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        intermediate_size=(inter[1] - inter[0]) if inter is not None else arch.intermediate_size,
        moe_intermediate_size=(expert[1] - expert[0]) if expert is not None else arch.moe_intermediate_size,
        vocab_size=v1 - v0,
        num_layers=last - first,
        layer_types=layer_types,
    )  # head_dim (and so the attention scale) stays the model's
    return local, out


def _shard_expert(rest: str, w: Any, width: int, cut: tuple[int, int], name: str) -> Any:
    """One expert weight's rank slice: gate/up rows (column parallel) and down columns (row
    parallel) of the expert width; transformers 5's stacked 3-D ``gate_up_proj`` [E, 2I, H]
    and ``down_proj`` [E, H, I] are cut the same way along their expert-width axis."""
    a, b = cut
    if rest == "mlp.experts.gate_up_proj":
        return torch.cat([w[:, a:b], w[:, width + a : width + b]], dim=1)
    if rest == "mlp.experts.down_proj":
        return w[:, :, a:b].contiguous()
    m = _EXPERT.match(rest)
    if m is None:
        raise ValueError(f"tensor_parallel_size > 1: no sharding rule for expert weight {name}")
    return _cols(w, a, b, name) if m.group(1) == "down_proj" else _rows(w, a, b)
