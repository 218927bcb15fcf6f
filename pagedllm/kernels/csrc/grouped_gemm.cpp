// GGUF weight-only GEMM for steps of a few tokens. GGUF stores 32-weight blocks along K:
//   Q4_1: fp16 d, fp16 m, 16 bytes: weight i = d * nibble_i + m; byte j holds i=j (low) and i=j+16 (high)
//   Q8_0: fp16 d, 32 int8:          weight i = d * q_i
// At load time the blocks are regrouped (pagedllm/kernels/reference.py: group_blocks): output
// rows in groups of 16 and, per block index, the 16 rows' fp16 scales (and minima), then the
// 16 rows' quants of every k (Q4_1: in chunks of 4 k, one 32-bit word per row pair, below).
// The kernel vectorises over output columns and keeps k sequential: each y[m, n] is
// acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ..., K-1 from 0, exactly the dense GEMM's
// order (panel_gemm.cpp), and w = d * q + m is exact in its product (an fp16 scale times a 4-
// or 8-bit integer fits fp32's mantissa), so it equals the fp32 copy's weight.
// Both kernels therefore give bit-identical rows, whatever the number of rows in the step:
// this is what makes a request's logits independent of what it is batched with.

#include "common.h"
#include "kernels.h"

#include <type_traits>

