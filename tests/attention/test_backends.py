"""The fast paged-attention backend against the reference, and the reference against dense attention."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pagedllm.attention.backend import AttentionMetadata
from pagedllm.attention.backend import get_attention_backend as _get_backend
from pagedllm.kernels import ops
from pagedllm.kernels.ops import native_available

CPU = torch.device("cpu")


def get_attention_backend(name: str, dtype: torch.dtype = torch.float32):
    return _get_backend(name, dtype, CPU)


def make_batch(seed: int, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, head_dim: int = 32,
               shapes: list[tuple[int, int]] | None = None):
    """Random ragged batch: decodes first, then prefill chunks (some with a cached prefix).

    Returns (q, k, v, key_cache, value_cache, meta, dense) where ``dense`` holds each
    sequence's full K/V in order, for the dense oracle.
    """
    g = torch.Generator().manual_seed(seed)
    # (context length, query length): decodes, then prefills that are not block multiples.
    if shapes is None:
        shapes = [(1, 1), (17, 1), (block_size, 1), (3 * block_size + 5, 1), (40, 40), (2 * block_size + 3, 7), (9, 9)]
    num_blocks = sum(math.ceil(c / block_size) for c, _ in shapes) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables, slots, qs, ks, vs, dense = [], [], [], [], [], []
    for ctx, q_len in shapes:
        nb = math.ceil(ctx / block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        full_k = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        full_v = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        for pos in range(ctx - q_len):  # the cached prefix is already in the blocks
            b, o = blocks[pos // block_size], pos % block_size
            key_cache[b, o], value_cache[b, o] = full_k[pos], full_v[pos]
        for pos in range(ctx - q_len, ctx):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype))
        ks.append(full_k[ctx - q_len :])
        vs.append(full_v[ctx - q_len :])
        dense.append((full_k, full_v))
    max_nb = max(len(t) for t in tables)
    q_lens = [q for _, q in shapes]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (max_nb - len(t)) for t in tables]),
        seq_lens=torch.tensor([c for c, _ in shapes]),
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist())),
        seq_lens_list=[c for c, _ in shapes],
        query_lens_list=q_lens,
        num_decodes=sum(q == 1 for q in q_lens),
        block_size=block_size,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), key_cache, value_cache, meta, dense


def dense_attention(q, dense, meta, num_heads):
    """Plain causal attention on each sequence's contiguous K/V (no blocks at all)."""
    outs, start = [], 0
    for (k, v), q_len in zip(dense, meta.query_lens_list):
        ctx = k.shape[0]
        qi = q[start : start + q_len].float().transpose(0, 1)
        group = num_heads // k.shape[1]
        ki = k.float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v.float().repeat_interleave(group, 1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) / math.sqrt(q.shape[-1])
        allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vi).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


# head_dim 64 and 128 take the native kernel's AVX2 paths, 32 its portable one; block size 12
# is not a multiple of its 8-key chunks.
@pytest.mark.parametrize("block_size", [16, 32, 12])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_dense_and_fast_backends_match_reference_fp32(block_size, heads, head_dim, seed):
    num_heads, num_kv_heads = heads
    q, k, v, kc, vc, meta, dense = make_batch(seed, block_size, num_heads, num_kv_heads, torch.float32, head_dim)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    torch.testing.assert_close(ref, dense_attention(q, dense, meta, num_heads), atol=1e-5, rtol=1e-5)
    fast = get_attention_backend("torch_sdpa").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    native = get_attention_backend("cpu_native").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    torch.testing.assert_close(native, ref, atol=1e-5, rtol=1e-5)


# Decodes and prefill chunks (one starting at 0, others after a cached prefix) longer than the
# windows, whose starts fall mid-block and mid 8-key chunk; GQA (3 query heads per KV head).
WINDOW_SHAPES = [(1, 1), (23, 1), (100, 1), (131, 1), (40, 40), (70, 7), (97, 33)]


