"""Engine configuration: plain dataclasses, validated once, printed at startup."""

from __future__ import annotations

import functools
import os
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from pagedllm.checks import check_bools, is_int, is_number

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}

# "auto" is float32 on every CPU: the exact mode (greedy tokens equal transformers' fp32, logits
# independent of the batch) is the default, and bfloat16 is an opt-in fast mode. On an AMD EPYC
# Zen 4 with native bf16 (AVX512-BF16) the fp32 engine is also the faster one for the default
# model: W2 8.7 against 31.5 ms per token, because the packed GGUF kernels and the one-call
# decoder stack are fp32-only. The resolved dtype is logged.
DEFAULT_DTYPE = "auto"
# vLLM's --kv-cache-dtype values; "auto" = the model's dtype (exact). The others trade accuracy
# for bytes: see attention/kv_cache_dtype.py and docs/kv_cache_dtype.md.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8_e4m3")
KV_CACHE_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3"}
# What the linears multiply: float32 (exact: the dequantized weights times fp32 activations), or
# int8 - the opt-in fast mode, activations quantized per 32-wide block for GGUF Q4_0/Q4_1/Q8_0
# weights (quantization/int8_activations.py, docs/quantization.md).
ACTIVATION_DTYPES = ("float32", "int8", "int16")
# Like vLLM's VLLM_CPU_KVCACHE_SPACE default.
DEFAULT_KV_CACHE_SPACE_GIB = 4.0


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cache_dir() -> Path:
    """Where built artefacts are kept (tokenizers built from GGUF, compiled kernels):
    ``$PAGEDLLM_CACHE_DIR``, default ~/.cache/pagedllm."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm")


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a model of ``dtype`` multiplies its weights in.

    A bf16 model keeps bf16 values everywhere (weights, activations between ops, KV cache),
    but on a CPU without bf16 arithmetic torch emulates bf16 matmuls at a sixth of fp32 speed
    (2048 x 576 x 1536: 241 vs 39 ms here). There the linears multiply the same bf16 values in
    fp32 and round the result to bf16, which is what a native bf16 matmul computes too (fp32
    accumulation) up to summation order. ``PAGEDLLM_BF16_MATMUL=bf16|fp32`` overrides.
    """
    if dtype != torch.bfloat16:
        return dtype
    choice = os.environ.get("PAGEDLLM_BF16_MATMUL", "auto").lower()
    if choice not in ("auto", "bf16", "fp32"):
        raise ValueError(f"PAGEDLLM_BF16_MATMUL must be auto, bf16 or fp32, got {choice!r}")
    if choice == "auto":
        choice = "bf16" if cpu_has_native_bf16() else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name == "auto":
        name = "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, got {dtype!r}")
    return _DTYPES[name]


def _parse_json_config(cls: type, value: Any, name: str) -> Any:
    """A config dataclass from a dict, a JSON string (the CLI's) or an instance; None stays None.
    Errors name ``name`` (the engine argument) and any unknown key."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**value)


# Speculative decoding: vLLM's ``speculative_config`` shape (the work is in spec_decode/).
SPEC_METHODS = ("ngram", "draft_model", "eagle", "medusa")


MAX_LORA_RANK = 512  # vLLM's largest; the slots of every adapter rank are allocated when the engine starts
MAX_PROMPT_LOOKUP = 64  # longest prompt_lookup_max: a match longer than this predicts no better


@dataclass(frozen=True)
class SpeculativeConfig:
    # None: "draft_model" when ``model`` is given, else "ngram" (vLLM infers it the same way).
    method: str | None = None
    num_speculative_tokens: int = 3
    # draft_model: the draft's weights (a .gguf file or a Hugging Face directory; it must share
    # the target's vocabulary). medusa / eagle: a directory of trained heads (``pagedllm
    # train-draft-head``); None = the heads shipped for the default model.
    model: str | None = None
    # n-gram (prompt lookup): match the last n tokens, n from max down to min, in the request's
    # own prompt + output; the tokens that followed the latest earlier match are the draft.
    # min 2: a lone repeated token ("the", ",") predicts little, and its rejected drafts made
    # the draft-length policy stop drafting where longer matches would pay (docs/speculative_decoding.md).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No drafts while this many requests or more run: a big batch is compute-bound already,
    # verifying k extra tokens per request would cost more than it saves (vLLM's name).
    disable_by_batch_size: int = 8
    # Draft each request only as many tokens (0..num_speculative_tokens) as its acceptance rate
    # so far pays for, given the method's cost (spec_decode/draft_length.py); False: always draft
    # num_speculative_tokens, pausing only after wholly rejected drafts.
    auto_length: bool = True

    def __post_init__(self) -> None:
        check_bools(self, ("auto_length",), prefix="speculative_config.")
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")  # frozen
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise ValueError(f"speculative_config.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, got {self.prompt_lookup_max}")
        # Settings the method would not use are refused rather than ignored.
        if self.model is not None and self.method == "ngram":
            raise ValueError("speculative_config.model is not used by method 'ngram' (prompt lookup needs no model)")
        if self.model == "":
            raise ValueError("speculative_config.model must be a path (or left out for the shipped heads)")
        lookup = ("prompt_lookup_min", "prompt_lookup_max")
        if self.method != "ngram" and any(getattr(self, f) != self.__dataclass_fields__[f].default for f in lookup):
            raise ValueError(f"speculative_config.prompt_lookup_min/max apply only to method 'ngram', not {self.method!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config.model (the draft model's path) is required with method 'draft_model'")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path, got {self.model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a dict, a JSON string (the CLI's) or an instance; None stays None."""
        return _parse_json_config(cls, value, "speculative_config")