namespace {

constexpr int QK = 32;
constexpr int GROUP_ROWS = 16;

// Q4_1: qs[c][j][t] holds k = 4c + t of row j (low nibble) and of row j + 8 (high nibble), so
// the 4-byte word qs[c][j] is rows j and j + 8 over 4 consecutive k: one 32-byte load gives a
// vector lane per row for 4 columns, and each column's nibble is one AND away (no widening
// shuffle or shift per column; see weights_of_chunk). Q8_0: qs[k][j] is row j.
// d, m: fp16 as in the file (0.625 and 1.06 bytes per weight).
struct GroupQ4_1 { uint16_t d[GROUP_ROWS]; uint16_t m[GROUP_ROWS]; uint8_t qs[QK / 4][GROUP_ROWS / 2][4]; };
struct GroupQ8_0 { uint16_t d[GROUP_ROWS]; int8_t qs[QK][GROUP_ROWS]; };
static_assert(sizeof(GroupQ4_1) == 320, "Q4_1 group-block is 320 bytes");
static_assert(sizeof(GroupQ8_0) == 544, "Q8_0 group-block is 544 bytes");

// One row's step streams every weight from DRAM once, and the hardware prefetcher alone kept
// a core at ~8 GB/s of it (the same kernel reads ~12 GB/s from L3): ask for the group-block
// PREFETCH_BLOCKS ahead of the one being multiplied, all its cache lines, into L2
// (prefetcht1). A tile reads NG streams (its groups, nb blocks apart); near a stream's end the
// blocks ahead are those of the same stream of the next tile (the thread's next item: its
// items are consecutive), so that tile starts on prefetched data too - with K = 576 a tile is
// only 18 blocks per stream.
// Measured on Zen 4 (the model's 121 one-row linears in turn, 96 MB, alternated in one
// process): into L1 (prefetcht0) 3 blocks ahead 4.7-4.9 ms, and no better at 8-32 blocks;
// into L2 8-12 blocks ahead 3.8-4.0 ms, the time of the same calls with their weights already
// in cache. L1's few miss buffers were the limit. Two rows gain as much; four or more are
// compute-bound and unchanged.
constexpr int PREFETCH_BLOCKS = 8;
constexpr int PREFETCH_LOCALITY = 2;  // __builtin_prefetch's: 2 = prefetcht1 (L2)
template <int NG, typename Group>
inline void prefetch_ahead(const Group* grp, int g, int64_t b, int64_t nb) {
    if constexpr (PREFETCH_BLOCKS > 0) {
        int64_t ahead = g * nb + b + PREFETCH_BLOCKS;
        if (b + PREFETCH_BLOCKS >= nb) ahead += (NG - 1) * nb;
        // The builtin, not common.h's prefetch_rows: GCC keeps it in this loop (the attention
        // loops' reason for inline asm), and the asm version measured 1-4% slower here.
        const char* p = reinterpret_cast<const char*>(grp + ahead);
        for (size_t off = 0; off < sizeof(Group); off += 64) __builtin_prefetch(p + off, 0, PREFETCH_LOCALITY);
    }
}

// The 16 weights of column k of a group-block (scalar path).
inline void weights16(const GroupQ4_1& g, int k, float* w) {
    for (int j = 0; j < 8; j++) {
        const uint8_t byte = g.qs[k / 4][j][k % 4];
        const int q[2] = {byte & 0x0f, byte >> 4};
        for (int h = 0; h < 2; h++)
            w[j + 8 * h] = float(q[h]) * pagedllm_f16_to_f32(g.d[j + 8 * h]) + pagedllm_f16_to_f32(g.m[j + 8 * h]);
    }
}
inline void weights16(const GroupQ8_0& g, int k, float* w) {
    for (int j = 0; j < GROUP_ROWS; j++) w[j] = float(g.qs[k][j]) * pagedllm_f16_to_f32(g.d[j]);
}

#ifdef PAGEDLLM_AVX2
// A Q8_0 group-block's scales held in registers while its 32 k pass.
struct ScalesQ8_0 { __m256 d0, d1; };
inline ScalesQ8_0 scales(const GroupQ8_0& g) { return {pagedllm_load_f16x8(g.d), pagedllm_load_f16x8(g.d + 8)}; }

// Q4_1 by chunks of 4 columns. Lane j of `lo` (`hi`: the word shifted down a nibble) holds
// row j's (row j + 8's) quant of column 4c + t in bits 8t..8t+3, so AND with 0xF << 8t gives
// q * 2^(8t) exactly, and fma(q * 2^(8t), d * 2^(-8t), m) = fma(q, d, m) bit for bit: both
// products are exact (a power of two changes neither mantissa; d * 2^-24 of the smallest fp16
// is still a normal fp32), so the one rounding is the same. The scales d * 2^(-8t) of a
// group-block are made once per block (ChunkScalesQ4_1).
struct ChunkScalesQ4_1 { __m256 d[4][2]; __m256 m0, m1; };
inline ChunkScalesQ4_1 chunk_scales(const GroupQ4_1& g) {
    ChunkScalesQ4_1 s;
    const __m256 d0 = pagedllm_load_f16x8(g.d), d1 = pagedllm_load_f16x8(g.d + 8);
    for (int t = 0; t < 4; t++) {
        const __m256 p = _mm256_set1_ps(1.f / float(1 << (8 * t)));
        s.d[t][0] = _mm256_mul_ps(d0, p);
        s.d[t][1] = _mm256_mul_ps(d1, p);
    }
    s.m0 = pagedllm_load_f16x8(g.m);
    s.m1 = pagedllm_load_f16x8(g.m + 8);
    return s;
}
inline void weights_of_chunk(__m256i lo, __m256i hi, const ChunkScalesQ4_1& s, int t, __m256& w0, __m256& w1) {
    const __m256i mask = _mm256_set1_epi32(0x0f << (8 * t));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), s.d[t][0], s.m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)), s.d[t][1], s.m1);
}
inline void weights16(const GroupQ8_0& g, const ScalesQ8_0& s, int k, __m256& w0, __m256& w1) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g.qs[k]));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), s.d0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(raw, raw))), s.d1);
}
#endif

