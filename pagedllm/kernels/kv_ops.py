"""Reduced-precision KV caches: quantisation, the native paged attention that reads them, and
the pure-torch twins of both.

Storage (``--kv-cache-dtype``):

- ``float16``: a plain fp16 cache; no scales.
- ``int8``: int8 values with one fp32 scale per written token and KV head (a companion tensor
  [num_blocks, block_size, num_kv_heads]); value = scale * q, scale = absmax / 127, q = round(x /
  scale) (half to even). Per token, not per block: a token's scale is fixed when it is written,
  so a filling block is never requantised and a block copied or swapped carries its scales.
- ``fp8_e4m3``: ``torch.float8_e4m3fn`` values with per-token-per-head scales likewise (absmax /
  448, e4m3's largest finite value). A fixed scale would save the 4-byte scale but fails on
  rows far from it (e4m3 keeps only ~2 decimal digits over its 18 binades); a per-row scale
  costs 6% of the storage and makes every row use the full range.

The scales cost 4 / head_dim bytes per value (6% at head_dim 64): an int8 block is 3.76x
smaller than an fp32 one there.

The native kernels (``csrc/kv_quant_attention.cpp``) take fp32 rows; the twins here are what
the tests compare them with, and what runs where the library is not built.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.build import load_kernels
from pagedllm.kernels.reference import hidden_keys

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
# The largest magnitude each quantised dtype stores: a row's absmax maps onto it.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
NATIVE_KV_DTYPES = (torch.float16, *QUANTIZED_DTYPES)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values of ``dtype``, fp32 scales of x.shape[:-1]): one scale per row of the last axis.

    The twin of ``write_kv_i8`` / ``write_kv_fp8``, bit for bit: the same fp32 division and the
    same rounding (half to even). A zero row stores zeros with scale 0; a row holding a NaN or an
    inf stores zeros with a NaN / inf scale, so it reads back not finite, as it was.
    """
    qmax = QMAX[dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1) / qmax
    scaled = (scale > 0) & torch.isfinite(scale)
    y = torch.where(scaled[..., None], x / scale[..., None], torch.zeros((), dtype=torch.float32))
    y = y.clamp(-qmax, qmax)
    data = y.round().to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale * data in fp32, cast to ``dtype``; ``scale`` None for an unscaled (fp16, bf16, fp32) cache."""
    x = data.float()
    if scale is not None:
        x = x * scale[..., None]
    return x.to(dtype)


def write_kv_quantized_reference(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    key_scale: torch.Tensor, value_scale: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """Quantise each token's K/V ([T, Hkv, D]) into its slot of an int8 / fp8 cache and its scales."""
    block, offset = slot_mapping // key_cache.shape[1], slot_mapping % key_cache.shape[1]
    for x, cache, scales in ((k, key_cache, key_scale), (v, value_cache, value_scale)):
        data, scale = quantize(x, cache.dtype)
        # Indexed by (block, offset), so views of any layout take it; fp8 has no index kernels
        # on CPU: the bytes are copied.
        cache.view(torch.uint8)[block, offset] = data.view(torch.uint8)
        scales[block, offset] = scale


def _native_lib():
    from pagedllm.kernels import ops  # the torch_only() switch lives there

    return load_kernels() if ops.native_available() else None


def write_kv_quantized(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    key_scale: torch.Tensor, value_scale: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:  # fmt: skip
    """``write_kv_quantized_reference`` natively (one call instead of ~20 torch ops per layer)."""
    lib = _native_lib()
    T, Hkv, D = k.shape
    rows_ok = (T == 1 or k.stride(0) == v.stride(0)) and k.stride()[1:] == v.stride()[1:] == (D, 1)
    dense = all(t.is_contiguous() for t in (key_cache, value_cache, key_scale, value_scale))  # the kernel's strides are the shape's
    if lib is None or not (rows_ok and dense and k.dtype == v.dtype == torch.float32 and k.is_cpu):
        write_kv_quantized_reference(k, v, key_cache, value_cache, key_scale, value_scale, slot_mapping)
        return
    fn = lib.write_kv_i8 if key_cache.dtype == torch.int8 else lib.write_kv_fp8
    fn(
        k.data_ptr(), v.data_ptr(), k.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), key_scale.data_ptr(),
        value_scale.data_ptr(), slot_mapping.contiguous().data_ptr(), key_cache.shape[0] * key_cache.shape[1], T, Hkv,
        D, torch.get_num_threads(),
    )  # fmt: skip


