// The fast mode's GEMM: int8 activations times GGUF integer weights (Q4_0, Q4_1, Q8_0), the
// way llama.cpp multiplies them (activation_dtype="int8"; pagedllm/quantization/int8_activations.py).
//
// Activations: each row of x is cut into 32-wide blocks; a block becomes 32 int8 quants
// q = round_half_even(x * 127 / amax) in [-127, 127], its scale dx = amax / 127 (fp32), and the
// sum of its quants sx (int32; with dx: the Q4_1 minimum's term, and the Q4_0 / Q8_0 offsets).
// Weights: repacked once at load (pagedllm/kernels/reference.py: pack_int8_panels) into panels
// of 16 output rows ("columns" of y); for each 32-weight block index b a panel holds a record:
//   [dw: 16 fp16] [mw: 16 fp16 for Q4_1, else 32 zero bytes] [quants]
// (the GGUF blocks' own fp16 scales, widened exactly to fp32 when used: a one-row step reads
// 0.625 bytes per Q4_1 weight, as the GGUF blocks themselves; the header stays 64 bytes so
// that every record, and every 64-byte load of quants, starts on a cache line - Q8_0 records
// of 544 bytes measured 15% slower in the LM head than 576)
// quants, for each group g of 4 consecutive k (8 per block): the 16 columns' 4 bytes side by
// side (64 bytes, column j at bytes 4j..4j+3) - the lane layout of vpdpbusd / vpmaddwd, whose
// int32 lane j sums 4 byte products. Q4_x packs two groups in one 64-byte chunk c (0..3):
// group c in the low nibbles, group c + 4 in the high ones; Q8_0 stores its int8 quants.
//
// Per output (m, n) and block b the integer dot product isum = sum_k qx[k] * q[k] is exact
// (int32), then scaled in fp32:
//   Q4_0: w = dw * (q - 8):  y += dx * dw * (isum - 8 * sx)
//   Q4_1: w = dw * q + mw:   y += dx * dw * isum + mw * (dx * sx)
//   Q8_0: w = dw * q:        y += dx * dw * isum
// The offsets (8, and 128 for the VNNI Q8_0 trick below) are subtracted in the integer
// accumulator, which starts each block at -offset * sx: exact, no cancellation in fp32.
//
// Instruction sets, chosen at compile time (-march=native):
// - AMX-INT8 where the compiler targets it and Linux grants the tile state (at run time): tile
//   dot products for steps of 16 rows or more, the VNNI tiles for the rest (see "AMX-INT8").
// - AVX512-VNNI: vpdpbusd (u8 x s8, 4 products summed into int32 lanes). Q4 nibbles are the
//   unsigned operand as they are; Q8_0 quants are made unsigned by adding 128 (xor 0x80),
//   whose term 128 * sx is the accumulator's start.
// - AVX2: vpmaddubsw (u8 x s8 -> int16 pairs, saturating) then vpmaddwd by 1 (-> int32).
//   Q4 pairs are at most 2 * 15 * 127, so the 8 groups of a block add up in int16 (<= 30480)
//   before one vpmaddwd; Q8_0 uses |w| x sign(x, w) so a pair stays <= 2 * 128 * 127.
// - otherwise portable scalar code over the same layout.
// Every path computes the same int32 sums; the fp32 scaling is done in the same order, so the
// three builds agree to a few ulps (the tests compare each with the fp64 twin).
//
// Wide activations (activation_dtype="int16"): a block becomes Q = round_half_even(x * 32258 /
// amax) (|Q| <= 32258 = 254 * 127), scale dx = amax / 32258, sum sx = sum Q - 256 times finer
// than int8, and close enough to fp32 that greedy outputs match on the parity prompts. Q is split
// into two int8 halves, Q = 254 * q1 + q2 with q1 = floor((Q + 127) / 254) in [-127, 127] and q2
// in [-127, 126], and each half meets the weights on the same instructions as int8 activations:
// isum = 254 * sum(q1 w) + sum(q2 w), exact in int32, then the same fp32 scaling. The offsets
// start the q2 accumulator (at -OFFSET * sx over Q: 254 * 128 * sum q1 + 128 * sum q2 = 128 sx).
// So the wide mode costs about twice the int8 dot products and nothing else changes.
//
// Work: x is quantized once per call (rows in parallel), then rows are taken in chunks that
// stay in L2 while every thread walks its share of the panels; a panel (K/32 records, 6-18 KB
// for K = 576-1536) stays in L1 while the chunk's rows pass over it in tiles of MR rows, each
// tile's outputs in registers. On VNNI a tile spans two adjacent panels (MR x 32 outputs: 6
// rows, 4 when wide), so each broadcast of x's quants feeds two weight vectors.

#include "common.h"

#include <atomic>
#include <type_traits>

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDLLM_I8_VNNI 1
#endif

// C-API-BEGIN
extern "C" {
const char* int8_gemm_isa();
int int8_gemm_use_amx(int32_t enabled);
void int8_quantize_rows(int8_t* q, int8_t* q2, float* d, int32_t* s, const float* x, int64_t ldx, int64_t M,
                        int64_t K, int32_t act_bits, int nthreads);
int int8_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int32_t ggml_type, int64_t M,
                  int64_t N, int64_t K, int32_t act_bits, int nthreads);
}
// C-API-END

namespace {

enum : int32_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 };
constexpr int COLS = 16;  // output columns per panel
constexpr int QK = 32;    // weights per block

template <int32_t T> constexpr int HEADER = 64;  // fp16 dw, then fp16 mw (Q4_1) or padding
template <int32_t T> constexpr int QUANT_BYTES = T == T_Q8_0 ? 512 : 256;  // 16 columns x 32 k
template <int32_t T> constexpr int RECORD = HEADER<T> + QUANT_BYTES<T>;
// The integer accumulator of a block starts at -OFFSET * sx (see the file comment).
template <int32_t T> constexpr int32_t OFFSET = T == T_Q4_0 ? 8 : 0;

