"""KV cache dtypes through the backends: every backend reads every dtype, writes quantise into
the slots, and a block's bytes (scales included) size the pool."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedllm.attention.kv_cache_dtype import (
    QuantizedKV, allocate_pool, cache_parts, carve_pool, gather_blocks, pool_nbytes, resolve_kv_cache_dtype,
)  # fmt: skip
from pagedllm.config import EngineConfig
from pagedllm.kernels import kv_ops
from pagedllm.runner.model_runner import kv_block_bytes
from tests.attention.test_backends import get_attention_backend, make_batch

KV_DTYPES = ["bfloat16", "float16", "int8", "fp8_e4m3"]


@pytest.fixture(autouse=True)
def one_thread():
    """Small torch ops stall with two threads on a busy 2-core machine (see tests/kernels/test_kv_ops.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _store(spec, fp32_cache: torch.Tensor):
    """An fp32 cache's contents as a pool of ``spec``."""
    if spec.quantized:
        return QuantizedKV(*kv_ops.quantize(fp32_cache, spec.storage))
    return fp32_cache.to(spec.storage)


def _clone(pool):
    return QuantizedKV(pool.data.clone(), pool.scale.clone()) if isinstance(pool, QuantizedKV) else pool.clone()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 6])
def test_every_backend_reads_every_kv_dtype(kv_dtype, window):
    """The torch backends dequantise exactly, so they agree to fp32 rounding; the native kernel
    agrees with them too, except that with int8 keys it also quantises q (a ~1% score error)."""
    spec = resolve_kv_cache_dtype(kv_dtype, torch.float32)
    q, k, v, kc, vc, meta, _ = make_batch(1, 16, 9, 3, torch.float32, 64)
    kp, vp = _store(spec, kc), _store(spec, vc)
    scale = 1 / math.sqrt(64)
    outs = {}
    for name in ("reference", "torch_sdpa", "cpu_native"):
        meta.backend_cache.clear()
        outs[name] = get_attention_backend(name).forward(q, k, v, _clone(kp), _clone(vp), meta, scale, window)
        assert outs[name].dtype == torch.float32 and torch.isfinite(outs[name]).all()
    torch.testing.assert_close(outs["torch_sdpa"], outs["reference"], atol=1e-5, rtol=1e-5)
    atol = 3e-2 if kv_dtype == "int8" else 1e-5
    torch.testing.assert_close(outs["cpu_native"], outs["reference"], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_native"])
def test_a_backend_writes_the_step_into_its_slots(kv_dtype, backend):
    spec = resolve_kv_cache_dtype(kv_dtype, torch.float32)
    q, k, v, kc, vc, meta, _ = make_batch(4, 16, 4, 2, torch.float32, 64)
    kp, vp = allocate_pool(spec, tuple(kc.shape), torch.device("cpu")), allocate_pool(spec, tuple(vc.shape), torch.device("cpu"))
    get_attention_backend(backend).forward(q, k, v, kp, vp, meta, 0.1)
    flat = lambda pool: cache_parts(pool)[0].flatten(0, 1)  # noqa: E731
    assert flat(kp).dtype == spec.storage
    got_k = gather_blocks(kp, torch.arange(kc.shape[0]), torch.float32).flatten(0, 1)[meta.slot_mapping]
    got_v = gather_blocks(vp, torch.arange(vc.shape[0]), torch.float32).flatten(0, 1)[meta.slot_mapping]
    # Error bounds: bf16 8 bits, fp16 11 bits of mantissa; int8 half a step of absmax/127;
    # e4m3 3 bits of mantissa (half an ulp = 2^-4 relative) or a subnormal step.
    for got, want in ((got_k, k), (got_v, v)):
        amax = want.abs().amax(-1, keepdim=True)
        bound = {
            "bfloat16": want.abs() * 2**-8,
            "float16": want.abs() * 2**-11,
            "int8": amax / 254,
            "fp8_e4m3": torch.maximum(want.abs() * 2**-4, amax / 448 * 2**-10),
        }[kv_dtype]
        assert ((got - want).abs() <= bound * (1 + 1e-5) + 1e-30).all()


# The KV-cache shape of SmolLM2-135M (no sliding windows: one KV-cache group of all layers).
SMOLLM2_SHAPE = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, sliding_window=None,
                                is_sliding=lambda layer: False)  # fmt: skip


