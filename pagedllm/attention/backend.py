"""The attention-backend interface: the only place that touches the paged KV tensors.

The scheduler and KV manager deal in block ids; the model runner turns them into an
``AttentionMetadata`` once per step; each layer hands its q/k/v and its cache to a backend.

Token layout of a step (decode sequences first, then prefill chunks)::

    tokens:   | d0 | d1 | d2 | p0 p0 p0 p0 | p1 p1 |
    seqs:       0    1    2    3             4
    num_decodes = 3 (query length 1), query_start_loc = [0, 1, 2, 3, 7, 9]

Sequence ``i`` attends over ``seq_lens[i]`` cached tokens (earlier chunks plus this step's),
whose slots are ``block_tables[i][j // block_size] * block_size + j % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.attention.kv_cache_dtype import KVPool, write_kv


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    # The same numbers as Python ints, so backends can slice without device syncs.
    seq_lens_list: list[int]
    query_lens_list: list[int]
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    block_size: int
    # Whatever a backend derives once per step and reuses in every layer (e.g. raw pointers).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


def paged_metadata(
    block_tables: np.ndarray, starts: np.ndarray, query_lens: np.ndarray, block_size: int, device: torch.device
) -> tuple[AttentionMetadata, np.ndarray]:
    """The metadata of a step whose sequence i has ``starts[i]`` cached tokens and
    ``query_lens[i]`` new ones (sequences with one new token first), and the new tokens'
    positions. ``block_tables`` [num_seqs, max_blocks] must cover every new position."""
    num_seqs = len(query_lens)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    positions = np.arange(int(query_start_loc[-1]), dtype=np.int64) - query_start_loc[seq_of_token] + starts[seq_of_token]
    slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = starts + query_lens
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(np.ascontiguousarray(block_tables)).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens_list=seq_lens.tolist(),
        query_lens_list=query_lens.tolist(),
        num_decodes=int((query_lens == 1).sum()),
        block_size=block_size,
    )
    return meta, positions


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends from the block tables.

    Shapes: ``q`` [num_tokens, num_heads, head_dim]; ``k``/``v`` [num_tokens, num_kv_heads,
    head_dim]; each cache [num_blocks, block_size, num_kv_heads, head_dim], a plain tensor of any
    float dtype or a ``QuantizedKV`` (int8 / fp8 values and their scales; see
    ``kv_cache_dtype.py``): every backend reads every KV dtype. Returns
    [num_tokens, num_heads, head_dim]. Causal: a query at context position p sees 0..p, or with a
    sliding ``window`` only p - window + 1..p (as transformers' sliding-window mask). A
    ``softcap`` (Gemma 2) maps the scaled scores s to softcap * tanh(s / softcap) before the
    mask and softmax; the reference backend computes it, the others hand such calls to it.
    """

    name: str
    # The backend's attention is exactly what the native one-call decoder stack computes, so
    # the stack may stand in for it (model/fused_stack.py holds the whole rule).
    fused_decoder_stack: bool = False

    @staticmethod
    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: KVPool,
        value_cache: KVPool,
        slot_mapping: torch.Tensor,
    ) -> None:
        """The torch write (quantising for a ``QuantizedKV``); the native backend overrides it."""
        write_kv(k, v, key_cache, value_cache, slot_mapping, native=False)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: KVPool,
        value_cache: KVPool,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


def get_attention_backend(name: str, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    """The named backend; "auto" = the native CPU kernel where it runs (an fp32 or bf16 model on
    CPU and the kernel library built; it reads every KV cache dtype), else torch_sdpa."""
    from pagedllm.attention.cpu_native import NativeCPUAttention
    from pagedllm.attention.reference import ReferenceAttention
    from pagedllm.attention.torch_sdpa import TorchSDPAAttention
    from pagedllm.kernels.ops import native_available

    backends: dict[str, type[AttentionBackend]] = {
        NativeCPUAttention.name: NativeCPUAttention,
        ReferenceAttention.name: ReferenceAttention,
        TorchSDPAAttention.name: TorchSDPAAttention,
    }
    native_ok = dtype in (torch.float32, torch.bfloat16) and device.type == "cpu" and native_available()
    if name == "auto":
        name = NativeCPUAttention.name if native_ok else TorchSDPAAttention.name
    if name not in backends:
        raise ValueError(f"attention_backend must be auto or one of {sorted(backends)}, got {name!r}")
    if name == NativeCPUAttention.name and not native_ok:
        raise ValueError(
            "attention_backend 'cpu_native' needs float32 or bfloat16 on CPU and the native kernels "
            "(a C++ compiler; see the log); use 'auto' or 'torch_sdpa'"
        )
    return backends[name]()