// The first tile over a panel streams its records from DRAM (one- and two-row steps do nothing
// else): it asks for the record PREFETCH_RECORDS ahead in each of its NP panels, all its
// lines, into L2 (prefetcht1), as the fp32 grouped GEMM does (grouped_gemm.cpp: prefetch_ahead).
// Near a panel's end that is the same panel of the thread's next item (its items are
// consecutive). Later tiles of a chunk find the panel in cache and skip this.
// Measured on Zen 4 (the int8 mode's 121 linears in turn, 94 MiB, alternated in one process):
// one row 4.3-4.6 ms without it, 3.5 at 8 records ahead, 3.4 at 12-16; two rows 5.0-6.1 ->
// 4.3; 64 rows 34-38.5 -> 32.7-37.5.
constexpr int64_t PREFETCH_RECORDS = 16;
template <int32_t T, int NP>
inline void stream_ahead(const uint8_t* panel, int64_t panel_bytes, int j, int64_t b, int64_t nb) {
    if constexpr (PREFETCH_RECORDS > 0) {
        int64_t ahead = b + PREFETCH_RECORDS;
        if (ahead >= nb) ahead += (NP - 1) * nb;
        const uint8_t* p = panel + j * panel_bytes + ahead * RECORD<T>;
        for (int off = 0; off < RECORD<T>; off += 64) __builtin_prefetch(p + off, 0, 2);
    }
}

// x quantized: q [M][K] int8, d [M][nb] fp32, s [M][nb] int32 (row m's block b at m * nb + b).
struct QuantX {
    const int8_t* q;   // int8 quants, or the high halves q1 of wide ones
    const int8_t* q2;  // wide activations: the low halves (else null)
    const float* d;
    const int32_t* s;
    int64_t K, nb;
};

inline float dx_times_sx(const QuantX& xq, int64_t m, int64_t b) { return xq.d[m * xq.nb + b] * float(xq.s[m * xq.nb + b]); }

// A block holding a NaN or an inf: zero quants and sum, and the scale NaN / inf, so the block's
// products come out not finite, as the twin's (quants of NaN would be INT_MIN, saturated to a
// finite -128).
inline void nonfinite_block(int8_t* qb, int8_t* q2b, float* d, int32_t* s, const float* xb, float levels) {
    std::memset(qb, 0, QK);
    if (q2b != nullptr) std::memset(q2b, 0, QK);
    *s = 0;
    *d = absmax_keep_nan(xb, QK) / levels;
}

#ifdef PAGEDLLM_AVX2
// A block's largest |x| into *amax; false (amax untouched) when the block holds a NaN or an inf.
inline bool block_amax(const float* xb, float* amax) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xb + 8 * c), absmask);
        mx = _mm256_max_ps(mx, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or inf
    }
    if (_mm256_movemask_ps(bad)) return false;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    *amax = _mm_cvtss_f32(h);
    return true;
}

// The sum of a vector's 8 int32 lanes (a block's quant sum).
inline int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}
#endif

// One row's blocks: q = round_half_even(x * (127 / amax)), d = amax / 127. The same fp32
// operations as reference.quantize_activations, so the quants are bit-identical to it.
void quantize_row(int8_t* q, float* d, int32_t* s, const float* x, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float* xb = x + b * QK;
        int8_t* qb = q + b * QK;
        float amax = 0.f;
#ifdef PAGEDLLM_AVX2
        if (!block_amax(xb, &amax)) {
            nonfinite_block(qb, nullptr, d + b, s + b, xb, 127.f);
            continue;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i sum = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * c), idv));  // round to even
            sum = _mm256_add_epi32(sum, v);
            const __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + 8 * c), _mm_packs_epi16(p16, p16));
        }
        s[b] = hsum_epi32(sum);
#else
        amax = absmax_keep_nan(xb, QK);
        if (!std::isfinite(amax)) {
            nonfinite_block(qb, nullptr, d + b, s + b, xb, 127.f);
            continue;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = int(std::nearbyint(xb[i] * id));  // the default rounding: half to even
            qb[i] = int8_t(v);
            sum += v;
        }
        s[b] = sum;
#endif
        d[b] = amax / 127.f;
    }
}

// Wide quantization (see the file comment): Q = round_half_even(x * (32258 / amax)), split as
// 254 * q1 + q2, q1 = floor((Q + 127) / 254). The vector path divides by a multiply and a
// shift: with n = Q + 127 + 254 * 128 in [381, 64897] (non-negative), floor(n / 254) =
// (n * 66053) >> 24 for every such n (checked exhaustively; the product stays below 2^32), and
// q1 is that minus 128. The scalar path divides in fp32, whose floor is exact here (Q + 127 <
// 2^24, and a non-integer quotient is at least 1/254 below the next integer), as the torch
// twin does with integers: the three give the same quants.
constexpr float WIDE_LEVELS = 32258.f;  // 254 * 127
void quantize_row_wide(int8_t* q1, int8_t* q2, float* d, int32_t* s, const float* x, int64_t K) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float* xb = x + b * QK;
#ifdef PAGEDLLM_AVX2
        float amax = 0.f;
        if (!block_amax(xb, &amax)) {
            nonfinite_block(q1 + b * QK, q2 + b * QK, d + b, s + b, xb, WIDE_LEVELS);
            continue;
        }
        const float id = amax > 0.f ? WIDE_LEVELS / amax : 0.f;
        const __m256 idv = _mm256_set1_ps(id);
        const __m256i shift = _mm256_set1_epi32(127 + 254 * 128), magic = _mm256_set1_epi32(66053);
        const __m256i k128 = _mm256_set1_epi32(128), k254 = _mm256_set1_epi32(254);
        __m256i vsum = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * c), idv));  // round to even
            const __m256i n = _mm256_add_epi32(v, shift);
            const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_mullo_epi32(n, magic), 24), k128);
            const __m256i lo = _mm256_sub_epi32(v, _mm256_mullo_epi32(hi, k254));
            vsum = _mm256_add_epi32(vsum, v);
            const __m128i h16 = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
            const __m128i l16 = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(q1 + b * QK + 8 * c), _mm_packs_epi16(h16, h16));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(q2 + b * QK + 8 * c), _mm_packs_epi16(l16, l16));
        }
        s[b] = hsum_epi32(vsum);