def test_block_bytes_count_the_scales():
    arch = SMOLLM2_SHAPE
    fp32 = kv_block_bytes(arch, 16, torch.float32)
    assert fp32 == 2 * 30 * 16 * 3 * 64 * 4
    assert kv_block_bytes(arch, 16, torch.float32, "auto") == fp32
    assert kv_block_bytes(arch, 16, torch.float32, "bfloat16") * 2 == fp32
    assert kv_block_bytes(arch, 16, torch.bfloat16, "auto") * 2 == fp32
    assert kv_block_bytes(arch, 16, torch.float32, "float16") * 2 == fp32
    for name in ("int8", "fp8_e4m3"):
        quant = kv_block_bytes(arch, 16, torch.float32, name)
        assert quant == 2 * 30 * 16 * 3 * (64 + 4)  # one fp32 scale per token and head
        assert fp32 / quant == pytest.approx(3.76, abs=0.01)


def test_kv_cache_space_buys_3_8x_the_blocks_with_int8():
    from pagedllm.engine.startup import kv_cache_sizes

    arch = SMOLLM2_SHAPE
    fp32 = kv_cache_sizes(EngineConfig(kv_cache_space=1.0), arch).num_blocks
    int8 = kv_cache_sizes(EngineConfig(kv_cache_space=1.0, kv_cache_dtype="int8"), arch).num_blocks
    assert int8 / fp32 == pytest.approx(3.76, abs=0.01)


def test_a_carved_pool_views_its_buffer():
    spec = resolve_kv_cache_dtype("int8", torch.float32)
    shape = (3, 16, 2, 64)
    flat = torch.zeros(2 * pool_nbytes(spec, shape), dtype=torch.uint8)
    a, b = carve_pool(spec, shape, flat[: len(flat) // 2]), carve_pool(spec, shape, flat[len(flat) // 2 :])
    a.data.fill_(7)
    a.scale.fill_(0.5)
    assert b.data.eq(0).all() and b.scale.eq(0).all() and a.data.shape == shape and a.scale.shape == shape[:-1]
    assert flat.ne(0).sum() == a.data.numel() + a.scale.numel()  # 0.5 = 0x3F000000: one non-zero byte


def test_auto_is_the_model_dtype_and_bad_names_are_refused():
    assert resolve_kv_cache_dtype("auto", torch.float32).storage == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_cache_dtype("fp8", torch.float32).storage == torch.float8_e4m3fn
    assert not resolve_kv_cache_dtype("float16", torch.float32).quantized
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="foo")
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_pool_is_zero_and_costs_memory_only_where_written(kv_dtype):
    """The pool is reserved up front but committed page by page as blocks are first written."""
    from pagedllm.attention.kv_cache_dtype import allocate_pool, cache_parts, resolve_kv_cache_dtype

    spec = resolve_kv_cache_dtype(kv_dtype, torch.float32)
    shape = (4096, 16, 4, 256)  # 256 MiB of fp32 values (64 MiB of int8 + scales)
    before = _rss_bytes()
    pool = allocate_pool(spec, shape, torch.device("cpu"))
    parts = cache_parts(pool)
    assert _rss_bytes() - before < 16 << 20
    assert all(int(p[::97].view(torch.uint8).count_nonzero()) == 0 for p in parts)  # zero-filled
    for p in parts:
        p[:64].view(torch.uint8).fill_(1)  # the first 64 blocks: a few MiB
    grown = _rss_bytes() - before
    reserved = sum(p.numel() * p.element_size() for p in parts)
    assert 64 * reserved // 4096 <= grown + (1 << 20) and grown < reserved // 8