# KV connector (vLLM's ``kv_transfer_config`` shape; the work is in kv_connector/).
KV_CONNECTORS = ("disk",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_STORE_MAX_BYTES = 16 << 30


@dataclass(frozen=True)
class KVTransferConfig:
    """Move KV blocks out of and into the engine by content hash (kv_connector/).

    ``kv_role``: a producer saves the full blocks it computes, a consumer loads the blocks it
    finds, ``kv_both`` does both (a prefix cache that survives restarts, shared by replicas).
    ``path``: the store's directory (the disk connector); ``max_bytes``: its size cap, least
    recently used blocks evicted first.
    """

    kv_connector: str = "disk"
    kv_role: str = "kv_both"
    path: str | None = None
    max_bytes: int = DEFAULT_KV_STORE_MAX_BYTES
    # A producer answers a request only once its blocks are in the store (so a consumer asked
    # next finds them); None = on for kv_producer, off otherwise.
    wait_for_save: bool | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"kv_transfer_config.path must name the store's directory, got {self.path!r}")
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1:
            raise ValueError(f"kv_transfer_config.max_bytes must be a positive integer, got {self.max_bytes!r}")
        if self.wait_for_save is not None and not isinstance(self.wait_for_save, bool):
            raise ValueError(f"kv_transfer_config.wait_for_save must be true, false or null, got {self.wait_for_save!r}")

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def holds_outputs(self) -> bool:
        """Whether a finished request's last output waits for its saves."""
        return self.kv_role == "kv_producer" if self.wait_for_save is None else self.wait_for_save and self.saves

    @classmethod
    def parse(cls, value: "KVTransferConfig | dict[str, Any] | str | None") -> "KVTransferConfig | None":
        """From a dict, a JSON string (the CLI's) or an instance; None stays None."""
        return _parse_json_config(cls, value, "kv_transfer_config")