#else
        const float amax = absmax_keep_nan(xb, QK);
        if (!std::isfinite(amax)) {
            nonfinite_block(q1 + b * QK, q2 + b * QK, d + b, s + b, xb, WIDE_LEVELS);
            continue;
        }
        const float id = amax > 0.f ? WIDE_LEVELS / amax : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = int(std::nearbyint(xb[i] * id));
            const int hi = int(std::floor(float(v + 127) / 254.f));
            q1[b * QK + i] = int8_t(hi);
            q2[b * QK + i] = int8_t(v - 254 * hi);
            sum += v;
        }
        s[b] = sum;
#endif
        d[b] = amax / WIDE_LEVELS;
    }
}

// Store `cols` of a tile row's 16 outputs.
inline void store_row(float* y, const float* v, int cols) { std::memcpy(y, v, sizeof(float) * cols); }

#if defined(PAGEDLLM_I8_VNNI)
// MR rows of x (from row m0) against one panel: y[MR][cols]. MR is a compile-time count so
// the 2 * MR accumulators (int32 for the block, fp32 for the row) stay in registers.
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;
inline __m512i bcast4_512(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(p)); }
// A panel record's 16 fp16 scales, widened (exactly) to fp32.
inline __m512 load_f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// acc + row m's block b of 16 outputs, from their int32 sums isum and the panel record's
// scales dw (and, Q4_1, minima mw): the fp32 operations of every AVX-512 tile (VNNI and AMX),
// in one order, so the two give the same bits.
template <int32_t T>
inline __m512 add_block(__m512 acc, __m512i isum, __m512 dw, __m512 mw, const QuantX& xq, int64_t m, int64_t b) {
    const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), dw);
    acc = _mm512_fmadd_ps(t, _mm512_set1_ps(xq.d[m * xq.nb + b]), acc);
    if constexpr (T == T_Q4_1) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx_times_sx(xq, m, b)), acc);
    return acc;
}

// MR rows of x (from row m0) against NP adjacent panels (16 * NP columns of y; the last panel
// has `cols` valid ones): each broadcast quadruple of x meets NP panels' weights, and MR is a
// compile-time count so the accumulators (int32 for the block, fp32 for the row) stay in
// registers. WIDE: x's quants come in two halves (q1 in xq.q, q2 in xq.q2); s accumulates
// q1 . w from 0 and s2 q2 . w from the offset term, and the block's isum is 254 * s + s2.
template <int32_t T, int MR, bool WIDE, int NP>
void tile(float* y, int64_t ldy, int cols, const QuantX& xq, int64_t m0, const uint8_t* panel, int64_t panel_bytes,
          bool stream) {
    __m512 acc[MR][NP];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps();
    const int8_t* xr[MR];
    const int8_t* xr2[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        xr[i] = xq.q + (m0 + i) * xq.K;
        xr2[i] = WIDE ? xq.q2 + (m0 + i) * xq.K : nullptr;
    }
    for (int64_t b = 0; b < xq.nb; b++) {
        const uint8_t* rec[NP];
        for (int j = 0; j < NP; j++) rec[j] = panel + j * panel_bytes + b * RECORD<T>;
        if (stream)
            for (int j = 0; j < NP; j++) stream_ahead<T, NP>(panel, panel_bytes, j, b, xq.nb);
        __m512i s[MR][NP], s2[MR][NP];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const int32_t sx = xq.s[(m0 + i) * xq.nb + b];
            const __m512i start = _mm512_set1_epi32(T == T_Q8_0 ? -128 * sx : -OFFSET<T> * sx);
            for (int j = 0; j < NP; j++) {
                if constexpr (WIDE) {
                    s[i][j] = _mm512_setzero_si512();
                    s2[i][j] = start;
                } else {
                    s[i][j] = start;
                }
            }
        }
        if constexpr (T == T_Q8_0) {
            const __m512i flip = _mm512_set1_epi8(char(0x80));
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m512i w[NP];
                for (int j = 0; j < NP; j++)  // q + 128, unsigned
                    w[j] = _mm512_xor_si512(_mm512_loadu_si512(rec[j] + HEADER<T> + 64 * g), flip);
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    const __m512i xv = bcast4_512(xr[i] + b * QK + 4 * g);
                    for (int j = 0; j < NP; j++) s[i][j] = _mm512_dpbusd_epi32(s[i][j], w[j], xv);
                    if constexpr (WIDE) {
                        const __m512i xv2 = bcast4_512(xr2[i] + b * QK + 4 * g);
                        for (int j = 0; j < NP; j++) s2[i][j] = _mm512_dpbusd_epi32(s2[i][j], w[j], xv2);
                    }
                }
            }
        } else {
            const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m512i lo[NP], hi[NP];
                for (int j = 0; j < NP; j++) {
                    const __m512i v = _mm512_loadu_si512(rec[j] + HEADER<T> + 64 * c);
                    lo[j] = _mm512_and_si512(v, low);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
#pragma GCC unroll 8
                for (int i = 0; i < MR; i++) {
                    const __m512i x0 = bcast4_512(xr[i] + b * QK + 4 * c), x1 = bcast4_512(xr[i] + b * QK + 4 * (c + 4));
                    for (int j = 0; j < NP; j++) {
                        s[i][j] = _mm512_dpbusd_epi32(s[i][j], lo[j], x0);
                        s[i][j] = _mm512_dpbusd_epi32(s[i][j], hi[j], x1);
                    }
                    if constexpr (WIDE) {
                        const __m512i z0 = bcast4_512(xr2[i] + b * QK + 4 * c);
                        const __m512i z1 = bcast4_512(xr2[i] + b * QK + 4 * (c + 4));
                        for (int j = 0; j < NP; j++) {
                            s2[i][j] = _mm512_dpbusd_epi32(s2[i][j], lo[j], z0);
                            s2[i][j] = _mm512_dpbusd_epi32(s2[i][j], hi[j], z1);
                        }
                    }
                }
            }
        }
        if constexpr (WIDE) {
            const __m512i k254 = _mm512_set1_epi32(254);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++)
                for (int j = 0; j < NP; j++) s[i][j] = _mm512_add_epi32(_mm512_mullo_epi32(s[i][j], k254), s2[i][j]);
        }
        for (int j = 0; j < NP; j++) {
            const __m512 dw = load_f16x16(rec[j]);
            const __m512 mw = T == T_Q4_1 ? load_f16x16(rec[j] + 32) : _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) acc[i][j] = add_block<T>(acc[i][j], s[i][j], dw, mw, xq, m0 + i, b);
        }
    }
    const __mmask16 last = __mmask16((1u << cols) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++) _mm512_mask_storeu_ps(y + i * ldy + j * COLS, j == NP - 1 ? last : __mmask16(0xFFFF), acc[i][j]);
}
// Rows per tile: (2 or 3 accumulators per row and panel) x NP within the 32 registers.
template <bool WIDE, int NP> constexpr int MR_MAX = NP == 2 ? (WIDE ? 4 : 6) : (WIDE ? 6 : 8);
constexpr int NP_MAX = 2;  // panels per tile

