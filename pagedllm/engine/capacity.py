"""Capacity planning: what a configuration holds, from the model's headers alone.

``pagedllm estimate`` and the engine's startup log print the same report, computed here:

- weight memory as the engine will hold it: read from the GGUF header or from config.json and
  the safetensors headers (no tensor data is read), following the loader's rules
  (``engine/startup.py``: an fp32 copy of quantized weights when ``dense_weights`` keeps one,
  stored as the native GEMM's 16-row panels; Q4_1/Q8_0 blocks regrouped for the small-batch
  kernel; other blocks read in place from the memory-mapped file; RoPE tables);
- the KV pool: bytes per token, blocks, tokens, how many requests of a given context length fit
  at once, and the longest context one request can reach.

The KV numbers are exactly the engine's (the same functions size its pool). The weight number
is an estimate of the same bookkeeping, within ~1% of what the engine's model holds (the
tests compare both on the default model and a tiny checkpoint).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.config import EngineConfig, matmul_dtype
from pagedllm.kv_cache.kv_cache_manager import max_blocks_held
from pagedllm.model.arch import ModelArch
from pagedllm.model.loader import ModelSource, resolve_model
from pagedllm.quantization.placement import decide as decide_placement
from pagedllm.scheduler.scheduler import max_request_tokens

GIB = 1 << 30
# The kernels' layouts (kernels/reference.py): 16-row panels and groups, 32-weight blocks.
_ROWS = 16
_GROUPED = {"Q4_1": 20, "Q8_0": 34}  # block bytes of the types with the tuned grouped kernel
_SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_HF_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight")
_QUANTIZATION_TYPES = {"int8": ("Q8_0", 34), "int4": ("Q4_1", 20)}


@dataclass
class TensorInfo:
    """One stored tensor: Hugging Face name, shape in torch order, and how it is stored."""

    name: str
    shape: tuple[int, ...]
    qtype: str | None  # a GGUF block type kept packed (Q4_1, Q6_K, ...), or None for a dense tensor
    nbytes: int  # as stored in the file

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class WeightMemory:
    """Bytes of the model's weights, by form. ``mapped`` are GGUF blocks read in place from the
    file (page cache, resident as they are touched); the rest is the engine's own memory."""

    file_bytes: int
    dense_copy: bool  # quantized weights also kept as fp32 (for big steps)
    reason: str
    parts: dict[str, int] = field(default_factory=dict)  # form -> bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def mapped(self) -> int:
        return self.parts.get("GGUF blocks (file-mapped)", 0)


@dataclass
class KVCapacity:
    block_size: int
    num_blocks: int
    block_bytes: int  # one pool block
    num_groups: int  # KV-cache groups (sliding windows); one block serves one group's layers
    num_layers: int
    kv_dtype: str
    max_model_len: int
    max_request_tokens: int  # the most tokens one request runs in a step (scheduler.max_request_tokens)
    windows: tuple[int | None, ...]
    context_len: int  # the context length the concurrency figure is for
    num_swap_blocks: int = 0  # the swap pool of preemption_mode="swap" (startup.kv_cache_sizes)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.block_bytes * self.num_groups // self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_tokens(self) -> int:
        """Tokens of every layer the pool holds (the startup log's figure)."""
        return self.num_blocks * self.block_size // self.num_groups

    def blocks_per_request(self, num_tokens: int) -> int:
        return max_blocks_held(self.windows, self.block_size, num_tokens, self.max_request_tokens)

    @property
    def max_concurrency(self) -> int:
        """Requests of ``context_len`` tokens whose blocks all fit in the pool at once."""
        return self.num_blocks // self.blocks_per_request(self.context_len)

    @property
    def longest_context(self) -> int:
        """The longest prompt + output one request can reach: ``max_model_len`` or the pool."""
        lo, hi = 0, self.max_model_len
        while lo < hi:  # the largest n with blocks_per_request(n) <= num_blocks
            mid = (lo + hi + 1) // 2
            if self.blocks_per_request(mid) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass
class CapacityReport:
    model: str
    architecture: str
    dtype: str
    weights: WeightMemory
    kv: KVCapacity
    replicas: int = 1  # data parallelism: each replica holds its own weights and KV pool
    # What runs beside the model, per replica (``beside_model``): LoRA slots and adapters, a
    # drafter's weights and KV pool. Worst cases: slots fill, pools are written.
    beside: dict[str, int] = field(default_factory=dict)

    @property
    def replica_bytes(self) -> int:
        """One replica's weights, KV pool and what runs beside them."""
        return self.weights.total + self.kv.pool_bytes + sum(self.beside.values())

    def to_dict(self) -> dict:
        """Plain numbers (``pagedllm estimate --json``)."""
        w, kv = self.weights, self.kv
        return {
            "model": self.model, "architecture": self.architecture, "dtype": self.dtype,
            "weights": {"file_bytes": w.file_bytes, "total_bytes": w.total, "dense_copy": w.dense_copy, "parts": dict(w.parts)},
            "kv_cache": {
                "dtype": kv.kv_dtype, "bytes_per_token": kv.bytes_per_token, "block_size": kv.block_size,
                "block_bytes": kv.block_bytes, "num_blocks": kv.num_blocks, "num_tokens": kv.num_tokens,
                "pool_bytes": kv.pool_bytes, "context_len": kv.context_len,
                "blocks_per_request": kv.blocks_per_request(kv.context_len), "max_concurrency": kv.max_concurrency,
                "longest_context": kv.longest_context, "max_model_len": kv.max_model_len,
            },
            "beside_model": dict(self.beside), "beside_model_bytes": sum(self.beside.values()),
            "data_parallel_size": self.replicas,
            "total_bytes_all_replicas": self.replicas * self.replica_bytes,
            "max_concurrency_all_replicas": self.replicas * kv.max_concurrency,
        }  # fmt: skip

    def lines(self) -> list[str]:
        """The report, one fact per line (``pagedllm estimate`` prints them; the engine logs them)."""
        w, kv = self.weights, self.kv
        forms = ", ".join(f"{name} {b / GIB:.3f}" for name, b in w.parts.items() if b)
        limit = "max_model_len" if kv.longest_context == kv.max_model_len else "the KV pool"
        return [
            f"model: {self.model} ({self.architecture}, {self.dtype}); weights on disk {w.file_bytes / GIB:.3f} GiB",
            f"weight memory: {w.total / GIB:.3f} GiB ({forms} GiB; fp32 copy: {'yes' if w.dense_copy else 'no'}, {w.reason})",
            f"KV cache: {kv.bytes_per_token} bytes per token ({kv.kv_dtype}, {kv.num_layers} layers), "
            f"block {kv.block_bytes} bytes = {kv.block_size} tokens"
            + (f" of one of {kv.num_groups} layer groups" if kv.num_groups > 1 else ""),
            f"KV pool: {kv.num_blocks} blocks = {kv.num_tokens} tokens, {kv.pool_bytes / GIB:.3f} GiB "
            "(reserved up front, committed as blocks are first written)",
            f"max concurrent requests at {kv.context_len} tokens each: {kv.max_concurrency} "
            f"({kv.blocks_per_request(kv.context_len)} blocks per request)",
            f"longest context: {kv.longest_context} tokens (limited by {limit})",
        ] + ([
            f"beside the model: {sum(self.beside.values()) / GIB:.3f} GiB at most ("
            + ", ".join(f"{name} {b / GIB:.3f}" for name, b in self.beside.items()) + " GiB)"
        ] if self.beside else []) + ([
            f"data parallel: {self.replicas} replicas, each with the memory above: "
            f"{self.replicas * self.replica_bytes / GIB:.3f} GiB in all, "
            f"{self.replicas * kv.max_concurrency} concurrent requests at {kv.context_len} tokens"
        ] if self.replicas > 1 else [])  # fmt: skip


# ------------------------------------------------------------------------- beside the model
def beside_model(config: EngineConfig, arch: ModelArch, max_model_len: int, kv: KVCapacity, native: bool) -> dict[str, int]:
    """Bytes of what runs beside the model, at most: LoRA's slots (lora/slots.py), their panels
    (made when a slot first runs) and the adapters kept loaded; a drafter's weights and its own
    KV pool (spec_decode/draft_cache.py: as many blocks as the target's, committed as written);
    the swap pool of ``preemption_mode="swap"`` when it is in memory (not a ``swap_path`` file)."""
    out: dict[str, int] = {}
    if kv.num_swap_blocks and not config.swap_path:
        out[f"swap pool ({config.swap_space:g} GiB)"] = kv.num_swap_blocks * kv.block_bytes
    if config.enable_lora:
        out.update(_lora_bytes(config, arch, native))
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":
        out.update(_drafter_bytes(config, arch, max_model_len, kv, native))
    return out


