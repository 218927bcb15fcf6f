"""Calls into the native kernels, with the pure-torch path when they cannot run.

Each op runs natively for fp32 CPU tensors when the library is built (see ``build.py``),
else its torch twin. ``torch_only()`` switches the native path off in a block of code: the
tests run a model both ways and compare. The switch is a context variable, so it holds for
the code inside the block (its thread and context) only: an engine stepping in another
thread is never switched by it.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.kernels import reference
from pagedllm.kernels.build import load_kernels

_native_on = contextvars.ContextVar("pagedllm_native_kernels", default=True)


@contextlib.contextmanager
def torch_only() -> Iterator[None]:
    token = _native_on.set(False)
    try:
        yield
    finally:
        _native_on.reset(token)


def enabled() -> bool:
    """False inside ``torch_only()``."""
    return _native_on.get()


def native_available() -> bool:
    return _native_on.get() and load_kernels() is not None


_F32 = torch.float32


def _native(*tensors: torch.Tensor) -> bool:
    """Called several times per layer per step: kept cheap."""
    if not native_available():
        return False
    for t in tensors:
        if t.dtype is not _F32 or not t.is_cpu:
            return False
    return True


def native_rows(x: torch.Tensor) -> bool:
    """Whether the row kernels (sampling, penalties, argmax) can take ``x``: fp32 CPU rows of
    unit stride, with the kernels built."""
    return _native(x) and x.dim() == 2 and x.stride(1) == 1


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """Causal attention over the paged cache for every token of the step (native, CPU).

    ``q`` [num_tokens, num_heads, head_dim]; the caches (fp32 or bf16) already hold this
    step's K/V; ``block_tables`` [num_seqs, max_blocks], ``seq_lens`` [num_seqs] and
    ``query_start_loc`` [num_seqs + 1] are int64. With a sliding ``window`` a query at
    position p sees keys p - window + 1..p only, and table entries of blocks wholly before a
    sequence's first query's window are never read (they may be placeholders). ``step_cache``,
    a dict living for one step, keeps the prepared arguments for the other layers (of one
    block table). Computes in fp32 and returns fp32; the torch twin
    (``reference.paged_attention``) runs where the kernels cannot.
    """
    lib = load_kernels()
    native = lib is not None and q.is_cpu and key_cache.is_cpu and key_cache.dtype in (_F32, torch.bfloat16)
    if not (native and key_cache.is_contiguous() and value_cache.is_contiguous()):  # the kernel's strides are the shape's
        return reference.paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window)
    assert key_cache.dtype == value_cache.dtype
    kernel = {_F32: lib.paged_attention_f32, torch.bfloat16: lib.paged_attention_bf16}[key_cache.dtype]
    args = step_cache.get("native") if step_cache is not None else None
    if args is None:  # once per step, shared by all layers
        tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        qsl = query_start_loc.contiguous()
        assert tables.dtype == seq_lens.dtype == qsl.dtype == torch.int64
        keep = (tables, seq_lens, qsl)  # the pointers below stay valid while these live
        args = ((tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), qsl.data_ptr(), len(seq_lens)), keep)
        if step_cache is not None:
            step_cache["native"] = args
    q = q.to(_F32).contiguous()
    out = torch.empty_like(q)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    kernel(
        out.data_ptr(), q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), *args[0],
        q.shape[1], num_kv_heads, head_dim, block_size, num_blocks, window or 0, scale, torch.get_num_threads(),
    )
    return out


def grouped_gemm_fn(qtype: str, in_features: int):
    """The native GEMM over grouped blocks of this type (a ctypes function), or None."""
    if not native_available() or in_features % reference.QK:
        return None
    lib = load_kernels()
    return {"Q4_1": lib.grouped_gemm_q4_1, "Q8_0": lib.grouped_gemm_q8_0}.get(qtype)


def grouped_linear(x: torch.Tensor, grouped: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor:
    """y = x @ W^T with W in the kernels' grouped block layout (``reference.group_blocks``); fp32."""
    gemm = grouped_gemm_fn(qtype, x.shape[-1]) if x.is_cpu else None
    if gemm is None:
        return reference.grouped_linear(x, grouped, qtype, out_features)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float().contiguous()
    y = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    gemm(y.data_ptr(), x2.data_ptr(), grouped.data_ptr(), x2.shape[0], out_features, x2.shape[1], torch.get_num_threads())
    return y.reshape(*shape[:-1], out_features)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) with W in 16-row panels (``reference.pack_panels``), computed in fp32
    and returned in x's dtype. x: [M, K]."""
    if not (native_available() and x.is_cpu):
        y = reference.panel_linear(x, panels, out_features)
    else:
        x32 = x.to(_F32).contiguous()
        y = torch.empty(x32.shape[0], out_features, dtype=_F32)
        load_kernels().panel_gemm_f32(
            _ptr(y), out_features, _ptr(x32), x32.shape[1], _ptr(panels), x32.shape[0], out_features,
            x32.shape[1], torch.get_num_threads(),
        )
    if bias is not None:
        y += bias
    return y.to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMS norm of x, or of ``residual + x`` - which is then written into ``residual``.

    x: [T, D] (rows may be strided); residual: [T, D] contiguous. Norm statistics in fp32.
    """
    if residual is not None and not residual.is_contiguous():
        raise ValueError("residual must be contiguous")
    if not (_native(x, weight) and x.stride(-1) == 1 and (residual is None or _native(residual))):
        if residual is not None:
            residual.add_(x)
            x = residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)
    T, D = x.shape
    out = torch.empty(T, D, dtype=x.dtype)
    load_kernels().rms_norm_f32(
        _ptr(out), _ptr(x), x.stride(0), _ptr(residual), _ptr(weight), eps, T, D, torch.get_num_threads()
    )
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place ("rotate half"); cos/sin: [max_pos, D] fp32."""
    T, H, D = q.shape
    rows_ok = q.stride()[1:] == (D, 1) and k.stride()[1:] == (D, 1)
    if not (_native(q, k) and rows_ok and positions.dtype == torch.int64):
        c = cos[positions].to(q.dtype)[:, None, :]
        s = sin[positions].to(q.dtype)[:, None, :]
        q.copy_(reference.rotate_half(q, c, s))
        k.copy_(reference.rotate_half(k, c, s))
        return
    load_kernels().rope_f32(
        _ptr(q), q.stride(0), _ptr(k), k.stride(0), _ptr(positions.contiguous()), _ptr(cos), _ptr(sin), cos.shape[0],
        T, H, k.shape[1], D, torch.get_num_threads(),
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V ([T, Hkv, D]) in its cache slot."""
    T, Hkv, D = k.shape
    rows_ok = (T == 1 or k.stride(0) == v.stride(0)) and k.stride()[1:] == v.stride()[1:] == (D, 1)
    write = _WRITE_KV.get(key_cache.dtype) if value_cache.dtype is key_cache.dtype else None
    if write is None or not (_native(k, v) and rows_ok and key_cache.is_contiguous() and value_cache.is_contiguous()
                             and key_cache.is_cpu and value_cache.is_cpu):  # fmt: skip
        reference.write_kv(k, v, key_cache, value_cache, slot_mapping)
        return
    getattr(load_kernels(), write)(
        _ptr(k), _ptr(v), k.stride(0), _ptr(key_cache), _ptr(value_cache), _ptr(slot_mapping.contiguous()),
        key_cache.shape[0] * key_cache.shape[1], T, Hkv * D, torch.get_num_threads(),
    )


# The cache dtypes write_kv stores natively (fp16 / bf16 rounded as torch's .to(): same bytes).
_WRITE_KV = {_F32: "write_kv_f32", torch.float16: "write_kv_f16", torch.bfloat16: "write_kv_bf16"}


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last axis."""
    half = gate_up.shape[-1] // 2
    if not (_native(gate_up) and gate_up.is_contiguous()):
        gate, up = gate_up.split(half, dim=-1)
        return F.silu(gate) * up
    T = gate_up.shape[0]
    out = torch.empty(T, half, dtype=gate_up.dtype)
    load_kernels().silu_and_mul_f32(_ptr(out), _ptr(gate_up), T, half, torch.get_num_threads())
    return out


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits[rows[r]]`` keeps only the tokens row r of ``bitmask`` allows
    (bit t % 32 of int32 word t // 32); the others become -inf."""
    vocab = logits.shape[1]
    if not (_native(logits) and logits.stride(1) == 1 and bitmask.is_cpu and bitmask.dtype == torch.int32):
        reference.apply_token_bitmask(logits, rows, bitmask)
        return
    assert bitmask.shape[1] * 32 >= vocab and bitmask.shape[0] == rows.shape[0]
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.contiguous()
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise ValueError(f"bitmask rows outside the logits' [0, {logits.shape[0]})")
    load_kernels().apply_token_bitmask_f32(
        _ptr(logits), logits.stride(0), _ptr(rows), len(rows), _ptr(bitmask), bitmask.stride(0), vocab,
        torch.get_num_threads(),
    )


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """One token per row of ``logits`` [rows, vocab] fp32 (native, CPU; every temperature > 0):
    min-p, top-k and top-p over the temperature-scaled distribution, then the first token whose
    cumulative probability exceeds ``u`` [rows] (float64 in [0, 1)). min_p 0, top_k 0 and top_p 1
    are "off". The rule it follows, in torch, is ``Sampler.probs`` then ``inverse_cdf``
    (pagedllm/sampler/sampler.py); callers check ``native_rows(logits)`` first."""
    rows, vocab = logits.shape
    assert native_rows(logits)
    out = torch.empty(rows, dtype=torch.int64)
    filters = _filter_args(temperature, min_p, top_k, top_p, u)
    load_kernels().sample_rows_f32(
        _ptr(out), _ptr(logits), logits.stride(0), rows, vocab, *map(_ptr, filters), torch.get_num_threads()
    )
    return out


def _filter_args(temperature, min_p, top_k, top_p, u) -> list[torch.Tensor]:
    """The row kernels' per-row filter parameters and uniforms, in the dtypes they read."""
    dtypes = (_F32, _F32, torch.int64, _F32, torch.float64)
    return [t.to(d).contiguous() for t, d in zip((temperature, min_p, top_k, top_p, u), dtypes)]


def verify_rows(
    logits: torch.Tensor,
    first_row: torch.Tensor,
    num_rows: torch.Tensor,
    draft: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Speculative verification of sampled requests (native, CPU). Request i owns the rows
    ``first_row[i]`` .. ``+ num_rows[i] - 1`` of ``logits``; ``draft[r]`` is the token drafted at
    row r (every row but a request's last); the filters' per-row parameters and ``u`` [rows]
    (float64) are as in ``sample_rows``. Returns, per row, the token emitted there or -1 past
    the request's last token: each row draws its token with ``u[r]`` as ``sample_rows`` would,
    and the request's rows go on while the draw equals the row's draft. The torch rule is
    ``spec_decode.rejection``'s; callers check ``native_rows``."""
    rows, vocab = logits.shape
    assert native_rows(logits)
    out = torch.empty(rows, dtype=torch.int64)
    first_row, num_rows = first_row.to(torch.int64).contiguous(), num_rows.to(torch.int64).contiguous()
    assert len(first_row) == len(num_rows) and bool((first_row + num_rows <= rows).all())
    if len(draft) and (int(draft.min()) < -1 or int(draft.max()) >= vocab):
        raise ValueError(f"draft tokens outside the vocabulary [0, {vocab})")
    draft = draft.to(torch.int64).contiguous()
    filters = _filter_args(temperature, min_p, top_k, top_p, u)
    load_kernels().verify_rows_f32(
        _ptr(out), _ptr(logits), logits.stride(0), vocab, _ptr(first_row), _ptr(num_rows), len(first_row),
        _ptr(draft), *map(_ptr, filters), torch.get_num_threads(),
    )  # fmt: skip
    return out


def _flatten_ids(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of all lists in one int64 tensor, and the [len + 1] offsets of each list's run."""
    lengths = [len(ids) for ids in lists]
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(lengths))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return torch.from_numpy(flat), torch.from_numpy(offsets)


def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    output_ids: list[list[int]],
    prompt_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> None:
    """In place on ``logits[rows[i]]`` [.., vocab] fp32 (native, CPU): the repetition penalty on
    the tokens of ``prompt_ids[i]`` and ``output_ids[i]``, then frequency and presence on those of
    ``output_ids[i]``; bit for bit what ``sampler.apply_penalties`` computes in torch, touching
    only the history's tokens. Callers check ``native_rows(logits)`` first."""
    assert native_rows(logits)
    out, out_offsets = _flatten_ids(output_ids)
    prompt, prompt_offsets = _flatten_ids(prompt_ids)
    vocab = logits.shape[1]
    for ids in (out, prompt):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"penalty history holds token ids outside the vocabulary [0, {vocab})")
    rows_t = torch.tensor(rows, dtype=torch.int64)
    pres, freq, rep = (torch.tensor(v, dtype=_F32) for v in (presence, frequency, repetition))
    load_kernels().apply_penalties_f32(
        _ptr(logits), logits.stride(0), vocab, _ptr(rows_t), len(rows), _ptr(out), _ptr(out_offsets),
        _ptr(prompt), _ptr(prompt_offsets), _ptr(pres), _ptr(freq), _ptr(rep), torch.get_num_threads(),
    )  # fmt: skip


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (the first maximum of each row; a NaN counts as the
    maximum), natively for fp32 CPU rows: torch's CPU argmax does not vectorise (42 us for one
    49,152-wide row here, against ~4 us for the max alone)."""
    if not (native_rows(x) and x.shape[1] > 0):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load_kernels().argmax_rows_f32(_ptr(out), _ptr(x), x.stride(0), x.shape[0], x.shape[1], torch.get_num_threads())
    return out


def logprobs_rows(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For row ``rows[i]`` of ``logits`` (native, CPU): the log-probability of ``token_ids[i]``,
    its rank (1 + how many log-probabilities are greater) and the ``k`` largest log-probabilities
    with their token ids (ties: the lower id first) - what ``log_softmax`` then a gather, a count
    and ``topk`` give (``sampler.gather_logprobs``' torch path), with the exp sum in float64.
    Callers check ``native_rows(logits)`` first."""
    assert native_rows(logits) and k >= 0
    vocab = logits.shape[1]
    rows, token_ids = rows.to(torch.int64).contiguous(), token_ids.to(torch.int64).contiguous()
    n = len(rows)
    assert len(token_ids) == n and k <= vocab
    for name, t, hi in (("rows", rows, logits.shape[0]), ("token ids", token_ids, vocab)):
        if n and (int(t.min()) < 0 or int(t.max()) >= hi):
            raise ValueError(f"logprobs {name} outside [0, {hi})")
    token_lp, rank = torch.empty(n, dtype=_F32), torch.empty(n, dtype=torch.int64)
    top_ids, top_lp = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k, dtype=_F32)
    load_kernels().logprobs_rows_f32(
        _ptr(token_lp), _ptr(rank), _ptr(top_ids), _ptr(top_lp), _ptr(logits), logits.stride(0), _ptr(rows), n,
        vocab, _ptr(token_ids), k, torch.get_num_threads(),
    )  # fmt: skip
    return token_lp, rank, top_ids, top_lp