#elif defined(PAGEDLLM_AVX2)
inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// As the VNNI tile, with each panel as two 8-column halves (16 registers: MR <= 2 keeps the
// 4 * MR accumulators, the weights and a broadcast in them; wide activations take one row).
template <int32_t T, int MR, bool WIDE, int NP>
void tile(float* y, int64_t ldy, int cols, const QuantX& xq, int64_t m0, const uint8_t* panel, int64_t, bool stream) {
    static_assert(NP == 1, "one panel per tile");
    constexpr int P = WIDE ? 2 : 1;  // quant halves: p = 0 (q or q1), 1 (q2)
    __m256 acc[MR][2];
    for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i ones16 = _mm256_set1_epi16(1);
    auto xrow = [&](int p, int i) { return (p == 0 ? xq.q : xq.q2) + (m0 + i) * xq.K; };
    for (int64_t b = 0; b < xq.nb; b++) {
        const uint8_t* rec = panel + b * RECORD<T>;
        if (stream) stream_ahead<T, 1>(panel, 0, 0, b, xq.nb);
        const uint8_t* qs = rec + HEADER<T>;
        __m256i s[P][MR][2];  // int32 sums of each half's products
        if constexpr (T == T_Q8_0) {
            for (int p = 0; p < P; p++)
                for (int i = 0; i < MR; i++) s[p][i][0] = s[p][i][1] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g));
                const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g + 32));
                const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);  // |w|
                for (int p = 0; p < P; p++)
                    for (int i = 0; i < MR; i++) {
                        const __m256i xv = bcast4(xrow(p, i) + b * QK + 4 * g);
                        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xv, w0));
                        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xv, w1));
                        s[p][i][0] = _mm256_add_epi32(s[p][i][0], _mm256_madd_epi16(p0, ones16));
                        s[p][i][1] = _mm256_add_epi32(s[p][i][1], _mm256_madd_epi16(p1, ones16));
                    }
            }
        } else {
            const __m256i low = _mm256_set1_epi8(0x0F);
            __m256i h[P][MR][2];  // int16 pair sums over the block's 8 groups (<= 30480: no overflow)
            for (int p = 0; p < P; p++)
                for (int i = 0; i < MR; i++) h[p][i][0] = h[p][i][1] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                for (int half = 0; half < 2; half++) {
                    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * c + 32 * half));
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int p = 0; p < P; p++)
                        for (int i = 0; i < MR; i++) {
                            const int8_t* xb = xrow(p, i) + b * QK;
                            h[p][i][half] = _mm256_add_epi16(h[p][i][half], _mm256_maddubs_epi16(lo, bcast4(xb + 4 * c)));
                            h[p][i][half] = _mm256_add_epi16(h[p][i][half], _mm256_maddubs_epi16(hi, bcast4(xb + 4 * (c + 4))));
                        }
                }
            }
            for (int p = 0; p < P; p++)
                for (int i = 0; i < MR; i++) {
                    s[p][i][0] = _mm256_madd_epi16(h[p][i][0], ones16);
                    s[p][i][1] = _mm256_madd_epi16(h[p][i][1], ones16);
                }
        }
        for (int i = 0; i < MR; i++) {
            // The offset term (Q4_0) joins the last half's sum; wide: isum = 254 * s[0] + s[1].
            const __m256i start = _mm256_set1_epi32(T == T_Q8_0 ? 0 : -OFFSET<T> * xq.s[(m0 + i) * xq.nb + b]);
            for (int c = 0; c < 2; c++) {
                __m256i isum = _mm256_add_epi32(s[P - 1][i][c], start);
                if constexpr (WIDE) isum = _mm256_add_epi32(_mm256_mullo_epi32(s[0][i][c], _mm256_set1_epi32(254)), isum);
                s[0][i][c] = isum;
            }
        }
        const uint16_t* h = reinterpret_cast<const uint16_t*>(rec);  // fp16 dw[16], then (Q4_1) mw[16]
        const __m256 dw0 = pagedllm_load_f16x8(h), dw1 = pagedllm_load_f16x8(h + 8);
        for (int i = 0; i < MR; i++) {
            const __m256 dx = _mm256_set1_ps(xq.d[(m0 + i) * xq.nb + b]);
            acc[i][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[0][i][0]), dw0), dx, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[0][i][1]), dw1), dx, acc[i][1]);
        }
        if constexpr (T == T_Q4_1) {
            const __m256 m0v = pagedllm_load_f16x8(h + 16), m1v = pagedllm_load_f16x8(h + 24);
            for (int i = 0; i < MR; i++) {
                const __m256 xs = _mm256_set1_ps(dx_times_sx(xq, m0 + i, b));
                acc[i][0] = _mm256_fmadd_ps(m0v, xs, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(m1v, xs, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < MR; i++) {
        alignas(32) float row[COLS];
        _mm256_store_ps(row, acc[i][0]);
        _mm256_store_ps(row + 8, acc[i][1]);
        store_row(y + i * ldy, row, cols);
    }
}
template <bool WIDE, int NP> constexpr int MR_MAX = WIDE ? 1 : 2;
constexpr int NP_MAX = 1;

#else
// Portable: the same integer sums and fp32 scaling, one row at a time.
template <int32_t T, int MR, bool WIDE, int NP>
void tile(float* y, int64_t ldy, int cols, const QuantX& xq, int64_t m0, const uint8_t* panel, int64_t, bool stream) {
    static_assert(NP == 1, "one panel per tile");
    (void)stream;  // no prefetch in the portable code
    for (int i = 0; i < MR; i++) {
        const int64_t m = m0 + i;
        float acc[COLS] = {};
        for (int64_t b = 0; b < xq.nb; b++) {
            const uint8_t* rec = panel + b * RECORD<T>;
            const uint8_t* qs = rec + HEADER<T>;
            const int8_t* xb = xq.q + m * xq.K + b * QK;
            const int8_t* xb2 = WIDE ? xq.q2 + m * xq.K + b * QK : nullptr;
            const int32_t sx = xq.s[m * xq.nb + b];
            uint16_t h[2 * COLS];  // fp16 dw[16], then (Q4_1) mw[16]
            std::memcpy(h, rec, sizeof h);
            float dw[COLS], mw[COLS];
            for (int j = 0; j < COLS; j++) {
                dw[j] = pagedllm_f16_to_f32(h[j]);
                mw[j] = T == T_Q4_1 ? pagedllm_f16_to_f32(h[COLS + j]) : 0.f;
            }
            const float dx = xq.d[m * xq.nb + b];
            const float xs = T == T_Q4_1 ? dx_times_sx(xq, m, b) : 0.f;
            for (int j = 0; j < COLS; j++) {
                int32_t isum = -OFFSET<T> * sx;
                for (int g = 0; g < 8; g++)
                    for (int t = 0; t < 4; t++) {
                        int q;
                        if constexpr (T == T_Q8_0) q = int8_t(qs[64 * g + 4 * j + t]);
                        else q = (qs[64 * (g % 4) + 4 * j + t] >> (4 * (g / 4))) & 0x0F;
                        isum += WIDE ? q * (254 * xb[4 * g + t] + xb2[4 * g + t]) : q * xb[4 * g + t];
                    }
                acc[j] = std::fma(float(isum) * dw[j], dx, acc[j]);
                if constexpr (T == T_Q4_1) acc[j] = std::fma(mw[j], xs, acc[j]);
            }
        }
        store_row(y + i * ldy, acc, cols);
    }
}
template <bool WIDE, int NP> constexpr int MR_MAX = 4;
constexpr int NP_MAX = 1;
#endif

// Rows m0..m0+rows-1 against NP adjacent panels, in tiles of MR_MAX rows (then one smaller tile).
template <int32_t T, bool WIDE, int NP>
void panel_rows(float* y, int64_t ldy, int cols, const QuantX& xq, int64_t m0, int64_t rows, const uint8_t* panel,
                int64_t panel_bytes) {
    constexpr int MR = MR_MAX<WIDE, NP>;
    int64_t m = m0;
    for (; m + MR <= m0 + rows; m += MR) tile<T, MR, WIDE, NP>(y + m * ldy, ldy, cols, xq, m, panel, panel_bytes, m == m0);
    switch (m0 + rows - m) {
#define PAGEDLLM_TAIL(r) \
    case r: if constexpr (r < MR) tile<T, r, WIDE, NP>(y + m * ldy, ldy, cols, xq, m, panel, panel_bytes, m == m0); break;
        PAGEDLLM_TAIL(1) PAGEDLLM_TAIL(2) PAGEDLLM_TAIL(3) PAGEDLLM_TAIL(4) PAGEDLLM_TAIL(5) PAGEDLLM_TAIL(6)
        PAGEDLLM_TAIL(7)
#undef PAGEDLLM_TAIL
        default: break;
    }
}

// ------------------------------------------------------------------------------------------
// AMX-INT8 (Sapphire Rapids and later): one tile instruction multiplies 16 rows of x's quants
// (one block: 32 bytes a row) by one panel's block (8 rows of 64 bytes - the record layout
// above is already the second operand's layout) into 16 x 16 int32 sums. The sums leave the
// tile registers through memory and are scaled as the VNNI tile scales its own: the same int32
// values (the true block sums; only the route differs), the same fp32 operations in the same
// order, so an output has the same bits whichever path computed it - rows in whole 16-row
// tiles take this path, the rest the VNNI tiles. x's quants are signed; Q4 nibbles, unpacked to
// bytes once per panel and row chunk, are unsigned (TDPBSUD); Q8_0 quants are signed (TDPBSSD:
// no +128, so the accumulator starts at the offset term alone).
// Chosen at run time: compiled where the compiler targets AMX (-march=native on such a CPU)
// and used once Linux grants the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
// PAGEDLLM_AMX_EMULATE builds the same code over a scalar model of the six tile instructions
// it uses, so a CPU without AMX runs this path's layout and scaling against the VNNI tiles.
#if defined(PAGEDLLM_I8_VNNI) && (defined(PAGEDLLM_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_INT8__)))
#define PAGEDLLM_I8_AMX 1

namespace amx {

constexpr int ROWS = 16;  // rows of x per tile
// Tile registers: 0, 1 the sums for the item's two panels; 2 x's quants (wide: the high
// halves); 3, 4 the two panels' block; 5 the wide quants' low halves; 6, 7 their sums.
struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(Config) == 64, "the tile configuration is 64 bytes");

inline Config config() {
    Config c{};
    c.palette = 1;
    auto set = [&c](int t, int rows, int colsb) { c.rows[t] = uint8_t(rows), c.colsb[t] = uint16_t(colsb); };
    for (int t : {0, 1, 6, 7}) set(t, ROWS, 4 * COLS);  // int32 sums: 16 x 16
    for (int t : {2, 5}) set(t, ROWS, QK);              // x: 16 rows x 32 quants
    for (int t : {3, 4}) set(t, QK / 4, 4 * COLS);      // w: 8 groups of 4 k x 16 columns
    return c;
}

#if defined(PAGEDLLM_AMX_EMULATE)
// What the instructions do (Intel SDM, AMX): a tile is `rows` rows of `colsb` bytes; the dot
// product adds, to int32 lane n of row m, the 4 byte products of dword k of a's row m with
// dword n of b's row k, for every k < a.colsb / 4 (wrapping as the hardware's int32 adds).
struct Tile { int rows = 0, colsb = 0; uint8_t data[16][64] = {}; };
inline thread_local Tile tiles[8];
inline void load_config(const Config& c) {
    for (int t = 0; t < 8; t++) tiles[t] = Tile{c.rows[t], c.colsb[t]};
}
inline void release() {
    for (Tile& t : tiles) t = Tile{};
}
inline void zero(int t) { std::memset(tiles[t].data, 0, sizeof tiles[t].data); }
inline void load(int t, const void* p, int64_t stride) {
    for (int r = 0; r < tiles[t].rows; r++) std::memcpy(tiles[t].data[r], static_cast<const uint8_t*>(p) + r * stride, tiles[t].colsb);
}
inline void store(int t, void* p, int64_t stride) {
    for (int r = 0; r < tiles[t].rows; r++) std::memcpy(static_cast<uint8_t*>(p) + r * stride, tiles[t].data[r], tiles[t].colsb);
}
template <bool B_SIGNED>
inline void dot(int ct, int at, int bt) {
    Tile& c = tiles[ct];
    const Tile &a = tiles[at], &b = tiles[bt];
    for (int m = 0; m < c.rows; m++)
        for (int n = 0; n < c.colsb / 4; n++) {
            uint32_t acc;
            std::memcpy(&acc, c.data[m] + 4 * n, 4);
            for (int k = 0; k < a.colsb / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const int x = int8_t(a.data[m][4 * k + i]);
                    const int w = B_SIGNED ? int(int8_t(b.data[k][4 * n + i])) : int(b.data[k][4 * n + i]);
                    acc += uint32_t(x * w);
                }
            std::memcpy(c.data[m] + 4 * n, &acc, 4);
        }
}
#define PAGEDLLM_TILE_ZERO(t) amx::zero(t)
#define PAGEDLLM_TILE_LOAD(t, p, stride) amx::load(t, p, stride)
#define PAGEDLLM_TILE_STORE(t, p, stride) amx::store(t, p, stride)
#define PAGEDLLM_TILE_DOT_SU(c, a, b) amx::dot<false>(c, a, b)
#define PAGEDLLM_TILE_DOT_SS(c, a, b) amx::dot<true>(c, a, b)
#else
// The intrinsics name their tile registers by literal numbers and are asm statements; GCC 12's
// tile load does not tell the compiler it reads memory, and its config load names only the
// config's first 8 bytes: the barriers make every earlier store visible to them (the one after
// a tile store is for compilers whose store lacks the memory clobber GCC 12 gives it).
inline void load_config(const Config& c) {
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&c);
}
inline void release() { _tile_release(); }
#define PAGEDLLM_TILE_ZERO(t) _tile_zero(t)
#define PAGEDLLM_TILE_LOAD(t, p, stride) do { __asm__ volatile("" ::: "memory"); _tile_loadd(t, p, stride); } while (0)
#define PAGEDLLM_TILE_STORE(t, p, stride) do { _tile_stored(t, p, stride); __asm__ volatile("" ::: "memory"); } while (0)
#define PAGEDLLM_TILE_DOT_SU(c, a, b) _tile_dpbsud(c, a, b)
#define PAGEDLLM_TILE_DOT_SS(c, a, b) _tile_dpbssd(c, a, b)
#endif

// Whether the process may use the tile registers (asked once), and whether it should
// (int8_gemm_use_amx: tests compare the two paths in one process).
inline bool permitted() {
#if defined(PAGEDLLM_AMX_EMULATE)
    return true;
#else
    static const bool ok = [] {
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
#endif
}
inline std::atomic<bool> wanted{true};
inline bool active() { return wanted.load(std::memory_order_relaxed) && permitted(); }

}  // namespace amx

// The int32 start of a block's sum: the offset term (see the file comment), without Q8_0's
// +128 (TDPBSSD takes its quants signed).
template <int32_t T> inline int32_t amx_start(int32_t sx) { return T == T_Q8_0 ? 0 : -OFFSET<T> * sx; }

// 16 rows of x (from row m0) against NP (1 or 2) adjacent panels: `wq` holds each panel's
// blocks as tile operands (nb x 512 bytes per panel, `wq_panel` apart; Q8_0: the records
// themselves, RECORD apart). The outputs gather in `acc` (L1) block by block.
template <int32_t T, bool WIDE, int NP>
void amx_tile(float* y, int64_t ldy, int cols, const QuantX& xq, int64_t m0, const uint8_t* panel, int64_t panel_bytes,
              const uint8_t* wq, int64_t wq_panel, int64_t wq_block) {
    alignas(64) float acc[amx::ROWS][NP * COLS] = {};
    alignas(64) int32_t sums[2][NP][amx::ROWS][COLS];  // [x's quants or their high halves; low halves]
    const int8_t* xq_rows = xq.q + m0 * xq.K;
    const int8_t* xq2_rows = WIDE ? xq.q2 + m0 * xq.K : nullptr;
    for (int64_t b = 0; b < xq.nb; b++) {
        PAGEDLLM_TILE_ZERO(0);
        PAGEDLLM_TILE_LOAD(2, xq_rows + b * QK, xq.K);
        PAGEDLLM_TILE_LOAD(3, wq + b * wq_block, 4 * COLS);
        if constexpr (T == T_Q8_0) PAGEDLLM_TILE_DOT_SS(0, 2, 3);
        else PAGEDLLM_TILE_DOT_SU(0, 2, 3);
        PAGEDLLM_TILE_STORE(0, sums[0][0], 4 * COLS);
        if constexpr (NP == 2) {
            PAGEDLLM_TILE_ZERO(1);
            PAGEDLLM_TILE_LOAD(4, wq + wq_panel + b * wq_block, 4 * COLS);
            if constexpr (T == T_Q8_0) PAGEDLLM_TILE_DOT_SS(1, 2, 4);
            else PAGEDLLM_TILE_DOT_SU(1, 2, 4);
            PAGEDLLM_TILE_STORE(1, sums[0][1], 4 * COLS);
        }
        if constexpr (WIDE) {
            PAGEDLLM_TILE_ZERO(6);
            PAGEDLLM_TILE_LOAD(5, xq2_rows + b * QK, xq.K);
            if constexpr (T == T_Q8_0) PAGEDLLM_TILE_DOT_SS(6, 5, 3);
            else PAGEDLLM_TILE_DOT_SU(6, 5, 3);
            PAGEDLLM_TILE_STORE(6, sums[1][0], 4 * COLS);
            if constexpr (NP == 2) {
                PAGEDLLM_TILE_ZERO(7);
                if constexpr (T == T_Q8_0) PAGEDLLM_TILE_DOT_SS(7, 5, 4);
                else PAGEDLLM_TILE_DOT_SU(7, 5, 4);
                PAGEDLLM_TILE_STORE(7, sums[1][1], 4 * COLS);
            }
        }
        // The VNNI tile's scaling (add_block).
        for (int j = 0; j < NP; j++) {
            const uint8_t* rec = panel + j * panel_bytes + b * RECORD<T>;
            const __m512 dw = load_f16x16(rec);
            const __m512 mw = T == T_Q4_1 ? load_f16x16(rec + 32) : _mm512_setzero_ps();
            for (int i = 0; i < amx::ROWS; i++) {
                const int64_t m = m0 + i;
                const __m512i start = _mm512_set1_epi32(amx_start<T>(xq.s[m * xq.nb + b]));
                __m512i isum = _mm512_add_epi32(_mm512_load_si512(sums[WIDE ? 1 : 0][j][i]), start);
                if constexpr (WIDE)
                    isum = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(sums[0][j][i]), _mm512_set1_epi32(254)), isum);
                _mm512_store_ps(acc[i] + j * COLS, add_block<T>(_mm512_load_ps(acc[i] + j * COLS), isum, dw, mw, xq, m, b));
            }
        }
    }
    for (int i = 0; i < amx::ROWS; i++)
        for (int j = 0; j < NP; j++) store_row(y + (m0 + i) * ldy + j * COLS, acc[i] + j * COLS, j == NP - 1 ? cols : COLS);
}

