// y = x @ W^T with W kept in its GGUF blocks, for every common GGUF type, at any batch size.
//
// The weights stay in the file's own block layout (resident memory = the file size); each
// block is dequantized to fp32 the moment it is used:
// - few rows of x (decode): every weight row is walked once, block by block; a block becomes
//   up to 256 fp32 values in an L1 buffer and meets every row of x there (memory bound:
//   one pass over the packed bytes);
// - many rows (prefill): 16 weight rows at a time are dequantized into one fp32 panel of the
//   dense GEMM (panel_gemm.cpp: pagedllm_panel_tiles), which then runs over a chunk of x's
//   rows. The panel is built once per chunk, so its cost is spread over the chunk's rows
//   (compute bound, the dense kernel's speed).
// Each block's values are computed with the same fp32 operations, in the same order, as the
// `gguf` package's dequantize (the oracle of the tests), so they are bit-identical to it: the
// dequantized values are the model; only the summation order of the dot products differs.
//
// Types are named by their GGML numbers (gguf.GGMLQuantizationType).

#include "common.h"

// C-API-BEGIN
extern "C" {
int gguf_type_supported(int32_t ggml_type);
int gguf_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int32_t ggml_type,
                  int64_t M, int64_t N, int64_t K, int nthreads);
int gguf_get_rows_f32(float* out, const uint8_t* w, int32_t ggml_type, const int64_t* rows, int64_t num_rows,
                      int64_t K, int nthreads);
}
// C-API-END

namespace {

enum : int32_t {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

struct TypeInfo {
    int block;  // weights per block
    int bytes;  // bytes per block
};

// {0, 0} for a type this file does not read.
TypeInfo type_info(int32_t t) {
    switch (t) {
        case T_F32: return {1, 4};
        case T_F16: return {1, 2};
        case T_BF16: return {1, 2};
        case T_Q4_0: return {32, 18};
        case T_Q4_1: return {32, 20};
        case T_Q5_0: return {32, 22};
        case T_Q5_1: return {32, 24};
        case T_Q8_0: return {32, 34};
        case T_Q2_K: return {256, 84};
        case T_Q3_K: return {256, 110};
        case T_Q4_K: return {256, 144};
        case T_Q5_K: return {256, 176};
        case T_Q6_K: return {256, 210};
        default: return {0, 0};
    }
}

inline float f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return pagedllm_f16_to_f32(h);
}

// --- One block -> fp32, per type (the formulas of gguf-py's quants.py) -----------------------

// The 32 unsigned 4-bit (qh == nullptr) or 5-bit quants of a Q4_x / Q5_x block, in element order:
// byte i of qs holds elements i (low nibble) and i + 16 (high nibble); bit i of qh is element i's 5th bit.
inline void block_quants(const uint8_t* qs, const uint8_t* qh_bytes, int q[32]) {
    uint32_t qh = 0;
    if (qh_bytes) std::memcpy(&qh, qh_bytes, 4);
    for (int i = 0; i < 16; i++) {
        q[i] = (qs[i] & 0x0F) | int(((qh >> i) & 1) << 4);
        q[i + 16] = (qs[i] >> 4) | int(((qh >> (i + 16)) & 1) << 4);
    }
}

// Symmetric types (Q4_0, Q5_0): d * (q - offset). Asymmetric (Q4_1, Q5_1): d * q + m.
inline void deq_symmetric(float d, const int q[32], int offset, float* y) {
    for (int i = 0; i < 32; i++) y[i] = d * float(q[i] - offset);
}
inline void deq_asymmetric(float d, float m, const int q[32], float* y) {
    for (int i = 0; i < 32; i++) y[i] = d * float(q[i]) + m;
}

void deq_q4_0(const uint8_t* b, float* y) {
    int q[32];
    block_quants(b + 2, nullptr, q);
    deq_symmetric(f16(b), q, 8, y);
}

void deq_q4_1(const uint8_t* b, float* y) {
    int q[32];
    block_quants(b + 4, nullptr, q);
    deq_asymmetric(f16(b), f16(b + 2), q, y);
}

void deq_q5_0(const uint8_t* b, float* y) {
    int q[32];
    block_quants(b + 6, b + 2, q);
    deq_symmetric(f16(b), q, 16, y);
}

void deq_q5_1(const uint8_t* b, float* y) {
    int q[32];
    block_quants(b + 8, b + 4, q);
    deq_asymmetric(f16(b), f16(b + 2), q, y);
}

void deq_q8_0(const uint8_t* b, float* y) {
    const float d = f16(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; i++) y[i] = float(qs[i]) * d;
}

void deq_q2_k(const uint8_t* b, float* y) {
    const uint8_t* scales = b;
    const uint8_t* qs = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, s = (e / 32) % 4, l = e % 32, g = e / 16;
        const float dl = d * float(scales[g] & 0x0F), ml = dmin * float(scales[g] >> 4);
        y[e] = dl * float((qs[h * 32 + l] >> (2 * s)) & 3) - ml;
    }
}