@dataclass
class EngineConfig:
    """Everything the engine needs to start. ``None`` means "derive it when the engine starts"
    (``max_model_len`` from the model, the number of KV blocks from ``kv_cache_space``: see
    ``engine/startup.py``); ``dtype="auto"`` resolves per ``resolve_dtype``."""

    model: str | None = None
    dtype: str = DEFAULT_DTYPE
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_space: float | None = None  # GiB
    num_kv_blocks: int | None = None
    seed: int = 0
    attention_backend: str = "auto"  # auto | cpu_native | torch_sdpa | reference
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16 | float16 | int8 | fp8_e4m3
    activation_dtype: str = "float32"  # float32 (exact) | int8 / int16 (fast modes: integer dot products)
    packed_weights: bool = True  # GGUF models: small batches read the quantized blocks directly
    # Quantized models: also keep an fp32 copy of the weights for big steps? auto | yes | no
    # (auto: when it takes at most a third of the available memory; quantization/placement.py)
    dense_weights: str = "auto"
    quantization: str | None = None  # Hugging Face checkpoints: int8 | int4 weight-only, at load
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0 = no cap on one request's prefill chunk per step
    scheduling_policy: str = "fcfs"  # or "priority"
    preemption_mode: str = "recompute"  # or "swap"
    swap_space: float = 4.0  # GiB of secondary KV pool, used with preemption_mode="swap"
    swap_path: str | None = None  # back the swap pool with this memory-mapped file instead of RAM
    # Speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": 3, ...}
    # (a dict, a JSON string or a SpeculativeConfig, parsed into the latter). None = off.
    speculative_config: Any = None
    # KV connector, vLLM's shape: {"kv_connector": "disk", "kv_role": "kv_both", "path": ...}
    # (a dict, a JSON string or a KVTransferConfig, parsed into the latter). None = off.
    kv_transfer_config: Any = None
    # Multi-LoRA serving (pagedllm/lora/, docs/lora.md): requests may name a PEFT adapter. At
    # most max_loras distinct adapters run at once (one slot each, preallocated for rank
    # max_lora_rank); up to max_cpu_loras (default: max_loras) stay loaded in an LRU.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Parallelism (pagedllm/executor/, pagedllm/distributed/, docs/parallelism.md): attention
    # heads, MLP width and vocabulary split over tensor_parallel_size ranks, layers over
    # pipeline_parallel_size stages; world = tp x pp worker processes over torch.distributed.
    # Both 1 (default): the model runs in the engine's process, as before.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Multi-node (env:// style rendezvous, as torchrun): the world's ranks are spread evenly
    # over nnodes; node node_rank runs ranks node_rank * (world / nnodes) onwards. master_addr /
    # master_port: torch.distributed's rendezvous (rank 0's node); the engine's control
    # channel listens on master_port + 1. None = a free port (single node only).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Data parallelism (pagedllm/data_parallel/, docs/parallelism.md): this many engine replicas,
    # each its own process with its own model copy and KV pool (kv_cache_space is per replica),
    # behind one API server's load balancer. 1 = the engine runs in the server's own process.
    data_parallel_size: int = 1
    # The checkpoint's generation_config.json (model/generation_config.py), as vLLM: "auto"
    # (its recommended sampling is the default of requests that leave it out, its eos ids end
    # replies), "vllm" (only its eos ids), or a directory holding such a file.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        # ("false" would read as true: prefix caching or LoRA on when asked off)
        check_bools(self, ("packed_weights", "enable_prefix_caching", "enable_lora"))
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if not is_int(self.seed) or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.kv_cache_space is not None and not (is_number(self.kv_cache_space) and self.kv_cache_space > 0):
            raise ValueError(f"kv_cache_space must be positive (GiB), got {self.kv_cache_space!r}")
        if not is_int(self.long_prefill_token_threshold) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not (is_number(self.swap_space) and self.swap_space > 0):
            raise ValueError(f"swap_space must be positive (GiB), got {self.swap_space!r}")
        if self.dense_weights not in ("auto", "yes", "no"):
            raise ValueError(f"dense_weights must be auto, yes or no, got {self.dense_weights!r}")
        if self.quantization is not None and self.quantization not in ("int8", "int4"):
            raise ValueError(f"quantization must be int8 or int4 (or None), got {self.quantization!r}")
        kv = KV_CACHE_DTYPE_ALIASES.get(str(self.kv_cache_dtype).lower(), str(self.kv_cache_dtype).lower())
        if not isinstance(self.kv_cache_dtype, str) or kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype must be one of {', '.join(ACTIVATION_DTYPES)}, got {self.activation_dtype!r}")
        if self.num_kv_blocks is not None and (not is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None and self.preemption_mode != "recompute":
            # A request admitted with loaded blocks and swapped out in the same step would save
            # its blocks before they are loaded; recompute gets them back from the store.
            raise ValueError("kv_transfer_config needs preemption_mode='recompute'")
        for name in ("max_loras", "max_lora_rank", "data_parallel_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:  # (each slot holds max_lora_rank x hidden per linear, allocated up front)
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK} (vLLM's largest), got {self.max_lora_rank}")
        if self.swap_path is not None:
            if not isinstance(self.swap_path, str) or not self.swap_path:
                raise ValueError(f"swap_path must be a file path (str), got {self.swap_path!r}")
            if self.preemption_mode != "swap":
                raise ValueError("swap_path needs preemption_mode='swap' (the swap pool it backs)")
            parent = os.path.dirname(os.path.abspath(self.swap_path))
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
                raise ValueError(f"swap_path {self.swap_path!r}: no writable directory {parent!r}")
        if self.max_cpu_loras is not None and (not is_int(self.max_cpu_loras) or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")

        if self.kv_transfer_config is not None and self.enable_lora:
            # The store's blocks are keyed without the adapter yet: never mix them up.
            raise ValueError("kv_transfer_config cannot be combined with enable_lora yet")
        self._check_parallel()

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size x pipeline_parallel_size "
                             f"({self.world_size})")  # fmt: skip
        if self.master_port is not None and (not is_int(self.master_port) or not 0 < self.master_port < 65535):
            raise ValueError(f"master_port must be a TCP port below 65535, got {self.master_port!r}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port is required with nnodes > 1 (every node must find the same rendezvous)")
        if self.world_size > 1:
            # Each of these keeps per-rank state the workers do not share yet.
            for name, on in (("enable_lora", self.enable_lora), ("speculative_config", self.speculative_config),
                             ("kv_transfer_config", self.kv_transfer_config)):  # fmt: skip
                if on:
                    raise ValueError(f"{name} is not supported with tensor_parallel_size x pipeline_parallel_size > 1 yet")
            if self.activation_dtype != "float32":
                raise ValueError(f"activation_dtype={self.activation_dtype} is not supported with tensor_parallel_size x "
                                 "pipeline_parallel_size > 1 yet")  # fmt: skip

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts a step may verify after a request's known tokens (0 without speculation)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters kept loaded (max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)
