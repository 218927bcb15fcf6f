"""What an engine needs before it wires its parts: the loaded model and the KV pool's size.

Both are plain functions of the config, so other tools (capacity planning, a worker process
holding a model shard) can call them without building an engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedllm.config import DEFAULT_KV_CACHE_SPACE_GIB, EngineConfig
from pagedllm.kernels.ops import native_available
from pagedllm.kv_cache.groups import KVCacheLayout
from pagedllm.memory import drop_file_pages, physical_memory_bytes, trim_heap
from pagedllm.model.arch import ModelArch
from pagedllm.model.generation_config import GenerationDefaults, read_generation_config
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.registry import model_class
from pagedllm.model.weight_arena import gather_packed
from pagedllm.model.loader import ModelSource, load_weights, resolve_model
from pagedllm.quantization import int8_activations
from pagedllm.quantization.int8_activations import log_report as log_int8_report
from pagedllm.quantization.placement import choose as choose_placement
from pagedllm.quantization.placement import log_placement
from pagedllm.quantization.weights import QuantizedWeight
from pagedllm.runner.model_runner import kv_block_bytes, kv_cache_layout
from pagedllm.tokenizer import load_tokenizer

logger = logging.getLogger("pagedllm.engine")


@dataclass
class StartupTimes:
    """Seconds per startup phase, in order, for the "engine ready" log line: where startup goes
    is then visible on every run, not only under a profiler."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def describe(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())


@dataclass
class LoadedModel:
    source: ModelSource
    arch: ModelArch
    model: LlamaForCausalLM
    tokenizer: Any | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    times: StartupTimes
    dense_copy: bool = True  # quantized weights also kept as fp32 (placement's decision)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json


@dataclass
class KVCacheSizes:
    block_bytes: int  # one block across the layers of a KV-cache group (all layers without sliding ones)
    num_blocks: int
    num_swap_blocks: int
    layout: KVCacheLayout


def load_model(config: EngineConfig, shard: Callable[[ModelArch, dict], tuple[ModelArch, dict]] | None = None,
               tokenizer: bool = True, trim: Callable[[torch.nn.Module], None] | None = None) -> LoadedModel:  # fmt: skip
    """Weights (dense, plus GGUF blocks / native panels where they serve), tokenizer, EOS ids.

    ``shard``: a worker's cut of the loaded state dict (distributed/sharding.py): the model is
    built from the slice only, so the rank never holds (or converts) the others' weights; the
    returned ``arch`` stays the whole model's, ``model.arch`` is the shard's. ``trim``: drops
    the modules the rank never runs (a pipeline stage's embedding or LM head) once the model
    is built, before its GGUF blocks are gathered into one buffer.
    """
    times = StartupTimes()
    with times.phase("weights"):
        source = resolve_model(config.model)
        arch, state = load_weights(source, config.quantization)
    model_arch = arch
    if shard is not None:
        model_arch, state = shard(arch, state)
    max_model_len = resolve_max_model_len(config, arch)
    dtype = config.torch_dtype
    placement = choose_placement(config.dense_weights, state)
    log_placement(placement)
    packed: dict[str, tuple[str, torch.Tensor]] = {}
    with times.phase("kernels"):  # built once per machine and CPU, then loaded from the cache
        native_available()
    if placement.dense:  # fp32 values for the dense GEMMs; the blocks stay for small steps
        with times.phase("fp32 copy"):
            for name, weight in state.items():
                if isinstance(weight, QuantizedWeight):
                    packed[name] = (weight.qtype, weight.data)
                    state[name] = weight.dequantize()
    with times.phase("model"):
        model = model_class(arch).from_hf_state_dict(model_arch, state, dtype, max_model_len)
        del state
    with times.phase("panels"):
        if config.packed_weights and packed and native_available():
            if dtype == torch.float32:
                n = model.attach_packed(packed)
                logger.info("%d linear layers also keep their GGUF blocks for small batches", n)
            else:  # the blocks' values are not rounded to bf16: they would change answers
                logger.info("packed GGUF weights serve float32 models only; %s uses dense weights", dtype)
        del packed
        n = model.pack_dense()  # each layer checks it can (fp32 on CPU, kernels built)
        if trim is not None:
            trim(model)
    if n:
        logger.info("%d fp32 linear layers run the native dense GEMM for bigger steps", n)
    if config.activation_dtype in ("int8", "int16"):  # the opt-in fast modes; layers they cannot take stay as above
        with times.phase("int8 panels"):
            bits = int(config.activation_dtype.removeprefix("int"))
            log_int8_report(int8_activations.convert_model(model, bits=bits))
    # Last, so only the blocks that stay are copied (int8 activations release the ones they take).
    with times.phase("panels"):
        moved = gather_packed(model)  # the blocks small steps stream, in one huge-page buffer
    if moved:
        logger.info("GGUF blocks for small steps: %.1f MiB in one huge-page buffer, in layer order", moved / (1 << 20))
    tok, eos, generation = None, frozenset(arch.eos_token_ids), GenerationDefaults()
    if tokenizer:
        with times.phase("tokenizer"):
            generation = read_generation_config(config.generation_config, source.path)
            tok, eos = load_tokenizer_and_eos(source, arch)
    # What loading left resident for nothing (memory.py): the weight files' pages it read and
    # the heap's freed copies.
    drop_file_pages(source.weight_files())
    trim_heap()
    return LoadedModel(source, arch, model, tok, eos, max_model_len, times, placement.dense, generation)