void deq_q3_k(const uint8_t* b, float* y) {
    const uint8_t* hmask = b;
    const uint8_t* qs = b + 32;
    const uint8_t* sc = b + 96;
    const float d = f16(b + 108);
    float dl[16];
    for (int i = 0; i < 16; i++) {
        const int lo = (i < 8 ? sc[i] : sc[i - 8] >> 4) & 0x0F;
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * float(int8_t(uint8_t(lo | (hi << 4))) - 32);
    }
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, s = (e / 32) % 4, l = e % 32;
        const int q = ((qs[h * 32 + l] >> (2 * s)) & 3) - (((hmask[l] >> (h * 4 + s)) & 1) ? 0 : 4);
        y[e] = dl[e / 16] * float(q);
    }
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit minimum.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 0x3F;
        m = s[j + 4] & 0x3F;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

// Q4_K and Q5_K share their layout but for Q5_K's fifth bits (qh: bit j of byte l belongs to
// weight l of sub-block j); qh == nullptr for Q4_K.
void deq_q45_k(const uint8_t* b, const uint8_t* qs, const uint8_t* qh, float* y) {
    const float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(b + 4, j, sc, m);
        const float ds = d * float(sc), dm = dmin * float(m);
        const uint8_t* q = qs + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int l = 0; l < 32; l++) {
            const int v = ((q[l] >> shift) & 0x0F) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
            y[j * 32 + l] = ds * float(v) - dm;
        }
    }
}

void deq_q4_k(const uint8_t* b, float* y) { deq_q45_k(b, b + 16, nullptr, y); }
void deq_q5_k(const uint8_t* b, float* y) { deq_q45_k(b, b + 48, b + 16, y); }

void deq_q6_k(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int g = 0; g < 8; g++) {
        const int h = g / 4, j = g % 4;
        const uint8_t* lo = ql + h * 64 + (j % 2) * 32;
        const uint8_t* hi = qh + h * 32;
        const int lshift = 4 * (j / 2), hshift = 2 * j;
        const float d0 = d * float(scales[2 * g]), d1 = d * float(scales[2 * g + 1]);
        for (int l = 0; l < 32; l++) {
            const int q = (((lo[l] >> lshift) & 0x0F) | (((hi[l] >> hshift) & 3) << 4)) - 32;
            y[g * 32 + l] = (l < 16 ? d0 : d1) * float(q);
        }
    }
}

#ifdef PAGEDLLM_AVX2
// AVX2: 32 weights (one simple block, or sub-block j of a K-quant super-block) straight into
// four registers, with the same fp32 operations as the scalar code above (so the same values).
inline __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bits(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(mask));
}
inline __m256 to_f(__m256i v) { return _mm256_cvtepi32_ps(v); }

// Lanes 8c..8c+7 of a 32-weight unit whose quant of weight i is a nibble of byte (i % 16):
// the low nibble for i < 16, the high one after (Q4_0, Q4_1, Q5_0, Q5_1).
inline __m256i nibbles16(const uint8_t* qs, int c) { return bits(bytes8(qs + 8 * (c % 2)), 4 * (c / 2), 0x0F); }
// Bit (8c + lane) of a 32-bit word, moved to bit 4 (the fifth bit of Q5_0 / Q5_1).
inline __m256i fifth_bit(uint32_t qh, int c) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(int(qh)), _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * c)));
    return _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(1)), 4);
}