// The whole 16-row tiles of rows m0..m0+rows-1 against the item's np panels; returns how many
// rows that was (the caller's VNNI tiles take the rest). Q4 panels are unpacked first, to one
// byte per quant in the tile operand's layout: group g of a block is row g (chunk g % 4's low
// nibbles for g < 4, its high ones after).
template <int32_t T, bool WIDE>
int64_t amx_panel_rows(int np, float* y, int64_t ldy, int cols, const QuantX& xq, int64_t m0, int64_t rows,
                       const uint8_t* panel, int64_t panel_bytes) {
    const int64_t whole = rows / amx::ROWS * amx::ROWS;
    if (whole == 0) return 0;
    const uint8_t* wq = panel + HEADER<T>;
    int64_t wq_panel = panel_bytes, wq_block = RECORD<T>;
    if constexpr (T != T_Q8_0) {
        thread_local std::vector<uint8_t> unpacked;
        wq_block = QK / 4 * 4 * COLS;  // 512 bytes
        wq_panel = xq.nb * wq_block;
        if (int64_t(unpacked.size()) < np * wq_panel) unpacked.resize(np * wq_panel);
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int j = 0; j < np; j++)
            for (int64_t b = 0; b < xq.nb; b++) {
                const uint8_t* qs = panel + j * panel_bytes + b * RECORD<T> + HEADER<T>;
                uint8_t* out = unpacked.data() + j * wq_panel + b * wq_block;
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512(qs + 64 * c);
                    _mm512_storeu_si512(out + 64 * c, _mm512_and_si512(v, low));
                    _mm512_storeu_si512(out + 64 * (c + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
            }
        wq = unpacked.data();
    }
    for (int64_t m = m0; m < m0 + whole; m += amx::ROWS) {
        if (np == 2) amx_tile<T, WIDE, 2>(y, ldy, cols, xq, m, panel, panel_bytes, wq, wq_panel, wq_block);
        else amx_tile<T, WIDE, 1>(y, ldy, cols, xq, m, panel, panel_bytes, wq, wq_panel, wq_block);
    }
    return whole;
}
#endif

// Rows of x per pass over the panels: the chunk's quants (M_CHUNK x K bytes, <= 192 KB for
// K = 1536; twice that when wide) stay in L2 while the panels pass over them.
constexpr int64_t M_CHUNK = 128;

// Work items are NP_MAX adjacent panels (the last item of an odd count has one).
template <int32_t T, bool WIDE>
void gemm(float* y, int64_t ldy, const QuantX& xq, const uint8_t* w, int64_t M, int64_t N, int nthreads) {
    const int64_t num_panels = (N + COLS - 1) / COLS;
    const int64_t panel_bytes = xq.nb * RECORD<T>;
    const int64_t items = (num_panels + NP_MAX - 1) / NP_MAX;
#ifdef PAGEDLLM_I8_AMX
    const bool amx = M >= amx::ROWS && amx::active();
    const amx::Config config = amx::config();
#endif
#pragma omp parallel num_threads(nthreads)
    {
#ifdef PAGEDLLM_I8_AMX
        if (amx) amx::load_config(config);  // each thread's tile registers
#endif
        for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
            const int64_t rows = std::min(M_CHUNK, M - m0);
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                const int64_t p = it * NP_MAX, np = std::min<int64_t>(NP_MAX, num_panels - p);
                const int cols = int(std::min<int64_t>(COLS, N - (p + np - 1) * COLS));  // of the item's last panel
                float* yp = y + p * COLS;
                const uint8_t* wp = w + p * panel_bytes;
                int64_t done = 0;  // rows taken by AMX tiles
#ifdef PAGEDLLM_I8_AMX
                if (amx) done = amx_panel_rows<T, WIDE>(int(np), yp, ldy, cols, xq, m0, rows, wp, panel_bytes);
#endif
                if (done == rows) continue;
                if (np == 2) panel_rows<T, WIDE, NP_MAX>(yp, ldy, cols, xq, m0 + done, rows - done, wp, panel_bytes);
                else panel_rows<T, WIDE, 1>(yp, ldy, cols, xq, m0 + done, rows - done, wp, panel_bytes);
            }
        }
#ifdef PAGEDLLM_I8_AMX
        if (amx) amx::release();
#endif
    }
}

}  // namespace