def load_tokenizer_and_eos(source: ModelSource, arch: ModelArch) -> tuple[Any | None, frozenset[int]]:
    """The tokenizer and the model's EOS ids: the config's and the tokenizer's (those that only
    generation_config.json lists are stop ids of each request: ``LLMEngine.add_request``)."""
    tokenizer = load_tokenizer(source)
    eos = set(arch.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return tokenizer, frozenset(eos)


@dataclass
class ModelInfo:
    """What the engine core needs of a model it does not run itself (the workers do)."""

    source: ModelSource
    arch: ModelArch
    tokenizer: Any | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    times: StartupTimes
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)


def load_model_info(config: EngineConfig) -> ModelInfo:
    """Architecture (from the file's headers: no weights are read), tokenizer and EOS ids."""
    from pagedllm.engine.capacity import read_tensors

    times = StartupTimes()
    with times.phase("tokenizer"):
        source = resolve_model(config.model)
        arch, _ = read_tensors(source)
        generation = read_generation_config(config.generation_config, source.path)
        tokenizer, eos = load_tokenizer_and_eos(source, arch)
    return ModelInfo(source, arch, tokenizer, eos, resolve_max_model_len(config, arch), times, generation)


def resolve_max_model_len(config: EngineConfig, arch: ModelArch) -> int:
    """``max_model_len``, else the model's context; ValueError if it exceeds the context, or if
    its RoPE tables (fp32 cos and sin per position) would not fit in this machine's memory: a
    file declaring a context of 10^9 tokens asked for 32 GB before anything was checked."""
    max_model_len = config.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context ({arch.max_position_embeddings})")
    tables = (2 if arch.rope_local_theta is not None else 1) * 2 * max_model_len * arch.head_dim * 4
    ram = physical_memory_bytes()
    if ram is not None and tables > ram // 4:
        raise ValueError(f"a context of {max_model_len} tokens needs {tables / 2**30:.1f} GiB of RoPE tables, over a quarter "
                         f"of this machine's {ram / 2**30:.1f} GiB; pass a smaller max_model_len (--max-model-len)")  # fmt: skip
    return max_model_len


def load_draft_model(config: EngineConfig, max_model_len: int, vocab_size: int) -> LlamaForCausalLM:
    """The draft model of ``speculative_config`` (method draft_model): loaded as the target is
    (same dtype, packed blocks, panels), for the target's context, with the target's vocabulary."""
    spec = config.speculative_config
    draft_config = replace(config, model=spec.model, max_model_len=max_model_len, speculative_config=None,
                           quantization=None)  # fmt: skip
    try:
        draft = load_model(draft_config, tokenizer=False)  # (the target's tokenizer serves; its EOS ids too)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if draft.arch.vocab_size != vocab_size:
        raise ValueError(f"speculative_config.model has a vocabulary of {draft.arch.vocab_size} tokens; "
                         f"the target's has {vocab_size}: a draft must share the target's tokenizer")  # fmt: skip
    logger.info("draft model %s: %d layers, hidden size %d", draft.source.path, draft.arch.num_layers, draft.arch.hidden_size)
    return draft.model


MAX_POOL_OVER_RAM = 2  # pools committed on first write may exceed RAM; this many times over it is a mistake


def kv_cache_sizes(config: EngineConfig, arch: ModelArch) -> KVCacheSizes:
    """Blocks in the KV pool (``num_kv_blocks``, else what ``kv_cache_space`` GiB holds) and in
    the swap pool (``swap_space`` GiB, with ``preemption_mode="swap"``). With sliding-window
    layers a block holds the K/V of one KV-cache group's layers (kv_cache/groups.py), so the
    same space holds more, smaller blocks, shared by all groups."""
    layout = kv_cache_layout(arch)
    block_bytes = kv_block_bytes(arch, config.block_size, config.torch_dtype, config.kv_cache_dtype)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        space = config.kv_cache_space or DEFAULT_KV_CACHE_SPACE_GIB
        num_blocks = int(space * (1 << 30) // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_space {space} GiB holds no block of {block_bytes} bytes")
    num_swap = int(config.swap_space * (1 << 30) // block_bytes) if config.preemption_mode == "swap" else 0
    # The pools are reserved, their pages committed as blocks are first written, so they may
    # exceed what is free, even the machine's memory; far beyond it they are a mistake (and
    # every block is a Python object: 10^8 of them took minutes and many GB before anything
    # failed). Counted per node (tensor parallelism over nodes splits the pool); a swap pool in
    # a file (swap_path) lives on disk.
    in_ram = num_blocks + (0 if config.swap_path else num_swap)
    per_node = in_ram * block_bytes / max(1, config.nnodes)
    ram = physical_memory_bytes()
    if ram is not None and per_node > MAX_POOL_OVER_RAM * ram:
        what = "the KV pool" + (" and the swap pool" if in_ram > num_blocks else "")
        raise ValueError(f"{what} would take {per_node / 2**30:.1f} GiB per node, over {MAX_POOL_OVER_RAM}x this machine's "
                         f"{ram / 2**30:.1f} GiB; lower kv_cache_space / num_kv_blocks / swap_space")  # fmt: skip
    return KVCacheSizes(block_bytes, num_blocks, num_swap, layout)