template <int32_t T>
inline void deq32(const uint8_t* b, int j, __m256 w[4]) {
    if constexpr (T == T_Q4_0) {
        const __m256 d = _mm256_set1_ps(f16(b)), eight = _mm256_set1_ps(8.f);
        for (int c = 0; c < 4; c++) w[c] = _mm256_mul_ps(d, _mm256_sub_ps(to_f(nibbles16(b + 2, c)), eight));
    } else if constexpr (T == T_Q4_1) {
        const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
        for (int c = 0; c < 4; c++) w[c] = _mm256_fmadd_ps(d, to_f(nibbles16(b + 4, c)), m);
    } else if constexpr (T == T_Q5_0) {
        const __m256 d = _mm256_set1_ps(f16(b)), sixteen = _mm256_set1_ps(16.f);
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_mul_ps(d, _mm256_sub_ps(to_f(_mm256_or_si256(nibbles16(b + 6, c), fifth_bit(qh, c))), sixteen));
    } else if constexpr (T == T_Q5_1) {
        const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
        uint32_t qh;
        std::memcpy(&qh, b + 4, 4);
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_fmadd_ps(d, to_f(_mm256_or_si256(nibbles16(b + 8, c), fifth_bit(qh, c))), m);
    } else if constexpr (T == T_Q8_0) {
        const __m256 d = _mm256_set1_ps(f16(b));
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_mul_ps(to_f(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * c)))), d);
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        int sc, m;
        k_scale_min(b + 4, j, sc, m);
        const __m256 ds = _mm256_set1_ps(f16(b) * float(sc)), dm = _mm256_set1_ps(f16(b + 2) * float(m));
        const uint8_t* q = b + (T == T_Q4_K ? 16 : 48) + (j / 2) * 32;
        for (int c = 0; c < 4; c++) {
            __m256i v = bits(bytes8(q + 8 * c), 4 * (j % 2), 0x0F);
            if constexpr (T == T_Q5_K) v = _mm256_or_si256(v, _mm256_slli_epi32(bits(bytes8(b + 16 + 8 * c), j, 1), 4));
            w[c] = _mm256_fmsub_ps(ds, to_f(v), dm);
        }
    } else if constexpr (T == T_Q6_K) {
        const int h = j / 4, g = j % 4;
        const uint8_t* lo = b + h * 64 + (g % 2) * 32;
        const uint8_t* hi = b + 128 + h * 32;
        const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
        const float d = f16(b + 208);
        const __m256 d0 = _mm256_set1_ps(d * float(scales[2 * j])), d1 = _mm256_set1_ps(d * float(scales[2 * j + 1]));
        const __m256i off = _mm256_set1_epi32(32);
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_or_si256(bits(bytes8(lo + 8 * c), 4 * (g / 2), 0x0F),
                                              _mm256_slli_epi32(bits(bytes8(hi + 8 * c), 2 * g, 3), 4));
            w[c] = _mm256_mul_ps(c < 2 ? d0 : d1, to_f(_mm256_sub_epi32(v, off)));
        }
    } else if constexpr (T == T_F16) {
        const __m128i* h = reinterpret_cast<const __m128i*>(b + 64 * j);
        for (int c = 0; c < 4; c++) w[c] = _mm256_cvtph_ps(_mm_loadu_si128(h + c));
    } else if constexpr (T == T_BF16) {
        const __m128i* h = reinterpret_cast<const __m128i*>(b + 64 * j);
        for (int c = 0; c < 4; c++) w[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + c)), 16));
    } else {  // F32
        const float* f = reinterpret_cast<const float*>(b) + 32 * j;
        for (int c = 0; c < 4; c++) w[c] = _mm256_loadu_ps(f + 8 * c);
    }
}
// Types deq32 reads (Q2_K and Q3_K go through the scalar code).
template <int32_t T> constexpr bool HAS_DEQ32 = T != T_Q2_K && T != T_Q3_K;
#endif