def native_kv_attention_available() -> bool:
    return _native_lib() is not None


def paged_attention_kv(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """Causal paged attention over an fp16, int8 or fp8 cache (native; fp32 out).

    Arguments as ``ops.paged_attention``, plus the caches' scales (None for fp16) and an
    optional sliding ``window``. The caches already hold this step's K/V.

    With int8 keys the kernel also quantises each (scaled) query head to int8 (absmax / 127,
    as a cached row) and takes q . k as an exact integer sum times both scales: the keys are
    never widened to fp32 (32 int8 products per instruction instead of 8 fp32 ones), for an
    error of the same size as the keys' own quantisation. V rows and the softmax stay fp32.
    ``paged_attention_kv_reference`` does the same, so the two agree to rounding.
    """
    lib = load_kernels()
    assert lib is not None and q.is_cpu and key_cache.dtype == value_cache.dtype in NATIVE_KV_DTYPES
    if not all(t is None or t.is_contiguous() for t in (key_cache, value_cache, key_scale, value_scale)):
        # The kernel's strides are the shape's: a view of another layout takes the twin.
        return paged_attention_kv_reference(q, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
                                            query_start_loc, scale, window)  # fmt: skip
    args = step_cache.get("native_kv") if step_cache is not None else None
    if args is None:  # once per step, shared by all layers
        tables, seq_lens, qsl = block_tables.contiguous(), seq_lens.contiguous(), query_start_loc.contiguous()
        assert tables.dtype == seq_lens.dtype == qsl.dtype == torch.int64
        args = ((tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), qsl.data_ptr(), len(seq_lens)), (tables, seq_lens, qsl))
        if step_cache is not None:
            step_cache["native_kv"] = args
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    tail = (q.shape[1], num_kv_heads, head_dim, block_size, num_blocks, scale, window or 0, torch.get_num_threads())
    if key_cache.dtype == torch.float16:
        lib.paged_attention_kv_f16(out.data_ptr(), q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), *args[0], *tail)
    else:
        assert key_scale is not None and value_scale is not None
        fn = lib.paged_attention_kv_i8 if key_cache.dtype == torch.int8 else lib.paged_attention_kv_fp8
        fn(out.data_ptr(), q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), key_scale.data_ptr(),
           value_scale.data_ptr(), *args[0], *tail)  # fmt: skip
    return out


def paged_attention_kv_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The twin of ``paged_attention_kv``: per sequence, dequantise its context and attend in fp32."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    qsl = query_start_loc.tolist()
    for s, ctx_len in enumerate(seq_lens.tolist()):
        q_len = qsl[s + 1] - qsl[s]
        if q_len == 0 or ctx_len <= 0:
            continue
        positions = torch.arange(ctx_len)
        slots = block_tables[s][positions // block_size] * block_size + positions % block_size
        qs_ = q[qsl[s] : qsl[s + 1]].float()  # [q_len, H, D]
        if key_cache.dtype == torch.int8:  # the kernel's integer dot products (see its docstring)
            q8, q_scale = quantize(qs_ * scale, torch.int8)  # [q_len, H, D], [q_len, H]
            k8 = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [ctx, H, D]
            ks = key_scale.flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [ctx, H]
            scores = torch.einsum("qhd,khd->qhk", q8.float(), k8) * (ks.T[None] * q_scale[..., None])
        else:
            k = dequantize(key_cache.flatten(0, 1)[slots], None if key_scale is None else key_scale.flatten(0, 1)[slots])
            scores = torch.einsum("qhd,khd->qhk", qs_, k.repeat_interleave(group, dim=1)) * scale
        v = dequantize(value_cache.flatten(0, 1)[slots], None if value_scale is None else value_scale.flatten(0, 1)[slots])
        q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]  # token r of the chunk sits at q_pos[r]
        hidden = hidden_keys(q_pos, positions, window)
        probs = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1)
        out[qsl[s] : qsl[s + 1]] = torch.einsum("qhk,khd->qhd", probs, v.repeat_interleave(group, dim=1))
    return out