// Which integer dot-product instructions this build uses, for logs and tests.
const char* int8_gemm_isa() {
#if defined(PAGEDLLM_I8_AMX) && defined(PAGEDLLM_AMX_EMULATE)
    if (amx::active()) return "amx-int8-emulated";
#elif defined(PAGEDLLM_I8_AMX)
    if (amx::active()) return "amx-int8";
#endif
#if defined(PAGEDLLM_I8_VNNI)
    return "avx512vnni";
#elif defined(PAGEDLLM_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

// Whether steps of 16 rows or more use the AMX tiles where this build and the OS allow them
// (enabled: 1 yes, 0 no; the default is yes); returns 1 when they will be used.
int int8_gemm_use_amx(int32_t enabled) {
#if defined(PAGEDLLM_I8_AMX)
    amx::wanted.store(enabled != 0);
    return amx::active() ? 1 : 0;
#else
    (void)enabled;
    return 0;
#endif
}

// x [M, K] fp32 (row stride ldx) -> q [M, K] int8, d [M, K/32] fp32, s [M, K/32] int32 (see the
// file comment); act_bits 16: q2 [M, K] too (the low halves of the wide quants). K % 32 == 0.
void int8_quantize_rows(int8_t* q, int8_t* q2, float* d, int32_t* s, const float* x, int64_t ldx, int64_t M,
                        int64_t K, int32_t act_bits, int nthreads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++) {
        if (act_bits == 16) quantize_row_wide(q + m * K, q2 + m * K, d + m * nb, s + m * nb, x + m * ldx, K);
        else quantize_row(q + m * K, d + m * nb, s + m * nb, x + m * ldx, K);
    }
}