// One block of type T -> fp32 (inlined into the loops below, where it vectorises).
template <int32_t T>
inline void deq_block(const uint8_t* b, float* y) {
    if constexpr (T == T_F32) std::memcpy(y, b, sizeof(float));
    else if constexpr (T == T_F16) y[0] = f16(b);
    else if constexpr (T == T_BF16) {
        uint16_t h;
        std::memcpy(&h, b, 2);
        y[0] = pagedllm_bf16_to_f32(h);
    }
    else if constexpr (T == T_Q4_0) deq_q4_0(b, y);
    else if constexpr (T == T_Q4_1) deq_q4_1(b, y);
    else if constexpr (T == T_Q5_0) deq_q5_0(b, y);
    else if constexpr (T == T_Q5_1) deq_q5_1(b, y);
    else if constexpr (T == T_Q8_0) deq_q8_0(b, y);
    else if constexpr (T == T_Q2_K) deq_q2_k(b, y);
    else if constexpr (T == T_Q3_K) deq_q3_k(b, y);
    else if constexpr (T == T_Q4_K) deq_q4_k(b, y);
    else if constexpr (T == T_Q5_K) deq_q5_k(b, y);
    else deq_q6_k(b, y);
}

template <int32_t T> constexpr int BLOCK = T == T_F32 || T == T_F16 || T == T_BF16 ? 1
    : (T == T_Q2_K || T == T_Q3_K || T == T_Q4_K || T == T_Q5_K || T == T_Q6_K) ? 256 : 32;
template <int32_t T> constexpr int BYTES = T == T_F32 ? 4 : T == T_F16 || T == T_BF16 ? 2 : T == T_Q4_0 ? 18
    : T == T_Q4_1 ? 20 : T == T_Q5_0 ? 22 : T == T_Q5_1 ? 24 : T == T_Q8_0 ? 34 : T == T_Q2_K ? 84
    : T == T_Q3_K ? 110 : T == T_Q4_K ? 144 : T == T_Q5_K ? 176 : 210;

// `n` consecutive weights of a row, starting at element k0 (a block multiple).
template <int32_t T>
inline void dequantize_span(const uint8_t* row, int64_t k0, int64_t n, float* y) {
    if constexpr (T == T_F32) {
        std::memcpy(y, row + k0 * 4, n * sizeof(float));
    } else if constexpr (T == T_F16) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + k0;
        int64_t i = 0;
#ifdef PAGEDLLM_AVX2
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
        for (; i < n; i++) y[i] = pagedllm_f16_to_f32(h[i]);
    } else if constexpr (T == T_BF16) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + k0;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t u = uint32_t(h[i]) << 16;
            std::memcpy(y + i, &u, 4);
        }
    } else {
        const uint8_t* b = row + (k0 / BLOCK<T>) * BYTES<T>;
#ifdef PAGEDLLM_AVX2
        if constexpr (HAS_DEQ32<T>) {
            __m256 w[4];
            for (int64_t i = 0; i < n; i += BLOCK<T>, b += BYTES<T>)
                for (int j = 0; j < BLOCK<T> / 32; j++) {
                    deq32<T>(b, j, w);
                    for (int c = 0; c < 4; c++) _mm256_storeu_ps(y + i + 32 * j + 8 * c, w[c]);
                }
            return;
        }
#endif
        for (int64_t i = 0; i < n; i += BLOCK<T>, b += BYTES<T>) deq_block<T>(b, y + i);
    }
}

// Weights dequantized per step of the small-batch path: one K-quant super-block, or 8 simple
// blocks (fewer calls), or 256 plain values.
constexpr int64_t SPAN = 256;
// Rows of x that meet one dequantized span together (2 accumulators each).
constexpr int XR = 4;

inline int64_t span_of(const TypeInfo& ti, int64_t K) {
    return std::min<int64_t>(K, ti.block >= SPAN ? ti.block : SPAN);
}