def _lora_linears(arch: ModelArch) -> list[tuple[int, int, list[int]]]:
    """Per adaptable linear of the model: (in, out, the out columns of each part an adapter
    may target separately), as ``SlotTable`` builds them."""
    q, kv, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    out = []
    for layer in range(arch.num_layers):
        out += [(hidden, q + 2 * kv, [q, kv, kv]), (q, hidden, [hidden])]
        if not arch.is_moe_layer(layer):
            inter = arch.intermediate_size
            out += [(hidden, 2 * inter, [inter, inter]), (inter, hidden, [hidden])]
    return out


def _lora_bytes(config: EngineConfig, arch: ModelArch, native: bool) -> dict[str, int]:
    n, r = config.max_loras, config.max_lora_rank
    slots = panels = adapter = 0
    for cin, cout, parts in _lora_linears(arch):
        width = r * len(parts)  # a slot's A columns / B rows: every part at the largest rank
        slots += n * (cin * width + width * cout) * 4
        if native:  # A^T and B^T as the dense GEMM's panels
            panels += n * (_panels(width, cin) + _panels(cout, width))
        adapter += sum(r * (cin + c) * 4 for c in parts)  # A [r, in] and B [out, r] per part
    cached = config.lora_cpu_capacity
    return {f"LoRA slots ({n} x rank {r})": slots, "LoRA slot panels": panels,
            f"LoRA adapters loaded (up to {cached})": cached * adapter}  # fmt: skip