#ifdef PAGEDLLM_AVX512
// AVX-512: a group-block's 16 rows are one zmm, so a column's 16 weights cost one AND, one
// convert and one FMA (AVX2: two of each), and a tile can hold more rows.
struct Scales512Q8_0 { __m512 d; };
inline __m512 load_f16x16(const uint16_t* h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline Scales512Q8_0 scales512(const GroupQ8_0& g) { return {load_f16x16(g.d)}; }

// Q4_1 by chunks of 4 columns, as the AVX2 path (chunk_scales): the chunk's 8 words twice,
// lanes 8-15 shifted down a nibble, so lane j holds row j's quants of the 4 columns, column
// 4c + t in bits 8t..8t+3; AND gives q * 2^(8t), and the scale d * 2^(-8t) undoes it exactly.
struct ChunkScales512Q4_1 { __m512 d[4]; __m512 m; };
inline ChunkScales512Q4_1 chunk_scales512(const GroupQ4_1& g) {
    ChunkScales512Q4_1 s;
    const __m512 d = load_f16x16(g.d);
    for (int t = 0; t < 4; t++) s.d[t] = _mm512_mul_ps(d, _mm512_set1_ps(1.f / float(1 << (8 * t))));
    s.m = load_f16x16(g.m);
    return s;
}
inline __m512i chunk_words512(const GroupQ4_1& g, int c) {
    const __m512i words = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g.qs[c])));
    return _mm512_srlv_epi32(words, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0));
}
inline __m512 weights_of_chunk512(__m512i words, const ChunkScales512Q4_1& s, int t) {
    const __m512i q = _mm512_and_si512(words, _mm512_set1_epi32(0x0f << (8 * t)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s.d[t], s.m);
}
inline __m512 weights16(const GroupQ8_0& g, const Scales512Q8_0& s, int k) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g.qs[k]));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), s.d);
}

// gemm_tile (below) with one zmm per row and group: MR * NG accumulators, each the same k
// chain as the AVX2 and portable tiles', so every ISA gives the same bits.
template <typename Group, int MR, int NG>
void gemm_tile512(float* y, int64_t ldy, const float* x, int64_t ldx, const Group* grp, int64_t nb, int cols) {
    __m512 acc[MR][NG];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) acc[i][g] = _mm512_setzero_ps();
    // Column k's weights w (NG vectors) meet the MR rows of x.
    auto accumulate = [&](const float* xk, const __m512* w) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_set1_ps(xk[i * ldx]);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) acc[i][g] = _mm512_fmadd_ps(xv, w[g], acc[i][g]);
        }
    };
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * QK;
        if constexpr (std::is_same_v<Group, GroupQ4_1>) {
            ChunkScales512Q4_1 s[NG];
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) {
                prefetch_ahead<NG>(grp, g, b, nb);
                s[g] = chunk_scales512(grp[g * nb + b]);
            }
            for (int c = 0; c < QK / 4; c++) {
                __m512i words[NG];
#pragma GCC unroll 4
                for (int g = 0; g < NG; g++) words[g] = chunk_words512(grp[g * nb + b], c);
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m512 w[NG];
#pragma GCC unroll 4
                    for (int g = 0; g < NG; g++) w[g] = weights_of_chunk512(words[g], s[g], t);
                    accumulate(xb + 4 * c + t, w);
                }
            }
        } else {
            Scales512Q8_0 s[NG];
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) {
                prefetch_ahead<NG>(grp, g, b, nb);
                s[g] = scales512(grp[g * nb + b]);
            }
            for (int k = 0; k < QK; k++) {
                __m512 w[NG];
#pragma GCC unroll 4
                for (int g = 0; g < NG; g++) w[g] = weights16(grp[g * nb + b], s[g], k);
                accumulate(xb + k, w);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            const int n = std::min(GROUP_ROWS, cols - GROUP_ROWS * g);
            if (n > 0) _mm512_mask_storeu_ps(y + i * ldy + GROUP_ROWS * g, __mmask16((1u << n) - 1), acc[i][g]);
        }
}

// The rows of a tile smaller than MR (the last one), in a tile of their own size.
template <typename Group, int MR, int NG>
void gemm_rows512(float* y, int64_t ldy, const float* x, int64_t ldx, const Group* grp, int64_t nb, int cols, int rows) {
    if constexpr (MR > 0) {
        if (rows == MR) return gemm_tile512<Group, MR, NG>(y, ldy, x, ldx, grp, nb, cols);
        gemm_rows512<Group, MR - 1, NG>(y, ldy, x, ldx, grp, nb, cols, rows);
    }
}