// y[m, n] for m < M and rows n0..n1 of W: each row dequantized span by span into an L1 buffer.
template <int32_t T>
void gemm_small(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t n0,
                int64_t n1, int64_t K) {
    const TypeInfo ti = type_info(T);
    const int64_t row_bytes = K / ti.block * ti.bytes;
    const int64_t span = span_of(ti, K);
    alignas(64) float buf[SPAN];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += XR) {
            const int mr = int(std::min<int64_t>(XR, M - m0));
            float sums[XR] = {0.f, 0.f, 0.f, 0.f};
#ifdef PAGEDLLM_AVX2
            __m256 acc[XR][2];
            for (int i = 0; i < XR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
#endif
            for (int64_t k0 = 0; k0 < K; k0 += span) {
                const int64_t len = std::min(span, K - k0);
                dequantize_span<T>(row, k0, len, buf);
                int64_t j = 0;
#ifdef PAGEDLLM_AVX2
                for (; j + 16 <= len; j += 16) {
                    const __m256 w0 = _mm256_load_ps(buf + j), w1 = _mm256_load_ps(buf + j + 8);
                    for (int i = 0; i < mr; i++) {
                        const float* xi = x + (m0 + i) * ldx + k0 + j;
                        acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), acc[i][1]);
                    }
                }
#endif
                for (int i = 0; i < mr; i++) {
                    const float* xi = x + (m0 + i) * ldx + k0;
                    float s = 0.f;
                    for (int64_t jj = j; jj < len; jj++) s += buf[jj] * xi[jj];
                    sums[i] += s;
                }
            }
            for (int i = 0; i < mr; i++) {
#ifdef PAGEDLLM_AVX2
                const __m256 v = _mm256_add_ps(acc[i][0], acc[i][1]);
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                h = _mm_add_ss(h, _mm_movehdup_ps(h));
                sums[i] += _mm_cvtss_f32(h);
#endif
                y[(m0 + i) * ldy + n] = sums[i];
            }
        }
    }
}

#ifdef PAGEDLLM_AVX2
// One 32-weight unit `u` of a row of type T into registers.
template <int32_t T>
inline void unit(const uint8_t* row, int64_t u, __m256 wv[4]) {
    if constexpr (BLOCK<T> == 1) deq32<T>(row + u * 32 * BYTES<T>, 0, wv);
    else if constexpr (BLOCK<T> == 32) deq32<T>(row + u * BYTES<T>, 0, wv);
    else deq32<T>(row + (u / 8) * BYTES<T>, int(u % 8), wv);
}

// MR rows of x (a compile-time count, so the accumulators stay in registers) against weight
// rows n0..n1: each 32-weight unit is dequantized into registers once and meets all MR rows.
// Two accumulators per row of x; NR weight rows per pass (x's loads shared), 2 for MR <= 2.
template <int32_t T, int MR, int NR = (MR <= 2 ? 2 : 1)>
void small_rows(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int64_t n0, int64_t n1,
                int64_t K) {
    const int64_t row_bytes = K / BLOCK<T> * BYTES<T>;
    const int64_t units = K / 32;
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
        __m256 acc[NR][MR][2];
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < MR; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
        for (int64_t u = 0; u < units; u++) {
            for (int r = 0; r < NR; r++) {
                __m256 wv[4];
                unit<T>(w + (n + r) * row_bytes, u, wv);
                for (int i = 0; i < MR; i++) {
                    const float* xi = x + i * ldx + u * 32;
                    acc[r][i][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xi), acc[r][i][0]);
                    acc[r][i][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xi + 8), acc[r][i][1]);
                    acc[r][i][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xi + 16), acc[r][i][0]);
                    acc[r][i][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xi + 24), acc[r][i][1]);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < MR; i++) y[i * ldy + n + r] = hsum(_mm256_add_ps(acc[r][i][0], acc[r][i][1]));
    }
    if constexpr (NR > 1) {
        if (n < n1) small_rows<T, MR, 1>(y, ldy, x, ldx, w, n, n1, K);  // an odd last row
    }
}

// The small path without a buffer. Needs K % 32 == 0 (every block type; plain types may not).
template <int32_t T>
void gemm_small_fused(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t n0,
                      int64_t n1, int64_t K) {
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) small_rows<T, 3>(y + m * ldy, ldy, x + m * ldx, ldx, w, n0, n1, K);
    if (M - m == 2) small_rows<T, 2>(y + m * ldy, ldy, x + m * ldx, ldx, w, n0, n1, K);
    if (M - m == 1) small_rows<T, 1>(y + m * ldy, ldy, x + m * ldx, ldx, w, n0, n1, K);
}
#endif

// Rows of x per panel pass in the large-batch path: the chunk stays in L2/L3 while the panels
// built for it pass over it; each panel is rebuilt once per chunk.
constexpr int64_t M_CHUNK = 192;