// y [M, N] (row stride ldy) = quantize(x) [M, K] @ W^T, W in int8 panels of `ggml_type` (Q4_0 = 2,
// Q4_1 = 3, Q8_0 = 8; reference.pack_int8_panels), x quantized to act_bits 8 (int8) or 16 (wide).
// Returns 0, or -1 for another type, a K that is not a multiple of 32 or other act_bits.
int int8_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int32_t ggml_type, int64_t M,
                  int64_t N, int64_t K, int32_t act_bits, int nthreads) {
    if (K % QK != 0 || (ggml_type != T_Q4_0 && ggml_type != T_Q4_1 && ggml_type != T_Q8_0)) return -1;
    if (act_bits != 8 && act_bits != 16) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int64_t nb = K / QK;
    const bool wide = act_bits == 16;
    // x's quants live in buffers kept per calling thread and only ever grown: a prefill chunk's
    // are megabytes, and fresh vectors would be zero-filled (and their pages faulted in) on
    // every call, for every linear of every layer.
    struct Buffers {
        std::unique_ptr<int8_t[]> q;
        std::unique_ptr<float[]> d;
        std::unique_ptr<int32_t[]> s;
        int64_t q_bytes = 0, blocks = 0;
    };
    thread_local Buffers buf;
    const int64_t q_bytes = M * K * (wide ? 2 : 1);
    if (buf.q_bytes < q_bytes) {
        buf.q.reset(new int8_t[q_bytes]);
        buf.q_bytes = q_bytes;
    }
    if (buf.blocks < M * nb) {
        buf.d.reset(new float[M * nb]);
        buf.s.reset(new int32_t[M * nb]);
        buf.blocks = M * nb;
    }
    int8_t* q = buf.q.get();
    int8_t* q2 = wide ? q + M * K : nullptr;
    int8_quantize_rows(q, q2, buf.d.get(), buf.s.get(), x, ldx, M, K, act_bits, nthreads);
    const QuantX xq{q, q2, buf.d.get(), buf.s.get(), K, nb};
    auto run = [&](auto wide_tag) {
        constexpr bool W = decltype(wide_tag)::value;
        if (ggml_type == T_Q4_0) gemm<T_Q4_0, W>(y, ldy, xq, w, M, N, nthreads);
        else if (ggml_type == T_Q4_1) gemm<T_Q4_1, W>(y, ldy, xq, w, M, N, nthreads);
        else gemm<T_Q8_0, W>(y, ldy, xq, w, M, N, nthreads);
    };
    if (wide) run(std::true_type{});
    else run(std::false_type{});
    return 0;
}
