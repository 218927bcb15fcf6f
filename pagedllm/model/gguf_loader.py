"""Read a GGUF file into Hugging Face-named tensors plus a ModelArch.

Weight matrices stay in their blocks as ``QuantizedWeight``s that point into the
memory-mapped file - no copy, so resident weight memory is the file's size; the engine then
decides against a memory budget whether to also dequantize them to fp32
(``quantization/placement.py``). Vectors (norms) are read as fp32. llama.cpp's converter permutes
the rows of the Q and K projections so that rotary pairs are adjacent (its "interleaved"
RoPE layout); our model uses the Hugging Face "rotate half" layout, so those rows are put
back here. Skipping that step gives a model that writes fluent nonsense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.kernels.gguf_ops import GGUF_TYPES
from pagedllm.model.gguf_file import GGUFFile
from pagedllm.model.arch import _ALIASES, FULL, SLIDING, SUPPORTED_ARCHITECTURES, ModelArch
from pagedllm.model.moe import GGUF_MOE_LAYER_TENSORS, gguf_moe_arch_fields
from pagedllm.quantization.weights import QuantizedWeight

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QWEN3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 2 and 3 name their four norms per layer after where they sit; llama.cpp's converter
# stores (1 + w), so the loader subtracts the 1 (as transformers does) and the model adds it
# back. Gemma 3 adds Qwen3's q/k norms.
_GEMMA2_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA3_LAYER_TENSORS = {**_QWEN3_LAYER_TENSORS, **_GEMMA2_LAYER_TENSORS}
# Phi-3 keeps its checkpoint's fusions: attn_qkv is [q; k; v] and ffn_up is [gate; up], the
# row order of our fused linears (the separate attn_q/k/v of the base table also load).
_PHI3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_ARCH_LAYER_TENSORS = {
    "gemma2": _GEMMA2_LAYER_TENSORS,
    "gemma3": _GEMMA3_LAYER_TENSORS,
    "phi3": _PHI3_LAYER_TENSORS,
    "qwen3": _QWEN3_LAYER_TENSORS,
    "qwen3_moe": {**_QWEN3_LAYER_TENSORS, **GGUF_MOE_LAYER_TENSORS},
}
# Families whose converter stores RMSNorm weights as (1 + w) (llama.cpp's Gemma converters).
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
# Only llama.cpp's "llama" converter permutes Q/K rows; the others keep the HF row order.
_PERMUTED_QK = ("llama", "mistral")
# transformers' Gemma3TextConfig defaults, which GGUF files do not carry.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62
# llama.cpp's Gemma 2 defaults for keys a file may lack: window, caps, every 2nd layer global.
_GEMMA2_SLIDING_WINDOW = 4096
_GEMMA2_ATTN_SOFTCAP = 50.0
_GEMMA2_FINAL_SOFTCAP = 30.0
_GEMMA2_SLIDING_PATTERN = 2
# Gemma 2 27B (46 layers) scales queries by (hidden / heads) ** -0.5, not head_dim ** -0.5 (its
# query_pre_attn_scalar, 144, is not its head_dim, 128); GGUF files do not store the scalar,
# and llama.cpp tells this model by its layer count, as here.
_GEMMA2_27B_LAYERS = 46
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for one projection (weight or bias).

    Within each head llama.cpp stores the rows as (pair index, 2) where Hugging Face stores
    (2, pair index): swap those two axes back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if rows % num_heads or head_dim % 2:  # (a file whose shapes do not fit its head count)
        raise ValueError(f"a q/k projection of {rows} rows does not split into {num_heads} heads of an even size")
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )


def _open(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:  # bad bytes fail in many ways (struct, numpy, mmap): one clear error
        raise ValueError(f"could not read GGUF file {path}: {type(e).__name__}: {e}") from e


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    if value is None:
        return default
    return value.tolist() if isinstance(value, np.ndarray) else value


@dataclass
class GGUFMeta:
    """An architecture's metadata in one GGUF file: ``meta(key, default)`` reads "{arch}.{key}"
    (a missing key without a default is a clear error); ``tensors`` holds every tensor name."""

    reader: Any
    arch: str
    path: Path
    tensors: set[str]

    def __call__(self, key: str, default: Any = None) -> Any:
        value = _field(self.reader, f"{self.arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks the metadata key {self.arch}.{key}")
        return value

    def unsupported(self, what: str) -> ValueError:
        return ValueError(f"GGUF file {self.path} ({self.arch}): {what} is not supported")


def _layer_types(meta: GGUFMeta, num_layers: int, every: int) -> list[str]:
    """Sliding and global layers, llama.cpp's rule: a per-layer list of flags in
    ``attention.sliding_window_pattern``, or a period n there (default ``every``) where the
    last layer of each n is global (0: every layer slides)."""
    pattern = meta("attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"GGUF file {meta.path}: sliding_window_pattern has {len(pattern)} entries for {num_layers} layers"
            )
        return [SLIDING if flag else FULL for flag in pattern]
    n = int(pattern)
    return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(num_layers)]


def _check_rope(meta: GGUFMeta, head_dim: int) -> None:
    """Every family here runs RoPE over the whole head, unscaled (Llama 3's frequency table comes
    as the rope_freqs tensor): refuse files that ask for more (linear / yarn scaling, e.g. Gemma 3
    4B-27B's linear factor 8; Phi-3's LongRoPE factor tables; Phi-4-mini's partial rotary)
    instead of running them with the wrong positions."""
    kind = meta("rope.scaling.type", "none")
    if kind != "none":
        raise meta.unsupported(f"rope scaling type {kind!r} (supported: none)")
    factors = sorted(n for n in meta.tensors if n.startswith("rope_factors_"))
    if factors:
        raise meta.unsupported(f"LongRoPE scaling ({', '.join(factors)})")
    rotary = int(meta("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise meta.unsupported(f"partial rotary embedding ({rotary} of {head_dim} head dims)")


def _phi3_fields(meta: GGUFMeta, base: dict[str, Any]) -> dict[str, Any]:
    """A sliding window (Phi-3-mini's 2047; 0 when the model has none) covers every layer, as
    transformers runs the checkpoint; llama.cpp currently ignores it."""
    window = int(meta("attention.sliding_window", 0))
    return dict(sliding_window=window or None, layer_types=[SLIDING] * base["num_layers"] if window else None)


def _gemma2_fields(meta: GGUFMeta, base: dict[str, Any]) -> dict[str, Any]:
    """GeGLU, alternating sliding / global layers, soft-caps, and the query scale llama.cpp
    uses (the file carries no query_pre_attn_scalar)."""
    num_layers = base["num_layers"]
    big = num_layers == _GEMMA2_27B_LAYERS
    return dict(
        hidden_act="gelu_tanh",
        sliding_window=int(meta("attention.sliding_window", _GEMMA2_SLIDING_WINDOW)),
        layer_types=_layer_types(meta, num_layers, _GEMMA2_SLIDING_PATTERN),
        query_pre_attn_scalar=base["hidden_size"] // base["num_heads"] if big else base["head_dim"],
        attn_logit_softcapping=float(meta("attn_logit_softcapping", _GEMMA2_ATTN_SOFTCAP)) or None,
        final_logit_softcapping=float(meta("final_logit_softcapping", _GEMMA2_FINAL_SOFTCAP)) or None,
    )


def _gemma3_fields(meta: GGUFMeta, base: dict[str, Any]) -> dict[str, Any]:
    """The query scale is llama.cpp's too: head_dim ** -0.5 (the query_pre_attn_scalar of 270M
    to 12B, all 256), but (hidden / heads) ** -0.5 for 27B (168), told by its layer count."""
    big = base["num_layers"] == _GEMMA3_27B_LAYERS
    return dict(
        hidden_act="gelu_tanh",
        sliding_window=int(meta("attention.sliding_window")),
        layer_types=_layer_types(meta, base["num_layers"], _GEMMA3_SLIDING_PATTERN),
        rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=base["hidden_size"] // base["num_heads"] if big else base["head_dim"],
    )


# What an architecture adds to the common ModelArch fields, read from its own metadata keys.
_ARCH_FIELDS: dict[str, Callable[[GGUFMeta, dict[str, Any]], dict[str, Any]]] = {
    "phi3": _phi3_fields,
    "gemma2": _gemma2_fields,
    "gemma3": _gemma3_fields,
    "qwen3_moe": lambda meta, base: gguf_moe_arch_fields(meta),
}


def read_gguf_arch(reader: Any, path: Path) -> ModelArch:
    arch = _field(reader, "general.architecture")
    family = _ALIASES.get(arch, arch)
    if family not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} in {path}; pagedllm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    meta = GGUFMeta(reader, arch, path, names)
    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", 0) or (len(tokens) if tokens else 0))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    base: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", 0) or hidden // max(num_heads, 1)),  # (0: refused)
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    _check_rope(meta, base["head_dim"])
    fields = _ARCH_FIELDS.get(family)
    return ModelArch(**base, **(fields(meta, base) if fields else {}))


# Block types the native kernels read directly (kernels/gguf_ops.py; Q4_1 and Q8_0 also have
# the tuned grouped small-batch kernels). F32 matrices are simply kept dense.
PACKED_TYPES = tuple(t for t in GGUF_TYPES if t != "F32")


def _is_packable(t: Any) -> bool:
    """A weight matrix, or a stack of them (a mixture of experts' [E, rows, cols])."""
    return len(t.shape) in (2, 3) and t.tensor_type.name in PACKED_TYPES


def _raw_rows(t: Any) -> np.ndarray:
    """The tensor's bytes as [rows, row_bytes] uint8 (all matrices of a stack, one after the
    other), a view of the memory-mapped file."""
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    return np.asarray(t.data).view(np.uint8).reshape(rows, -1)


def _from_mapped(array: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only memory map, without a copy: weights are never written."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(array)


def load_gguf(path: Path) -> tuple[ModelArch, dict[str, Any]]:
    """Return the architecture and a Hugging Face-named state dict: weight matrices of the
    ``PACKED_TYPES`` as ``QuantizedWeight``s over the memory-mapped file (Q/K rows of llama
    files put back in Hugging Face order, which copies those two), everything else fp32."""
    from gguf.quants import dequantize

    reader = _open(path)
    arch = read_gguf_arch(reader, path)
    state: dict[str, Any] = {}
    layer_tensors = _ARCH_LAYER_TENSORS.get(arch.architecture, _LAYER_TENSORS)
    permuted = arch.architecture in _PERMUTED_QK
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            _, layer, suffix = name.split(".", 2)
            hf = layer_tensors.get(suffix)
            if hf is None:
                raise ValueError(f"unexpected tensor {name!r} in GGUF file {path}")
            hf = f"model.layers.{layer}.{hf}"
        else:
            hf = _GLOBAL_TENSORS.get(name)
            if hf is None:
                raise ValueError(f"unexpected tensor {name!r} in GGUF file {path}")
        heads = None
        if permuted:
            heads = arch.num_heads if ".q_proj." in hf else arch.num_kv_heads if ".k_proj." in hf else None
        if _is_packable(t):
            blocks = _raw_rows(t)
            if heads is not None:
                blocks = unpermute_qk(torch.from_numpy(np.array(blocks)), heads)
            else:
                blocks = _from_mapped(blocks)
            if "{e}" in hf:  # an expert stack: one weight per expert, views of the stack's rows
                per = int(t.shape[1])
                for e in range(int(t.shape[2])):
                    state[hf.format(e=e)] = QuantizedWeight(t.tensor_type.name, blocks[e * per : (e + 1) * per], int(t.shape[0]))
                continue
            state[hf] = QuantizedWeight(t.tensor_type.name, blocks, int(t.shape[0]))
            continue
        try:
            array = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(f"could not dequantize tensor {name!r} of {path}: {e}") from e
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # unquantized tensors are views of the read-only file map
            array = array.copy()
        tensor = torch.from_numpy(array)
        if "{e}" in hf:  # an F32 expert stack
            for e in range(tensor.shape[0]):
                state[hf.format(e=e)] = tensor[e].contiguous()
            continue
        if arch.architecture in _NORMS_PLUS_ONE and hf.endswith("norm.weight"):
            tensor = tensor - 1.0
        if heads is not None:
            tensor = unpermute_qk(tensor, heads)
        state[hf] = tensor
    return arch, state