@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("window", [5, 24])
def test_sliding_window_skips_the_blocks_before_it(block_size, head_dim, window, heads=(6, 2)):
    """Every backend honours the window; the native kernel and its torch twin never read a block
    wholly before a sequence's first query's window (those hold NaN here, as if freed and reused)."""
    from pagedllm.kernels import reference

    num_heads, num_kv_heads = heads
    q, k, v, kc, vc, meta, dense = make_batch(3, block_size, num_heads, num_kv_heads, torch.float32, head_dim,
                                              WINDOW_SHAPES)  # fmt: skip
    scale = 1 / math.sqrt(head_dim)
    ref = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale, window)
    sdpa = get_attention_backend("torch_sdpa").forward(q, k, v, kc.clone(), vc.clone(), meta, scale, window)
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=1e-5)
    full = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert not torch.allclose(full, ref)  # the window matters here
    # The KV manager's placeholders (entries behind the window) name a block some other
    # sequence holds (here the first one's): the torch backends gather and mask them.
    behind = dataclasses.replace(meta, block_tables=meta.block_tables.clone(), backend_cache={})
    null = int(meta.block_tables[0, 0])
    poisoned = 0
    for s, (ctx, q_len) in enumerate(WINDOW_SHAPES):
        first_key = max(0, ctx - q_len - window + 1)
        for j in range(first_key // block_size):
            b = int(meta.block_tables[s, j])
            kc[b], vc[b] = float("nan"), float("nan")
            behind.block_tables[s, j] = null
            poisoned += 1
    assert poisoned > 0 and torch.isfinite(kc[null]).all()
    for name in ("reference", "torch_sdpa"):  # masked, but multiplied by 0: finite garbage there (as in a pool)
        kc_f, vc_f = kc.nan_to_num(1e4), vc.nan_to_num(1e4)
        got = get_attention_backend(name).forward(q, k, v, kc_f, vc_f, behind, scale, window)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    native = get_attention_backend("cpu_native").forward(q, k, v, kc.clone(), vc.clone(), meta, scale, window)
    torch.testing.assert_close(native, ref, atol=1e-5, rtol=1e-5)
    kc2, vc2 = kc.clone(), vc.clone()
    ops.write_kv(k, v, kc2, vc2, meta.slot_mapping)
    twin = reference.paged_attention(q, kc2, vc2, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window)
    torch.testing.assert_close(twin, ref, atol=1e-5, rtol=1e-5)
    bf16 = get_attention_backend("cpu_native", torch.bfloat16).forward(
        q, k, v, kc.to(torch.bfloat16), vc.to(torch.bfloat16), meta, scale, window
    )
    assert torch.isfinite(bf16).all()
    torch.testing.assert_close(bf16, ref, atol=3e-2, rtol=3e-2)


def test_native_kernel_builds_here():
    """The machines this project runs on have g++: the native path must not silently vanish."""
    assert native_available()


def test_native_kernel_handles_long_contexts_and_ignores_padding():
    """Contexts of many blocks, a block table padded with ids of blocks full of garbage."""
    g = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    lens = [1, 200, 333]
    kc = torch.randn(60, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(60, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(59, generator=g) + 1
    tables = torch.full((3, 30), 0)  # block 0 = padding, never attended
    kc[0], vc[0] = 1e4, 1e4
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(3, num_heads, head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]),
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        query_start_loc=torch.tensor([0, 1, 2, 3]),
        seq_lens_list=lens,
        query_lens_list=[1, 1, 1],
        num_decodes=3,
        block_size=block_size,
    )
    k = torch.randn(3, num_kv_heads, head_dim, generator=g)
    v = torch.randn(3, num_kv_heads, head_dim, generator=g)
    ref = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    native = get_attention_backend("cpu_native").forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    torch.testing.assert_close(native, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_sdpa_matches_reference_bf16(block_size):
    q, k, v, kc, vc, meta, _ = make_batch(3, block_size, 9, 3, torch.bfloat16)
    scale = 1 / math.sqrt(q.shape[-1])
    ref = get_attention_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    fast = get_attention_backend("torch_sdpa", torch.bfloat16).forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_native_reads_a_bf16_cache_and_computes_in_fp32(block_size, head_dim):
    """bf16 K/V widen exactly to fp32, so the kernel must equal fp32 attention on those values."""
    q, k, v, kc, vc, meta, dense = make_batch(5, block_size, 9, 3, torch.bfloat16, head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = get_attention_backend("cpu_native", torch.bfloat16).forward(q, k, v, kc, vc, meta, scale)
    exact = dense_attention(q, dense, meta, 9)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), exact, atol=1e-5, rtol=2**-7)  # one bf16 rounding


def test_write_kv_lands_in_the_mapped_slots():
    q, k, v, kc, vc, meta, _ = make_batch(4, 16, 4, 2, torch.float32)
    get_attention_backend("torch_sdpa").forward(q, k, v, kc, vc, meta, 0.1)
    flat_k = kc.flatten(0, 1)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k)
    torch.testing.assert_close(vc.flatten(0, 1)[meta.slot_mapping], v)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash-on-cpu")