// Dequantize weight rows n0..n0+cols-1 into a k-major panel [K][16] (missing rows zero).
template <int32_t T>
void build_panel(float* panel, float* rowbuf, const uint8_t* w, int64_t n0, int cols, int64_t K, int64_t row_bytes) {
#ifdef PAGEDLLM_AVX2
    if constexpr (HAS_DEQ32<T>) {
        if (K % 32 == 0) {
            // 8 rows at a time: each row's 32-weight unit into a tile [8][32], then 8x8
            // transposes turn the tile's columns into the panel's k-rows.
            alignas(32) float tile[8][32];
            for (int half = 0; half < 2; half++) {
                for (int64_t u = 0; u < K / 32; u++) {
                    for (int r = 0; r < 8; r++) {
                        const int64_t n = half * 8 + r;
                        __m256 v[4];
                        if (n < cols) {
                            const uint8_t* row = w + (n0 + n) * row_bytes;
                            if constexpr (BLOCK<T> == 1) deq32<T>(row + u * 32 * BYTES<T>, 0, v);
                            else if constexpr (BLOCK<T> == 32) deq32<T>(row + u * BYTES<T>, 0, v);
                            else deq32<T>(row + (u / 8) * BYTES<T>, int(u % 8), v);
                        } else {
                            v[0] = v[1] = v[2] = v[3] = _mm256_setzero_ps();
                        }
                        for (int c = 0; c < 4; c++) _mm256_store_ps(tile[r] + 8 * c, v[c]);
                    }
                    for (int c = 0; c < 4; c++) {
                        __m256 r0 = _mm256_load_ps(tile[0] + 8 * c), r1 = _mm256_load_ps(tile[1] + 8 * c);
                        __m256 r2 = _mm256_load_ps(tile[2] + 8 * c), r3 = _mm256_load_ps(tile[3] + 8 * c);
                        __m256 r4 = _mm256_load_ps(tile[4] + 8 * c), r5 = _mm256_load_ps(tile[5] + 8 * c);
                        __m256 r6 = _mm256_load_ps(tile[6] + 8 * c), r7 = _mm256_load_ps(tile[7] + 8 * c);
                        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
                        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
                        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
                        const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
                        const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                        const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                        const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                        const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                        float* out = panel + (u * 32 + 8 * c) * PAGEDLLM_PANEL + half * 8;
                        _mm256_store_ps(out + 0 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s0, s4, 0x20));
                        _mm256_store_ps(out + 1 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s1, s5, 0x20));
                        _mm256_store_ps(out + 2 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s2, s6, 0x20));
                        _mm256_store_ps(out + 3 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s3, s7, 0x20));
                        _mm256_store_ps(out + 4 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s0, s4, 0x31));
                        _mm256_store_ps(out + 5 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s1, s5, 0x31));
                        _mm256_store_ps(out + 6 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s2, s6, 0x31));
                        _mm256_store_ps(out + 7 * PAGEDLLM_PANEL, _mm256_permute2f128_ps(s3, s7, 0x31));
                    }
                }
            }
            return;
        }
    }
#endif
    for (int r = 0; r < PAGEDLLM_PANEL; r++) {
        if (r < cols) {
            dequantize_span<T>(w + (n0 + r) * row_bytes, 0, K, rowbuf);
            for (int64_t k = 0; k < K; k++) panel[k * PAGEDLLM_PANEL + r] = rowbuf[k];
        } else {
            for (int64_t k = 0; k < K; k++) panel[k * PAGEDLLM_PANEL + r] = 0.f;
        }
    }
}

template <int32_t T>
void gemm_large(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N, int64_t K,
                int nthreads) {
    const TypeInfo ti = type_info(T);
    const int64_t row_bytes = K / ti.block * ti.bytes;
    const int64_t num_panels = (N + PAGEDLLM_PANEL - 1) / PAGEDLLM_PANEL;
#pragma omp parallel num_threads(nthreads)
    {
        float* panel = static_cast<float*>(std::aligned_alloc(64, ((K * PAGEDLLM_PANEL * 4 + 63) / 64) * 64));
        float* rowbuf = static_cast<float*>(std::aligned_alloc(64, ((K * 4 + 63) / 64) * 64));
        for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
            const int64_t rows = std::min(M_CHUNK, M - m0);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int cols = int(std::min<int64_t>(PAGEDLLM_PANEL, N - p * PAGEDLLM_PANEL));
                build_panel<T>(panel, rowbuf, w, p * PAGEDLLM_PANEL, cols, K, row_bytes);
                pagedllm_panel_tiles(y + m0 * ldy + p * PAGEDLLM_PANEL, ldy, x + m0 * ldx, ldx, panel, K, cols, rows);
            }
        }
        std::free(panel);
        std::free(rowbuf);
    }
}

