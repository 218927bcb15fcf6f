"""Pure-torch twins of the native kernels: slow, obviously correct, and the fallback.

GGUF block layouts (32 weights per block, along the input dimension):
  Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of nibbles; weight j = d * q_j + m, where byte i
        holds q_i in its low nibble and q_{i+16} in its high nibble.
  Q8_0: fp16 scale d, 32 int8; weight j = d * q_j.

The kernels read a regrouped copy (``group_blocks``): rows in groups of 16 (zero rows pad the
last group) and, for each block index, the 16 rows' fp16 scales (and minima) followed by the
16 rows' quants of the 32 k - Q4_1: 16x2 + 16x2 + 32x8 = 320 bytes, in 8 chunks of 4 k, each
chunk 8 words of 4 bytes: byte t of word j holds k = 4c + t of row j in its low nibble and of
row j + 8 in its high one (a word is one vector lane for 4 columns); Q8_0: 16x2 + 32x16 = 544
bytes, k by k, 16 int8 each. The kernel can then vectorise over output rows with k sequential.
"""

from __future__ import annotations

import torch

QK = 32
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def _split(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(quant bytes, fp32 scales, fp32 minima or None) of GGUF blocks [..., block_bytes]."""
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    if qtype == "Q4_1":
        return blocks[..., 4:20], d, blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    if qtype == "Q8_0":
        return blocks[..., 2:34], d, None
    raise ValueError(f"unsupported GGUF block type {qtype!r}")


GROUP_ROWS = 16
GROUP_BYTES = {"Q4_1": 320, "Q8_0": 544}


def _quants(qs: torch.Tensor, qtype: str) -> torch.Tensor:
    """The 32 integer quants of each block [..., 32] (int16) from its quant bytes."""
    if qtype == "Q4_1":
        q16 = qs.to(torch.int16)
        return torch.cat([q16 & 0x0F, q16 >> 4], dim=-1)
    return qs.contiguous().view(torch.int8).to(torch.int16)


def _values(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, qtype: str) -> torch.Tensor:
    """The 32 fp32 weights of each block [..., 32] from its quant bytes, scale and minimum."""
    w = _quants(qs, qtype).float() * d[..., None]
    return w + m[..., None] if m is not None else w


def dequantize(packed: torch.Tensor, qtype: str, out_features: int, in_features: int) -> torch.Tensor:
    """[out_features, in_features] fp32 weights from [out_features, row_bytes] uint8 blocks."""
    blocks = packed.reshape(out_features, in_features // QK, BLOCK_BYTES[qtype])
    return _values(*_split(blocks, qtype), qtype).reshape(out_features, in_features)


def group_blocks(packed: torch.Tensor, qtype: str, out_features: int, in_features: int) -> torch.Tensor:
    """GGUF blocks [N, row_bytes] -> the kernels' grouped layout [ceil(N/16), nb, group_bytes].

    Every engine start regroups each layer, so this stays in bytes (no int16 quants) and
    writes each field straight into its place: one pass over the weights per field."""
    nb = in_features // QK
    groups = -(-out_features // GROUP_ROWS)
    src = packed.reshape(out_features, nb, BLOCK_BYTES[qtype])
    if groups * GROUP_ROWS != out_features:  # zero rows pad the last group
        padded = torch.zeros(groups * GROUP_ROWS, nb, BLOCK_BYTES[qtype], dtype=torch.uint8)
        padded[:out_features] = src
        src = padded
    blocks = src.view(groups, GROUP_ROWS, nb, -1).transpose(1, 2)  # [G, nb, 16 (rows), block_bytes]
    out = torch.empty(groups, nb, GROUP_BYTES[qtype], dtype=torch.uint8)
    out[..., 0:32].view(groups, nb, GROUP_ROWS, 2).copy_(blocks[..., 0:2])  # the 16 rows' fp16 d
    if qtype == "Q4_1":
        out[..., 32:64].view(groups, nb, GROUP_ROWS, 2).copy_(blocks[..., 2:4])  # their fp16 m
        qs = blocks[..., 4:20]  # byte i: q_i (low nibble), q_{i+16} (high)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [G, nb, 16 (rows), 32 (k)]
        pairs = q[:, :, :8] | (q[:, :, 8:] << 4)  # row j low, row j + 8 high: [G, nb, 8 (j), 32 (k)]
        # byte t of word j of chunk c holds k = 4c + t
        out[..., 64:].view(groups, nb, QK // 4, 8, 4).copy_(pairs.view(groups, nb, 8, QK // 4, 4).transpose(2, 3))
    else:  # Q8_0: k by k, the 16 rows' int8 quants
        out[..., 32:].view(groups, nb, QK, GROUP_ROWS).copy_(blocks[..., 2:34].transpose(-1, -2))
    return out


def _grouped_q4_1_quants(qbytes: torch.Tensor) -> torch.Tensor:
    """The quants [G, nb, 32 (k), 16 (rows)] (int16) of Q4_1 group-blocks' quant bytes [G, nb, 256]."""
    b = qbytes.reshape(*qbytes.shape[:2], QK // 4, 8, 4).transpose(-1, -2).reshape(*qbytes.shape[:2], QK, 8)
    b = b.to(torch.int16)
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def dequantize_grouped(grouped: torch.Tensor, qtype: str, out_features: int, in_features: int) -> torch.Tensor:
    """[out_features, in_features] fp32 weights from the grouped layout."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unsupported GGUF block type {qtype!r}")
    nb = in_features // QK
    g = grouped.reshape(-1, nb, GROUP_BYTES[qtype])
    d = g[..., :32].contiguous().view(torch.float16).float()  # [G, nb, 16]
    m = g[..., 32:64].contiguous().view(torch.float16).float() if qtype == "Q4_1" else torch.zeros_like(d)
    qbytes = g[..., 64:] if qtype == "Q4_1" else g[..., 32:]
    if qtype == "Q4_1":
        q = _grouped_q4_1_quants(qbytes)  # [G, nb, 32, 16]
    else:
        q = qbytes.contiguous().view(torch.int8).reshape(*g.shape[:2], QK, GROUP_ROWS)
    w = q.float() * d[:, :, None, :] + m[:, :, None, :]  # [G, nb, 32 (k), 16 (rows)]
    return w.permute(0, 3, 1, 2).reshape(-1, in_features)[:out_features]


def grouped_linear(x: torch.Tensor, grouped: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor:
    """x @ W^T in fp32, W in the grouped layout."""
    w = dequantize_grouped(grouped, qtype, out_features, x.shape[-1])
    return x.float() @ w.t()


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the Hugging Face layout: pairs are (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


PANEL = 16


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> the dense GEMM's panels [ceil(N/16), K, 16]: panel[p, k, j] = W[16p + j, k]
    (zero rows pad the last panel)."""
    n, k = weight.shape
    num = -(-n // PANEL)
    padded = torch.zeros(num * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(num, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out_features, K] weight back from its panels."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features]


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """y = x @ W^T with W in panels: the twin of ``panel_gemm_f32``."""
    return x.float() @ unpack_panels(panels, out_features).T


def write_kv(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's K/V ([T, Hkv, D]) in its cache slot (caches [blocks, block_size, Hkv, D])."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(value_cache.dtype))


def hidden_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where a query at q_pos ([q, 1]) may not see the key at k_pos ([k]):
    a later key, or (with a sliding ``window``) one window or more behind it."""
    hidden = k_pos[None, :] > q_pos
    if window:
        hidden |= k_pos[None, :] <= q_pos - window
    return hidden


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The twin of ``paged_attention_f32/bf16``: one sequence at a time, fp32, explicit mask.

    Query row r of a sequence with q_len queries and ctx keys sits at position ctx - q_len + r
    and sees keys max(0, p - window + 1)..p. Only the blocks some query sees are gathered, so
    placeholder entries before the window are never touched (as in the kernel).
    """
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    qsl = query_start_loc.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        t0, t1 = qsl[s], qsl[s + 1]
        if t1 == t0 or ctx <= 0:
            continue
        q_pos = torch.arange(ctx - (t1 - t0), ctx)[:, None]
        first = max(0, ctx - (t1 - t0) - window + 1) if window else 0
        k_pos = torch.arange(first, ctx)
        slots = block_tables[s, k_pos // block_size] * block_size + k_pos % block_size
        k = key_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)  # [keys, H, D]
        v = value_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[t0:t1].float(), k) * scale
        hidden = hidden_keys(q_pos, k_pos, window)
        out[t0:t1] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)
    return out


_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # byte value -> its 8 bits, low first


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits[rows[r], t] = -inf`` unless bit t % 32 of ``bitmask[r, t // 32]`` is
    set (int32 words, little-endian bytes); the twin of ``apply_token_bitmask_f32``."""
    vocab = logits.shape[1]
    allowed = _BITS.to(logits.device)[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, :vocab]
    sub = logits[rows]
    logits[rows] = sub.masked_fill(allowed[:, : sub.shape[1]] == 0, float("-inf"))


# ---------------------------------------------------------------------------------------------
# int8 activations (activation_dtype="int8"; csrc/int8_gemm.cpp): x quantized in 32-wide blocks,
# weights in int8 panels. The twins below define both layouts and the exact integer scheme.

INT8_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}  # the GGUF block types with an integer kernel (GGML numbers)
_FILE_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
INT8_COLS = 16  # output columns per panel
INT8_HEADER = {"Q4_0": 64, "Q4_1": 64, "Q8_0": 64}  # fp16 dw, then fp16 mw (Q4_1) or zeros: 16 columns
INT8_RECORD = {q: h + (512 if q == "Q8_0" else 256) for q, h in INT8_HEADER.items()}  # bytes a panel's block


ACTIVATION_LEVELS = {8: 127, 16: 32258}  # the largest quant of int8 / wide (254 * 127) activations


def quantize_activations(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (q [M, K], d [M, K/32] fp32, s [M, K/32] int32): per 32-wide block,
    q = round_half_even(x * (L / amax)), d = amax / L, s = the sum of q, with L = 127 (bits 8:
    q int8) or 32258 (bits 16, the wide mode: q int16). The kernel runs the same fp32
    operations, so its quants are bit-identical to these. A block holding a NaN or an inf gets
    zero quants and sum under a NaN / inf scale: its products are not finite, as x's were."""
    levels = ACTIVATION_LEVELS[bits]
    xb = x.float().reshape(x.shape[0], x.shape[1] // QK, QK)  # (-1 cannot be inferred for 0 rows)
    amax = xb.abs().amax(-1)
    finite = torch.isfinite(amax)
    inv = torch.where((amax > 0) & finite, torch.tensor(float(levels)) / amax, torch.zeros_like(amax))
    q = torch.where(finite[..., None], torch.round(xb * inv[..., None]), 0.0).to(torch.int32)
    qtype = torch.int8 if bits == 8 else torch.int16
    return q.to(qtype).reshape(x.shape), amax / float(levels), q.sum(-1, dtype=torch.int32)


def split_wide(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Wide quants q (int16, |q| <= 32258) as the kernel's two int8 halves: q = 254 * q1 + q2,
    q1 = floor((q + 127) / 254) in [-127, 127], q2 in [-127, 126]."""
    q32 = q.to(torch.int32)
    q1 = torch.div(q32 + 127, 254, rounding_mode="floor")
    return q1.to(torch.int8), (q32 - 254 * q1).to(torch.int8)


Fields = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # quants [N, K] int16, d [N, nb], m [N, nb] | None


def block_fields(blocks: torch.Tensor, qtype: str, in_features: int) -> Fields:
    """(raw quants, fp32 scales, fp32 minima or None) of GGUF blocks [N, row_bytes] of Q4_0 / Q4_1
    / Q8_0: Q4_0 weight = d * (q - 8), Q4_1 = d * q + m, Q8_0 = d * q (q int8)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, in_features // QK, _FILE_BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if qtype == "Q4_1" else None
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16)
    else:
        nib = b[..., 4 if qtype == "Q4_1" else 2 :].to(torch.int16)
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)
    return q.reshape(n, in_features), d, m


def grouped_fields(grouped: torch.Tensor, qtype: str, out_features: int, in_features: int) -> Fields:
    """The same fields from the grouped layout (``group_blocks``, Q4_1 / Q8_0)."""
    nb = in_features // QK
    g = grouped.reshape(-1, nb, GROUP_BYTES[qtype])
    d = g[..., :32].contiguous().view(torch.float16).float()  # [G, nb, 16]
    m = g[..., 32:64].contiguous().view(torch.float16).float() if qtype == "Q4_1" else None
    if qtype == "Q4_1":
        q = _grouped_q4_1_quants(g[..., 64:])  # [G, nb, 32 (k), 16 (rows)]
    else:
        q = g[..., 32:].contiguous().view(torch.int8).reshape(*g.shape[:2], QK, GROUP_ROWS).to(torch.int16)
    rows = lambda t: t.permute(0, 2, 1).reshape(-1, nb)[:out_features]  # noqa: E731  [G, nb, 16] -> [N, nb]
    q = q.permute(0, 3, 1, 2).reshape(-1, in_features)[:out_features]
    return q.contiguous(), rows(d).contiguous(), None if m is None else rows(m).contiguous()


def dequantize_fields(fields: Fields, qtype: str) -> torch.Tensor:
    """The [N, K] weights of (quants, scales, minima), in fp64 (exact)."""
    q, d, m = fields
    n, k = q.shape
    qb = q.double().reshape(n, k // QK, QK) - (8 if qtype == "Q4_0" else 0)
    w = qb * d.double()[..., None]
    if m is not None:
        w = w + m.double()[..., None]
    return w.reshape(n, k)


def pack_int8_panels(fields: Fields, qtype: str) -> torch.Tensor:
    """The int8 kernel's panels [ceil(N/16), K/32, record] uint8 from a weight's fields.

    Per panel (16 output rows, zero rows pad the last) and block b: fp16 dw[16], for Q4_1 fp16
    mw[16] (else 32 zero bytes: records stay cache-line aligned), then per group g of 4 k the 16
    rows' 4 quants side by side (row j at bytes 4j..4j+3); Q4_0 / Q4_1 hold groups c and c + 4 in
    the low and high nibbles of chunk c (raw nibbles 0..15), Q8_0 its int8 quants
    (csrc/int8_gemm.cpp)."""
    q, d, m = fields
    n, k = q.shape
    nb, p = k // QK, -(-n // INT8_COLS)
    pad = p * INT8_COLS - n

    def header(t: torch.Tensor) -> torch.Tensor:  # [N, nb] fp16 values -> [P, nb, 32] bytes
        h = t.to(torch.float16)
        if not torch.equal(h.float(), t.float()):  # GGUF scales are fp16: never rounded here
            raise ValueError("int8 panels keep fp16 block scales; these scales are not fp16 values")
        h = torch.cat([h, h.new_zeros(pad, nb)])
        return h.view(p, INT8_COLS, nb).transpose(1, 2).contiguous().view(torch.uint8)

    qp = torch.cat([q, q.new_zeros(pad, k)]).view(p, INT8_COLS, nb, 8, 4).permute(0, 2, 3, 1, 4)  # [P, nb, g, 16, 4]
    if qtype == "Q8_0":
        quants = qp.to(torch.int8).contiguous().view(torch.uint8).reshape(p, nb, -1)
    else:
        quants = (qp[:, :, :4] | (qp[:, :, 4:] << 4)).to(torch.uint8).reshape(p, nb, -1)
    parts = [header(d), header(m) if qtype == "Q4_1" else torch.zeros(p, nb, 32, dtype=torch.uint8), quants]
    return torch.cat(parts, dim=-1).contiguous()


def int8_panel_fields(panels: torch.Tensor, qtype: str, out_features: int, in_features: int) -> Fields:
    """The fields back from the panels (``pack_int8_panels``'s inverse)."""
    p, nb = panels.shape[0], in_features // QK
    h = INT8_HEADER[qtype]
    def rows(t: torch.Tensor) -> torch.Tensor:  # [P, nb, 32] bytes -> [N, nb] fp32 (exact widening)
        return t.contiguous().view(torch.float16).float().transpose(1, 2).reshape(-1, nb)[:out_features]

    d = rows(panels[..., :32])
    m = rows(panels[..., 32:64]) if qtype == "Q4_1" else None
    raw = panels[..., h:]
    if qtype == "Q8_0":
        qg = raw.contiguous().view(torch.int8).reshape(p, nb, 8, INT8_COLS, 4).to(torch.int16)
    else:
        c = raw.reshape(p, nb, 4, INT8_COLS, 4).to(torch.int16)
        qg = torch.cat([c & 0x0F, c >> 4], dim=2)  # groups 0-3 then 4-7
    q = qg.permute(0, 3, 1, 2, 4).reshape(-1, in_features)[:out_features]
    return q.contiguous(), d.contiguous(), None if m is None else m.contiguous()


def int8_linear(x: torch.Tensor, panels: torch.Tensor, qtype: str, out_features: int, bits: int = 8) -> torch.Tensor:
    """The twin of ``int8_gemm_f32``: x quantized as the kernel does (``bits`` 8 or 16), both
    sides' values in fp64, one matmul, rounded to fp32. The kernel's integer block sums are
    exact, so it differs from this only by fp32 rounding of the per-block scaling and the sum
    over blocks."""
    k = x.shape[-1]
    q, d, _ = quantize_activations(x.reshape(-1, k), bits)
    xd = (q.double().reshape(q.shape[0], k // QK, QK) * d.double()[..., None]).reshape(q.shape)
    w = dequantize_fields(int8_panel_fields(panels, qtype, out_features, k), qtype)
    return (xd @ w.T).float().reshape(*x.shape[:-1], out_features)