// All M rows against NG groups starting at column n0, in row tiles of up to 8 / NG (8 rows
// measured faster than 4, 12 or 16 on Zen 4).
template <typename Group, int NG>
void gemm_groups512(float* y, const float* x, const Group* grp, int64_t M, int64_t N, int64_t K, int64_t n0) {
    constexpr int MR = 8 / NG;
    const int64_t nb = K / QK;
    const int cols = int(std::min<int64_t>(GROUP_ROWS * NG, N - n0));
    for (int64_t m0 = 0; m0 < M; m0 += MR)
        gemm_rows512<Group, MR, NG>(y + m0 * N + n0, N, x + m0 * K, K, grp, nb, cols, int(std::min<int64_t>(MR, M - m0)));
}
#endif

// y[0..MR-1, 0..16*NG-1] (`cols` of them stored) = MR rows of x times NG consecutive groups
// (their group-blocks `nb` apart). MR and NG are template arguments so the accumulators stay
// in registers: MR * 2 * NG vectors (at most 8), each column's k chain in order.
template <typename Group, int MR, int NG>
void gemm_tile(float* y, int64_t ldy, const float* x, int64_t ldx, const Group* grp, int64_t nb, int cols) {
    constexpr int NC = GROUP_ROWS * NG;
#ifdef PAGEDLLM_AVX2
    // Every loop over the accumulators is unrolled, so GCC keeps them in registers rather than
    // storing the array on every k (measured: 1.4x slower).
    __m256 acc[MR][2 * NG];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NG; v++) acc[i][v] = _mm256_setzero_ps();
    // Column k's weights w (2 * NG vectors) meet the MR rows of x.
    auto accumulate = [&](const float* xk, const __m256* w) {
#pragma GCC unroll 4
        for (int i = 0; i < MR; i++) {
            const __m256 xv = _mm256_broadcast_ss(xk + i * ldx);
#pragma GCC unroll 4
            for (int v = 0; v < 2 * NG; v++) acc[i][v] = _mm256_fmadd_ps(xv, w[v], acc[i][v]);
        }
    };
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * QK;
        if constexpr (std::is_same_v<Group, GroupQ4_1>) {
            ChunkScalesQ4_1 s[NG];
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) {
                prefetch_ahead<NG>(grp, g, b, nb);
                s[g] = chunk_scales(grp[g * nb + b]);
            }
            for (int c = 0; c < QK / 4; c++) {
                __m256i lo[NG], hi[NG];
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) {
                    lo[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp[g * nb + b].qs[c]));
                    hi[g] = _mm256_srli_epi32(lo[g], 4);
                }
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m256 w[2 * NG];
#pragma GCC unroll 2
                    for (int g = 0; g < NG; g++) weights_of_chunk(lo[g], hi[g], s[g], t, w[2 * g], w[2 * g + 1]);
                    accumulate(xb + 4 * c + t, w);
                }
            }
        } else {
            ScalesQ8_0 s[NG];
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) {
                prefetch_ahead<NG>(grp, g, b, nb);
                s[g] = scales(grp[g * nb + b]);
            }
            for (int k = 0; k < QK; k++) {
                __m256 w[2 * NG];
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) weights16(grp[g * nb + b], s[g], k, w[2 * g], w[2 * g + 1]);
                accumulate(xb + k, w);
            }
        }
    }
    alignas(32) float tile[MR][NC];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 2 * NG; v++) _mm256_store_ps(tile[i] + 8 * v, acc[i][v]);
#else
    float tile[MR][NC] = {};
    float w[NC];
    for (int64_t b = 0; b < nb; b++)
        for (int k = 0; k < QK; k++) {
            for (int g = 0; g < NG; g++) weights16(grp[g * nb + b], k, w + GROUP_ROWS * g);
            for (int i = 0; i < MR; i++) {
                const float v = x[i * ldx + b * QK + k];
#pragma omp simd
                for (int j = 0; j < NC; j++) tile[i][j] += v * w[j];
            }
        }
#endif
    for (int i = 0; i < MR; i++) std::memcpy(y + i * ldy, tile[i], cols * sizeof(float));
}