// Up to this many rows of x the small path (one pass over the packed bytes) wins; above it
// the panel path, whose dequantization is shared by the rows of a chunk.
constexpr int64_t SMALL_M = 6;

template <int32_t T>
void gemm(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int64_t M, int64_t N, int64_t K,
          int nthreads) {
    if (M > SMALL_M) {
        gemm_large<T>(y, ldy, x, ldx, w, M, N, K, nthreads);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        // Contiguous row ranges, 8-row aligned so threads never share a cache line of y.
        const int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
        const int64_t n0 = std::min(N, id * per), n1 = std::min(N, n0 + per);
        bool buffered = true;  // the buffered path still to run
#ifdef PAGEDLLM_AVX2
        if constexpr (HAS_DEQ32<T>) {
            if (K % 32 == 0) {
                gemm_small_fused<T>(y, ldy, x, ldx, w, M, n0, n1, K);
                buffered = false;
            }
        }
#endif
        if (buffered) gemm_small<T>(y, ldy, x, ldx, w, M, n0, n1, K);
    }
}

template <int32_t T>
void get_rows(float* out, const uint8_t* w, const int64_t* rows, int64_t num_rows, int64_t K, int nthreads) {
    const int64_t row_bytes = K / BLOCK<T> * BYTES<T>;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (num_rows > 4)
    for (int64_t i = 0; i < num_rows; i++) dequantize_span<T>(w + rows[i] * row_bytes, 0, K, out + i * K);
}

// Calls F<T>::run(args...) for the runtime type t; false for an unknown type.
#define PAGEDLLM_GGUF_DISPATCH(t, CALL)        \
    switch (t) {                               \
        case T_F32: CALL(T_F32); break;        \
        case T_F16: CALL(T_F16); break;        \
        case T_BF16: CALL(T_BF16); break;      \
        case T_Q4_0: CALL(T_Q4_0); break;      \
        case T_Q4_1: CALL(T_Q4_1); break;      \
        case T_Q5_0: CALL(T_Q5_0); break;      \
        case T_Q5_1: CALL(T_Q5_1); break;      \
        case T_Q8_0: CALL(T_Q8_0); break;      \
        case T_Q2_K: CALL(T_Q2_K); break;      \
        case T_Q3_K: CALL(T_Q3_K); break;      \
        case T_Q4_K: CALL(T_Q4_K); break;      \
        case T_Q5_K: CALL(T_Q5_K); break;      \
        case T_Q6_K: CALL(T_Q6_K); break;      \
        default: return -1;                    \
    }

}  // namespace

// 1 if this file reads GGML type `ggml_type`.
int gguf_type_supported(int32_t ggml_type) { return type_info(ggml_type).block != 0; }

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T; W: N rows of K weights in GGUF
// blocks of `ggml_type`, rows back to back. Returns 0, or -1 for an unknown type or a K that
// is not a whole number of blocks.
int gguf_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int32_t ggml_type,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
    const TypeInfo ti = type_info(ggml_type);
    if (ti.block == 0 || K % ti.block != 0) return -1;
    if (M <= 0 || N <= 0) return 0;
#define PAGEDLLM_GEMM(T) gemm<T>(y, ldy, x, ldx, w, M, N, K, nthreads)
    PAGEDLLM_GGUF_DISPATCH(ggml_type, PAGEDLLM_GEMM)
#undef PAGEDLLM_GEMM
    return 0;
}

// out [num_rows, K] = the rows `rows` of a GGUF tensor (an embedding lookup). Returns 0 or -1.
int gguf_get_rows_f32(float* out, const uint8_t* w, int32_t ggml_type, const int64_t* rows, int64_t num_rows,
                      int64_t K, int nthreads) {
    const TypeInfo ti = type_info(ggml_type);
    if (ti.block == 0 || K % ti.block != 0) return -1;
#define PAGEDLLM_ROWS(T) get_rows<T>(out, w, rows, num_rows, K, nthreads)
    PAGEDLLM_GGUF_DISPATCH(ggml_type, PAGEDLLM_ROWS)
#undef PAGEDLLM_ROWS
    return 0;
}