def test_auto_picks_native_on_cpu_and_refuses_it_elsewhere():
    assert get_attention_backend("auto", torch.float32).name == "cpu_native"
    assert get_attention_backend("auto", torch.bfloat16).name == "cpu_native"
    with ops.torch_only():
        assert get_attention_backend("auto", torch.bfloat16).name == "torch_sdpa"
        with pytest.raises(ValueError, match="cpu_native"):
            get_attention_backend("cpu_native", torch.float32)
    with pytest.raises(ValueError, match="cpu_native"):
        get_attention_backend("cpu_native", torch.float16)


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_native", "reference"])
def test_non_finite_kv_left_by_one_request_never_reaches_another(tmp_path, backend):
    """A request whose K/V hold NaN (here: a NaN embedding row it uses) leaves them in its
    blocks when it ends. Decode attention gathers padded contexts and masks the padding, but
    a masked score is still q.k, so torch_sdpa gave the next requests NaN logprobs (found by an
    adversarial session). Every backend must give a clean request the same output after it."""
    import math

    from safetensors.torch import load_file, save_file

    from pagedllm import LLM, SamplingParams
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "m", "llama", seed=5)
    state = load_file(str(path / "model.safetensors"))
    state["model.embed_tokens.weight"][7] = float("nan")
    save_file(state, str(path / "model.safetensors"))
    llm = LLM(str(path), attention_backend=backend, num_kv_blocks=64, enable_prefix_caching=False, log_stats_interval=1e9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    clean, poison = {"prompt_token_ids": [11, 12, 13, 14, 15]}, {"prompt_token_ids": [20, 7, 21, 22] * 10}
    before = llm.generate([clean], params, use_tqdm=False)[0].outputs[0]
    llm.generate([poison], params, use_tqdm=False)
    after = llm.generate([clean], params, use_tqdm=False)[0].outputs[0]  # in the blocks the poison left
    beside = llm.generate([clean, poison, clean], params, use_tqdm=False)
    for out in (beside[0].outputs[0], beside[2].outputs[0], after):
        assert out.token_ids == before.token_ids
        assert all(math.isfinite(lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_native", "reference"])
def test_non_finite_kv_in_blocks_a_sliding_window_gave_back_never_reaches_it(tmp_path, backend):
    """A sliding window's skipped table entries read NULL_BLOCK_ID, a block of the pool that
    other requests write: the reference backend (also every backend's soft-capped path) masked
    what it gathered there, and a NaN in it still gave NaN (found by a review)."""
    import math

    from safetensors.torch import load_file, save_file

    from pagedllm import LLM, SamplingParams
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "m", "mistral", seed=5, sliding_window=4)
    state = load_file(str(path / "model.safetensors"))
    state["model.embed_tokens.weight"][7] = float("nan")
    save_file(state, str(path / "model.safetensors"))
    kw = dict(attention_backend=backend, num_kv_blocks=64, block_size=4, enable_prefix_caching=False, log_stats_interval=1e9)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    clean = {"prompt_token_ids": list(range(11, 41))}  # 30 tokens: most of its blocks leave the window
    want = LLM(str(path), **kw).generate([clean], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(str(path), **kw)
    llm.generate([{"prompt_token_ids": [7] * 40}], params, use_tqdm=False)  # NaN K/V in every block it held
    got = llm.generate([clean], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert all(math.isfinite(lp[t].logprob) for t, lp in zip(got.token_ids, got.logprobs))