def _draft_pool_bytes(config: EngineConfig, kv: KVCapacity, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype

    spec = resolve_kv_cache_dtype(config.kv_cache_dtype, config.torch_dtype)
    return 2 * num_layers * kv.num_blocks * kv.block_size * num_kv_heads * spec.bytes_per_token_head(head_dim)


def _drafter_bytes(config: EngineConfig, arch: ModelArch, max_model_len: int, kv: KVCapacity, native: bool) -> dict[str, int]:
    from dataclasses import replace

    spec = config.speculative_config
    if spec.method == "draft_model":
        try:
            draft_arch, tensors = read_tensors(resolve_model(spec.model))
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        draft_config = replace(config, model=spec.model, speculative_config=None, quantization=None)
        weights = estimate_weights(draft_config, draft_arch, tensors, max_model_len, native=native)
        pool = _draft_pool_bytes(config, kv, draft_arch.num_layers, draft_arch.num_kv_heads, draft_arch.head_dim)
        return {"draft model weights": weights.total, "draft model KV pool": pool}
    # EAGLE / Medusa heads: a few MB, loaded and packed as the proposer does to count them.
    from pagedllm.spec_decode.packed_linear import PackedLinear, pack_linears

    if spec.method == "eagle":
        from pagedllm.spec_decode.eagle import DEFAULT_EAGLE, EagleHead

        head = EagleHead.load(Path(spec.model or DEFAULT_EAGLE), arch.hidden_size, arch.vocab_size)
        pack_linears(head)
        c = head.config
        out = {"EAGLE head": _module_bytes(head), "EAGLE KV pool": _draft_pool_bytes(config, kv, 1, c.num_kv_heads, c.head_dim)}
    else:
        from pagedllm.spec_decode.medusa import DEFAULT_MEDUSA, MedusaHeads

        head = MedusaHeads.load(Path(spec.model or DEFAULT_MEDUSA), arch.hidden_size, arch.vocab_size)
        pack_linears(head)
        out = {"Medusa heads": _module_bytes(head)}
    if head.d2t is not None:  # the draft vocabulary's rows of the target's LM head
        rows = torch.empty(len(head.d2t), arch.hidden_size)
        out["draft LM-head rows"] = _grouped("Q8_0", *rows.shape) if PackedLinear.fits(rows) else rows.numel() * 4
    return out


def _module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every distinct storage a module's parameters, buffers and packed blocks live in."""
    from pagedllm.spec_decode.packed_linear import PackedLinear

    tensors = [*module.parameters(), *module.buffers()]
    for m in module.modules():
        if isinstance(m, PackedLinear):
            tensors += [t for t in (m.grouped, m.bias) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# ------------------------------------------------------------------------- reading headers
def read_tensors(source: ModelSource) -> tuple[ModelArch, list[TensorInfo]]:
    """Architecture and tensor table from the file headers; no weights are read."""
    if source.format == "gguf":
        return _gguf_tensors(source.path)
    return _hf_tensors(source.path)


def _gguf_tensors(path: Path) -> tuple[ModelArch, list[TensorInfo]]:
    from pagedllm.model.gguf_file import GGUFFile
    from pagedllm.model.gguf_loader import _ARCH_LAYER_TENSORS, _GLOBAL_TENSORS, _LAYER_TENSORS, PACKED_TYPES, read_gguf_arch

    try:
        reader = GGUFFile(path)  # the header only; tensor data stays an unread memory map
    except Exception as e:
        raise ValueError(f"could not read GGUF file {path}: {type(e).__name__}: {e}") from e
    arch = read_gguf_arch(reader, path)
    layer_tensors = _ARCH_LAYER_TENSORS.get(arch.architecture, _LAYER_TENSORS)
    out: list[TensorInfo] = []
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, suffix = t.name.split(".", 2)
            hf = f"model.layers.{layer}.{layer_tensors.get(suffix, suffix)}"
        else:
            hf = _GLOBAL_TENSORS.get(t.name, t.name)
        dims = tuple(int(d) for d in reversed(t.shape))  # torch order
        qtype = t.tensor_type.name if len(dims) in (2, 3) and t.tensor_type.name in PACKED_TYPES else None
        nbytes = int(t.data.nbytes)
        if "{e}" in hf:  # an expert stack: one matrix per expert
            for e in range(dims[0]):
                out.append(TensorInfo(hf.format(e=e), dims[1:], qtype, nbytes // dims[0]))
        else:
            out.append(TensorInfo(hf, dims, qtype, nbytes))
    return arch, out


_MAX_SAFETENSORS_HEADER = 100_000_000  # bytes: the safetensors format's own limit


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_SAFETENSORS_HEADER:
            raise ValueError(f"a header of {n} bytes (the format allows {_MAX_SAFETENSORS_HEADER})")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def _hf_tensors(path: Path) -> tuple[ModelArch, list[TensorInfo]]:
    from pagedllm.model.hf_loader import read_hf_config, weight_files

    _, arch = read_hf_config(path)
    out = []
    for f in weight_files(path):
        try:
            header = _safetensors_header(f)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                out.append(TensorInfo(name, tuple(info["shape"]), None, end - start))
        except (OSError, ValueError, TypeError, KeyError, struct.error) as e:
            raise ValueError(f"could not read the header of {f}: {e!r}") from e
    return arch, out


# ------------------------------------------------------------------------- weight memory
def _panels(rows: int, cols: int) -> int:
    return -(-rows // _ROWS) * _ROWS * cols * 4


def _grouped(qtype: str, rows: int, cols: int) -> int:
    return -(-rows // _ROWS) * _ROWS * (cols // 32) * _GROUPED[qtype]


def _fused(arch: ModelArch, tensors: dict[str, TensorInfo]) -> dict[str, list[TensorInfo]]:
    """The model's matrices as its layers hold them: q/k/v and gate/up fused (llama.py)."""
    left = dict(tensors)
    out: dict[str, list[TensorInfo]] = {}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for fused, parts in ((f"{p}self_attn.qkv_proj.weight", "qkv"), (f"{p}mlp.gate_up_proj.weight", ("gate", "up"))):
            kind = "self_attn" if parts == "qkv" else "mlp"
            names = [f"{p}{kind}.{x}_proj.weight" for x in parts]
            if all(n in left for n in names):
                out[fused] = [left.pop(n) for n in names]
        for e in range(arch.num_experts or 0):
            names = [f"{p}mlp.experts.{e}.{x}_proj.weight" for x in ("gate", "up")]
            if all(n in left for n in names):
                out[f"{p}mlp.experts.{e}.gate_up_proj.weight"] = [left.pop(n) for n in names]
    for name, t in left.items():
        out[name] = [t]
    return out


def estimate_weights(
    config: EngineConfig, arch: ModelArch, tensors: list[TensorInfo], max_model_len: int,
    dense: bool | None = None, native: bool = True,
) -> WeightMemory:  # fmt: skip
    """Bytes the engine's model will hold for these tensors (``engine/startup.py:load_model``).

    ``dense`` overrides the ``dense_weights`` decision (the engine passes the one it made);
    ``native`` is whether the C++ kernels are built (they enable panels and grouped blocks).
    """
    dtype = config.torch_dtype
    by_name = {t.name: t for t in tensors}
    if config.quantization is not None:  # the checkpoint's linears become GGUF blocks at load
        qtype, block = _QUANTIZATION_TYPES[config.quantization]
        for t in tensors:
            if len(t.shape) == 2 and _HF_LINEAR.fullmatch(t.name):
                by_name[t.name] = TensorInfo(t.name, t.shape, qtype, t.shape[0] * t.shape[1] // 32 * block)
    quant = [t for t in by_name.values() if t.qtype is not None]
    placement = decide_placement(
        config.dense_weights, sum(t.nbytes for t in quant), sum(4 * t.numel for t in quant), bool(quant)
    )
    keep_dense = placement.dense if dense is None else dense
    reason = placement.reason if dense is None else "as the engine decided"
    wide = matmul_dtype(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    fp32 = dtype == torch.float32
    parts = {"fp32 panels": 0, "dense tensors": 0, "GGUF blocks (grouped copy)": 0, "GGUF blocks (copied)": 0,
             "GGUF blocks (file-mapped)": 0, "RoPE tables": 0}  # fmt: skip
    # llama.cpp's llama/mistral files store Q/K rows permuted: the loader puts them back (a copy).
    permuted = arch.architecture in ("llama", "mistral")

    def copied(t: TensorInfo) -> bool:
        return permuted and (".q_proj." in t.name or ".k_proj." in t.name)

    def dense_matrix(rows: int, cols: int, head: bool = False) -> None:
        """A linear's dense weight: in the matmul dtype (the LM head in fp32, for fp32 logits),
        as the native GEMM's panels when that is fp32 and the kernels are built."""
        held = torch.float32 if head else wide
        if held == torch.float32 and native:
            parts["fp32 panels"] += _panels(rows, cols)
        else:
            parts["dense tensors"] += rows * cols * torch.empty((), dtype=held).element_size()

    def blocks_in_place(ts: list[TensorInfo]) -> None:
        for t in ts:
            parts["GGUF blocks (copied)" if copied(t) else "GGUF blocks (file-mapped)"] += t.nbytes

    matrices = _fused(arch, by_name)
    embed = by_name.get("model.embed_tokens.weight")
    tied = arch.tie_word_embeddings or "lm_head.weight" not in by_name
    packed_attach = keep_dense and fp32 and config.packed_weights and native and bool(quant)
    for name, ts in matrices.items():
        if name == "model.embed_tokens.weight":
            continue
        if name == "rope_freqs":  # folded into the RoPE tables
            continue
        if len(ts[0].shape) != 2:  # norms, biases
            parts["dense tensors"] += sum(t.numel for t in ts) * itemsize
            continue
        rows, cols = sum(t.shape[0] for t in ts), ts[0].shape[1]
        quantized = [t for t in ts if t.qtype is not None]
        if not quantized:
            dense_matrix(rows, cols, head=name == "lm_head.weight")
            continue
        if not keep_dense:  # the blocks are the layer's only form (segments kept, not copied)
            blocks_in_place(quantized)
            parts["GGUF blocks (copied)"] += sum(4 * t.numel for t in ts if t.qtype is None)
            continue
        dense_matrix(rows, cols, head=name == "lm_head.weight")
        if packed_attach and len(quantized) == len(ts):
            _attach(parts, ts, rows, cols, copied)
    # The embedding table, and a tied LM head (llama.py: from_hf_state_dict, attach_packed, pack_dense).
    if embed is not None:
        rows, cols = embed.shape
        if embed.qtype is not None and not keep_dense:
            parts["GGUF blocks (file-mapped)"] += embed.nbytes  # looked up in place; a tied head shares it
        elif embed.qtype is not None and packed_attach:
            parts["GGUF blocks (file-mapped)"] += embed.nbytes  # rows looked up in the blocks
            if tied:
                dense_matrix(rows, cols, head=True)
                _attach(parts, [embed], rows, cols, lambda t: False)
        else:
            parts["dense tensors"] += rows * cols * itemsize
            if tied and (native or not fp32):  # fp32: panels beside the shared table; else an fp32 copy
                dense_matrix(rows, cols, head=True)
    tables = 2 if arch.rope_local_theta is None else 4
    parts["RoPE tables"] += tables * max_model_len * arch.head_dim * 4
    file_bytes = sum(t.nbytes for t in tensors)
    return WeightMemory(file_bytes, keep_dense and bool(quant), reason, parts)


def _attach(parts: dict[str, int], ts: list[TensorInfo], rows: int, cols: int, copied) -> None:
    """A layer's GGUF blocks beside its fp32 copy (``attach_packed``): one Q4_1/Q8_0 type is
    regrouped for the tuned kernel; other blocks stay as row segments (merged parts copied)."""
    types = {t.qtype for t in ts}
    if len(types) == 1 and next(iter(types)) in _GROUPED:
        parts["GGUF blocks (grouped copy)"] += _grouped(next(iter(types)), rows, cols)
    elif len(ts) > 1 and len(types) == 1:
        parts["GGUF blocks (copied)"] += sum(t.nbytes for t in ts)
    else:
        for t in ts:
            parts["GGUF blocks (copied)" if copied(t) else "GGUF blocks (file-mapped)"] += t.nbytes


# ------------------------------------------------------------------------- the report
def kv_capacity(config: EngineConfig, arch: ModelArch, max_model_len: int, context_len: int | None = None) -> KVCapacity:
    """The KV pool the engine will allocate for ``config`` (``startup.kv_cache_sizes``)."""
    from pagedllm.attention.kv_cache_dtype import resolve_kv_cache_dtype
    from pagedllm.engine.startup import kv_cache_sizes

    sizes = kv_cache_sizes(config, arch)
    context = max_model_len if context_len is None else context_len
    if context < 1:
        raise ValueError(f"context_len must be a positive integer, got {context_len!r}")
    if context > max_model_len:  # no request can be that long: a concurrency figure for it would mislead
        raise ValueError(f"context_len ({context}) must be at most max_model_len ({max_model_len}); "
                         f"raise --max-model-len to plan for longer requests")  # fmt: skip
    return KVCapacity(
        config.block_size, sizes.num_blocks, sizes.block_bytes, len(sizes.layout.groups), arch.num_layers,
        resolve_kv_cache_dtype(config.kv_cache_dtype, config.torch_dtype).name, max_model_len,
        max_request_tokens(config.max_num_batched_tokens, config.long_prefill_token_threshold, config.num_speculative_tokens),
        sizes.layout.windows, context, sizes.num_swap_blocks,
    )  # fmt: skip


def estimate(config: EngineConfig, context_len: int | None = None, native: bool | None = None) -> CapacityReport:
    """``pagedllm estimate``: the whole report for ``config`` from the model's headers."""
    source = resolve_model(config.model)
    arch, tensors = read_tensors(source)
    if config.quantization is not None and source.format == "gguf":
        raise ValueError(f"quantization={config.quantization!r} is for Hugging Face checkpoints; a GGUF file is already quantized")
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:  # (the engine's refusals, before any report)
        from pagedllm.distributed.sharding import check_supported

        check_supported(arch, config.tensor_parallel_size, config.pipeline_parallel_size)
    from pagedllm.model.generation_config import read_generation_config

    read_generation_config(config.generation_config, source.path)  # (a missing or bad file: the engine's refusal)
    from pagedllm.engine.startup import resolve_max_model_len  # (the engine's rule: context, RoPE tables)

    max_model_len = resolve_max_model_len(config, arch)
    if native is None:
        from pagedllm.kernels.ops import native_available

        native = native_available()
    weights = estimate_weights(config, arch, tensors, max_model_len, native=native)
    kv = kv_capacity(config, arch, max_model_len, context_len)
    return CapacityReport(str(source.path), arch.architecture, str(config.torch_dtype).removeprefix("torch."), weights, kv,
                          replicas=config.data_parallel_size, beside=beside_model(config, arch, max_model_len, kv, native))


def startup_report(config: EngineConfig, source: ModelSource, max_model_len: int, dense: bool, native: bool) -> CapacityReport:
    """The report an engine logs at startup: its own model source, max_model_len and fp32-copy
    decision (``auto`` weighed the memory available when it loaded)."""
    arch, tensors = read_tensors(source)
    weights = estimate_weights(config, arch, tensors, max_model_len, dense=dense, native=native)
    kv = kv_capacity(config, arch, max_model_len)
    return CapacityReport(str(source.path), arch.architecture, str(config.torch_dtype).removeprefix("torch."), weights, kv,
                          beside=beside_model(config, arch, max_model_len, kv, native))