// All M rows against NG groups starting at column n0: row tiles of up to 4 (2 when NG = 2).
template <typename Group, int NG>
void gemm_groups(float* y, const float* x, const Group* grp, int64_t M, int64_t N, int64_t K, int64_t n0) {
    const int64_t nb = K / QK;
    const int cols = int(std::min<int64_t>(GROUP_ROWS * NG, N - n0));
    constexpr int MR = NG == 1 ? 4 : 2;
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        float* yt = y + m0 * N + n0;
        const float* xt = x + m0 * K;
        const int64_t rows = std::min<int64_t>(MR, M - m0);
        if constexpr (NG == 2) {
            if (rows == 1) gemm_tile<Group, 1, 2>(yt, N, xt, K, grp, nb, cols);
            else gemm_tile<Group, 2, 2>(yt, N, xt, K, grp, nb, cols);
        } else {
            switch (rows) {
                case 1: gemm_tile<Group, 1, 1>(yt, N, xt, K, grp, nb, cols); break;
                case 2: gemm_tile<Group, 2, 1>(yt, N, xt, K, grp, nb, cols); break;
                case 3: gemm_tile<Group, 3, 1>(yt, N, xt, K, grp, nb, cols); break;
                default: gemm_tile<Group, 4, 1>(yt, N, xt, K, grp, nb, cols); break;
            }
        }
    }
}

template <typename Group>
void grouped_gemm(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nb = K / QK;
    const int64_t num_groups = (N + GROUP_ROWS - 1) / GROUP_ROWS;
    const Group* groups = reinterpret_cast<const Group*>(w);
    // Two groups (32 columns) per pass for one or two rows: 4-8 independent FMA chains hide
    // the FMA latency; with more rows, one group per pass feeds the row tiles.
    const bool pairs = M <= 2;
    const int64_t items = pairs ? (num_groups + 1) / 2 : num_groups;
#ifdef PAGEDLLM_AVX512
    // With one or two Q4_1 rows the AVX2 tile is faster on Zen 4, which runs a 512-bit op as
    // two 256-bit halves (measured with the chunked quants: 120 decoder linears at one row
    // 3.0 vs 3.4 ms); with more rows the zmm tile's 8-row tiles share the dequant. With two
    // full-width 512-bit FMA units (g_wide_fma: Intel) the zmm tile wins at one row too: a
    // cache-resident 1536 x 576 Q4_1 linear 69.6 -> 50.1 us on one thread, W2 8.4-8.7 ->
    // 7.2-8.1 ms per token alternated (Intel Xeon model 207). The bits are the same either way.
    const bool zmm = g_wide_fma || !(pairs && std::is_same_v<Group, GroupQ4_1>);
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < items; it++) {
#ifdef PAGEDLLM_AVX512
        if (zmm) {
            if (!pairs) {
                gemm_groups512<Group, 1>(y, x, groups + it * nb, M, N, K, it * GROUP_ROWS);
            } else if (2 * it + 1 < num_groups) {
                gemm_groups512<Group, 2>(y, x, groups + 2 * it * nb, M, N, K, 2 * it * GROUP_ROWS);
            } else {
                gemm_groups512<Group, 1>(y, x, groups + 2 * it * nb, M, N, K, 2 * it * GROUP_ROWS);
            }
            continue;
        }
#endif
        if (!pairs) {
            gemm_groups<Group, 1>(y, x, groups + it * nb, M, N, K, it * GROUP_ROWS);
        } else if (2 * it + 1 < num_groups) {
            gemm_groups<Group, 2>(y, x, groups + 2 * it * nb, M, N, K, 2 * it * GROUP_ROWS);
        } else {
            gemm_groups<Group, 1>(y, x, groups + 2 * it * nb, M, N, K, 2 * it * GROUP_ROWS);
        }
    }
}

}  // namespace

// y: [M, N] fp32, x: [M, K] fp32 contiguous, w: grouped blocks (see above). K % 32 == 0.
void grouped_gemm_q4_1(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads) {
    grouped_gemm<GroupQ4_1>(y, x, w, M, N, K, nthreads);
}

void grouped_gemm_q8_0(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads) {
    grouped_gemm<GroupQ8_0>(y, x, w, M, N, K, nthreads);
}
