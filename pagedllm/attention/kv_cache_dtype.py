"""What one layer's KV pool is stored as (``--kv-cache-dtype``), and the few operations on it.

A layer's cache is a pair (key pool, value pool); each pool is either

- a plain tensor [num_blocks, block_size, num_kv_heads, head_dim] of fp32 / bf16 / fp16
  (``auto`` = the model's dtype, exact), or
- a ``QuantizedKV``: int8 or fp8 e4m3 values of that shape plus one fp32 scale per written
  token and KV head, [num_blocks, block_size, num_kv_heads] (see ``kernels/kv_ops.py``).

Both are indexed by block along their first axis in every part, so the runner copies and swaps
blocks part by part (``cache_parts``) without knowing the dtype, and the scheduler and KV
manager, which deal in block ids only, never see any of it. The attention backends read them:
natively, or by gathering blocks and dequantising them (``gather_blocks``).
"""

from __future__ import annotations

import mmap

from dataclasses import dataclass

import torch

from pagedllm.config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES
from pagedllm.kernels import kv_ops

_STORAGE = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
_SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVCacheSpec:
    """A resolved KV cache dtype: its name and how each value is stored."""

    name: str  # float32 | bfloat16 | float16 | int8 | fp8_e4m3 ("auto" resolved)
    storage: torch.dtype

    @property
    def quantized(self) -> bool:
        """Stored with per-token-per-head scales (``QuantizedKV``)."""
        return self.storage in kv_ops.QUANTIZED_DTYPES

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes one token's K (or V) row of one head takes, its scale included."""
        elem = torch.empty((), dtype=self.storage).element_size()
        return head_dim * elem + (_SCALE_DTYPE.itemsize if self.quantized else 0)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """``auto`` is the model's dtype (exact: today's behaviour); the others name their storage."""
    key = KV_CACHE_DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if key == "auto":
        key = next(k for k, v in _STORAGE.items() if v == model_dtype)
    return KVCacheSpec(key, _STORAGE[key])


@dataclass
class QuantizedKV:
    """One quantised K or V pool: ``data`` [num_blocks, block_size, num_kv_heads, head_dim]
    (int8 or float8_e4m3fn) and ``scale`` [num_blocks, block_size, num_kv_heads] fp32, value =
    scale[..., None] * data. A token's scale is set when its row is written and never changes."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


KVPool = torch.Tensor | QuantizedKV


def cache_parts(pool: KVPool) -> tuple[torch.Tensor, ...]:
    """The tensors of a pool, each indexed by block along its first axis."""
    return (pool.data, pool.scale) if isinstance(pool, QuantizedKV) else (pool,)


def _part_shapes(spec: KVCacheSpec, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    parts = [(tuple(shape), spec.storage)]
    if spec.quantized:
        parts.append((tuple(shape[:-1]), _SCALE_DTYPE))
    return parts


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def pool_nbytes(spec: KVCacheSpec, shape: tuple[int, ...]) -> int:
    """Bytes of one pool of ``shape`` (each part 64-byte aligned), for carving a flat buffer."""
    return sum(_align(torch.Size(s).numel() * dt.itemsize) for s, dt in _part_shapes(spec, shape))


def carve_pool(spec: KVCacheSpec, shape: tuple[int, ...], flat: torch.Tensor) -> KVPool:
    """A pool viewing the uint8 buffer ``flat`` (``pool_nbytes`` long): no copy."""
    views, offset = [], 0
    for s, dt in _part_shapes(spec, shape):
        n = torch.Size(s).numel() * dt.itemsize
        views.append(flat[offset : offset + n].view(dt).view(s))
        offset += _align(n)
    return QuantizedKV(*views) if spec.quantized else views[0]


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``, but on CPU the memory is committed as it is first written: fresh
    anonymous pages (zero-filled by the kernel) mapped on first touch, while torch.zeros writes
    every byte up front. So a large KV pool costs RSS only for the blocks requests have used.

    The mapping asks for transparent huge pages (MADV_HUGEPAGE, where the kernel offers them):
    first writes then fault once per 2 MiB instead of per 4 KiB. Measured on an AMD EPYC Zen 4:
    writing 1 GiB for the first time took 1.12 s with 4 KiB pages and 0.065 s with huge pages
    (0.04 s for a second write) - time that W1's prefill otherwise spends in write_kv."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def allocate_pool(spec: KVCacheSpec, shape: tuple[int, ...], device: torch.device) -> KVPool:
    """A zero-filled pool (padded slots inside a gathered block stay finite: masked, never NaN),
    committed as it is used."""
    parts = [zeros_on_first_touch(s, dt, device) for s, dt in _part_shapes(spec, shape)]
    return QuantizedKV(*parts) if spec.quantized else parts[0]


def gather_blocks(pool: KVPool, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pool[index]`` (whole blocks, or flattened slots of ``pool_slots``) as ``dtype`` values.
    A plain pool already of ``dtype`` is indexed only (the ``auto`` path is unchanged)."""
    if isinstance(pool, QuantizedKV):
        return kv_ops.dequantize(pool.data[index], pool.scale[index], dtype)
    out = pool[index]
    return out if out.dtype == dtype else out.to(dtype)


def pool_slots(pool: KVPool) -> KVPool:
    """The same pool with blocks and their slots flattened into one axis (views)."""
    if isinstance(pool, QuantizedKV):
        return QuantizedKV(pool.data.flatten(0, 1), pool.scale.flatten(0, 1))
    return pool.flatten(0, 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, key_pool: KVPool, value_pool: KVPool, slot_mapping: torch.Tensor,
             native: bool = False) -> None:  # fmt: skip
    """Store this step's K/V ([T, Hkv, D]) in their slots, quantising for a ``QuantizedKV``
    (natively when ``native`` and the kernels are built; the torch twin gives the same bytes)."""
    if isinstance(key_pool, QuantizedKV):
        write = kv_ops.write_kv_quantized if native else kv_ops.write_kv_quantized_reference
        write(k, v, key_pool.data, value_pool.data, key_pool.scale, value_pool.scale, slot_mapping)
        return
    from pagedllm.kernels import ops, reference

    (ops.write_kv if native else reference.write_kv)(k, v, key_pool, value_pool, slot_mapping)
