// Native CPU kernels for pagedllm, loaded through ctypes (see pagedllm/kernels/build.py).
//
// - paged_attention_f32: causal attention for a flattened batch (decodes and prefill chunks)
//   that reads K/V in place from the paged cache through the block tables - no gather copy.
// - gguf_gemm_{q4_1,q8_0}: y = x @ W^T with W kept in its GGUF block format, so a step reads
//   0.6-1.1 bytes per weight instead of 4. Activations and accumulation stay fp32, so the
//   result equals x @ dequantize(W)^T up to summation order.
//
// Every kernel has a pure-torch twin in pagedllm/kernels/reference.py; the tests compare them.
// Threads: each call runs an OpenMP team of `nthreads` (the caller passes torch's setting).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif

namespace {

inline float fp16_to_fp32(uint16_t h) {
#ifdef PAGEDLLM_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {  // subnormal: renormalise
            exp = 127 - 15 + 1;
            while ((mant & 0x400) == 0) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
#endif
}

inline float dot(const float* a, const float* b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

inline void axpy(float* y, float alpha, const float* x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

}  // namespace

#ifdef PAGEDLLM_AVX2
namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// exp for 8 lanes: 2^n * p(r) with x = n*ln2 + r, |r| <= ln2/2, p of degree 6 (rel. error ~2e-7).
inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below this the result is 0 (scores - max <= 0)
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Eight dot products at once: lane j of the result = sum of acc[j]'s lanes.
inline __m256 hsum8(const __m256 acc[8]) {
    const __m256 a = _mm256_hadd_ps(acc[0], acc[1]), b = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 c = _mm256_hadd_ps(acc[4], acc[5]), d = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    // ab = [s0 s1 s2 s3 | s0' s1' s2' s3'] (halves of the same sums), likewise cd for s4..s7.
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

// Attention of one query head row (q: DV*8 floats) over ctx keys reached through the block
// table. Two passes that each keep few registers live: scores of 8 keys at a time into
// `scores` (ctx + 8 floats), softmax, then the weighted sum of V rows in DV accumulators.
template <int DV>
void attend_one(float* out, const float* q, const float* key_cache, const float* value_cache, const int64_t* table,
                int64_t ctx, int64_t block_size, int64_t token_stride, int64_t head_offset, float scale,
                float* scores) {
    alignas(32) float qs[DV * 8];
    for (int i = 0; i < DV * 8; i++) qs[i] = q[i] * scale;
    const float* krow[8];
    __m256 vmax = _mm256_set1_ps(-3.0e38f);
    for (int64_t j0 = 0; j0 < ctx; j0 += 8) {
        const int n = int(std::min<int64_t>(8, ctx - j0));
        if (block_size % 8 == 0) {  // the 8 keys are consecutive slots of one block
            const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
            for (int j = 0; j < 8; j++) krow[j] = key_cache + (slot + std::min(j, n - 1)) * token_stride + head_offset;
        } else {
            for (int j = 0; j < 8; j++) {
                const int64_t pos = j0 + std::min(j, n - 1);  // tail lanes repeat the last key
                krow[j] = key_cache + (table[pos / block_size] * block_size + pos % block_size) * token_stride + head_offset;
            }
        }
        __m256 dots[8];
        const __m256 q0 = _mm256_load_ps(qs);
        for (int j = 0; j < 8; j++) dots[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(krow[j]));
        for (int c = 1; c < DV; c++) {
            const __m256 qc = _mm256_load_ps(qs + 8 * c);
            for (int j = 0; j < 8; j++) dots[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(krow[j] + 8 * c), dots[j]);
        }
        const __m256 sv = hsum8(dots);  // lanes past n repeat a real key: harmless for the max
        vmax = _mm256_max_ps(vmax, sv);
        _mm256_storeu_ps(scores + j0, sv);
    }
    // Softmax over the ctx scores.
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= ctx; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mx));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(scores + j, e);
    }
    float sum = hsum(vsum);
    const float mxs = _mm_cvtss_f32(m4);
    for (; j < ctx; j++) { scores[j] = std::exp(scores[j] - mxs); sum += scores[j]; }
    // Weighted sum of V rows.
    __m256 acc[DV];
    for (int c = 0; c < DV; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {
        const float* vb = value_cache + table[j0 / block_size] * block_size * token_stride + head_offset;
        const int64_t n = std::min(block_size, ctx - j0);
        for (int64_t jj = 0; jj < n; jj++) {
            const __m256 p = _mm256_set1_ps(scores[j0 + jj]);
            const float* vr = vb + jj * token_stride;
            for (int c = 0; c < DV; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int c = 0; c < DV; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

}  // namespace
#endif

namespace {

// Portable version of attend_one (any head_dim): scores, softmax, weighted sum.
void attend_one_generic(float* out, const float* q, const float* key_cache, const float* value_cache,
                        const int64_t* table, int64_t ctx, int64_t block_size, int64_t token_stride,
                        int64_t head_offset, int64_t head_dim, float scale, std::vector<float>& scores) {
    scores.resize(ctx);
    float m = -3.0e38f;
    for (int64_t j = 0; j < ctx; j++) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        scores[j] = dot(q, key_cache + slot * token_stride + head_offset, int(head_dim)) * scale;
        m = std::max(m, scores[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < ctx; j++) { scores[j] = std::exp(scores[j] - m); sum += scores[j]; }
    std::fill(out, out + head_dim, 0.f);
    for (int64_t j = 0; j < ctx; j++) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        axpy(out, scores[j] / sum, value_cache + slot * token_stride + head_offset, int(head_dim));
    }
}

}  // namespace

extern "C" {

// out/q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
// Sequence s owns tokens query_start_loc[s] .. query_start_loc[s+1]-1, which are the last
// positions of its seq_lens[s]-token context; token t at position p attends to positions 0..p.
// Work items are (token, query head): independent, and a kv head's rows are shared in cache
// by the query heads of its group that run close together.
void paged_attention_f32(float* out, const float* q, const float* key_cache, const float* value_cache,
                         const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                         const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int nthreads) {
    const int64_t num_tokens = query_start_loc[num_seqs];
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots
    std::vector<int64_t> token_seq(num_tokens);
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) token_seq[t] = s;
    const int64_t work = num_tokens * num_heads;
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; s++) max_ctx = std::max(max_ctx, seq_lens[s]);
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> scores(max_ctx + 8);
#pragma omp for schedule(dynamic, 3)
        for (int64_t w = 0; w < work; w++) {
            const int64_t t = w / num_heads, head = w % num_heads;
            const int64_t s = token_seq[t];
            const int64_t ctx = seq_lens[s] - (query_start_loc[s + 1] - 1 - t);  // keys 0..ctx-1
            const int64_t* table = block_tables + s * block_table_stride;
            const int64_t offset = (head / group) * head_dim;
            const float* qh = q + (t * num_heads + head) * head_dim;
            float* oh = out + (t * num_heads + head) * head_dim;
#ifdef PAGEDLLM_AVX2
            if (head_dim == 64) {
                attend_one<8>(oh, qh, key_cache, value_cache, table, ctx, block_size, token_stride, offset, scale,
                              scores.data());
                continue;
            }
            if (head_dim == 128) {
                attend_one<16>(oh, qh, key_cache, value_cache, table, ctx, block_size, token_stride, offset, scale,
                               scores.data());
                continue;
            }
#endif
            attend_one_generic(oh, qh, key_cache, value_cache, table, ctx, block_size, token_stride, offset, head_dim,
                               scale, scores);
        }
    }
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// GGUF weight-only GEMM. Block layouts (32 weights each, along K):
//   Q4_1: fp16 d, fp16 m, 16 bytes: weight i = d * nibble_i + m; byte j holds i=j (low) and i=j+16 (high)
//   Q8_0: fp16 d, 32 int8:          weight i = d * q_i
// Rows of W are contiguous runs of blocks. M (tokens) is small; the kernel walks W once,
// unpacking each block to fp32 once and applying it to up to MT rows of x.

namespace {

constexpr int QK = 32;
constexpr int MT = 4;  // x rows per pass over W

struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block is 20 bytes");
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block is 34 bytes");

// Unpack one block into 32 floats (the integer part only; scale/min are applied by the caller).
inline void unpack(const BlockQ4_1& b, float* w) {
    for (int j = 0; j < 16; j++) { w[j] = float(b.qs[j] & 0x0f); w[j + 16] = float(b.qs[j] >> 4); }
}
inline void unpack(const BlockQ8_0& b, float* w) {
    for (int j = 0; j < 32; j++) w[j] = float(b.qs[j]);
}
inline float block_min(const BlockQ4_1& b) { return fp16_to_fp32(b.m); }
inline float block_min(const BlockQ8_0&) { return 0.f; }

#ifdef PAGEDLLM_AVX2
// Q4_1 without shuffles: broadcast 4 bytes (8 nibbles) to all lanes and shift each lane by
// 0, 4, ..., 28. Lane order is then w[4g], w[4g+16], w[4g+1], w[4g+17], ... for byte group g,
// so x is permuted to match once per call (permute_x) instead of once per weight row.
inline void unpack8(const BlockQ4_1& b, __m256 q[4]) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32(0x0f);
    for (int g = 0; g < 4; g++) {
        int32_t word;
        std::memcpy(&word, b.qs + 4 * g, 4);
        const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
        q[g] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
    }
}
constexpr bool permutes_x(const BlockQ4_1*) { return true; }
constexpr bool permutes_x(const BlockQ8_0*) { return false; }
inline void unpack8(const BlockQ8_0& b, __m256 q[4]) {
    for (int i = 0; i < 4; i++) {
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * i));
        q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    }
}
#endif

// y[m, n] for rows m0..m0+mt-1 and one weight row n. mt is a template argument so the
// accumulators stay in registers.
template <typename Block, int mt>
inline void gemm_row(float* y, const float* x, const float* xsum, const Block* wrow, int64_t m0,
                     int64_t n, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    float minpart[MT] = {0.f, 0.f, 0.f, 0.f};
#ifdef PAGEDLLM_AVX2
    __m256 acc[MT];
    for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 qv[4];
        unpack8(wrow[b], qv);
        const __m256 d = _mm256_set1_ps(fp16_to_fp32(wrow[b].d));
        const float mn = block_min(wrow[b]);
        for (int i = 0; i < mt; i++) {
            const float* xb = x + (m0 + i) * K + b * QK;
            __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xb), qv[0]);
            s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), qv[1], s);
            s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), qv[2], s);
            s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), qv[3], s);
            acc[i] = _mm256_fmadd_ps(d, s, acc[i]);
            minpart[i] += mn * xsum[(m0 + i) * nb + b];
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * N + n] = hsum(acc[i]) + minpart[i];
#else
    float acc[MT] = {0.f, 0.f, 0.f, 0.f};
    float w[QK];
    for (int64_t b = 0; b < nb; b++) {
        unpack(wrow[b], w);
        const float d = fp16_to_fp32(wrow[b].d);
        const float mn = block_min(wrow[b]);
        for (int i = 0; i < mt; i++) {
            const float* xb = x + (m0 + i) * K + b * QK;
            acc[i] += d * dot(xb, w, QK);
            minpart[i] += mn * xsum[(m0 + i) * nb + b];
        }
    }
    for (int i = 0; i < mt; i++) y[(m0 + i) * N + n] = acc[i] + minpart[i];
#endif
}

#ifdef PAGEDLLM_AVX2
// One x row against 4 weight rows: the single-token case. Four independent accumulation
// chains keep the FMA units busy, and each x block is loaded once for all four rows.
template <typename Block>
inline void gemv_rows4(float* y, const float* x, const float* xsum, const Block* w0, int64_t nb) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float minpart[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < nb; b++) {
        const float* xb = x + b * QK;
        const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        for (int r = 0; r < 4; r++) {
            const Block& blk = w0[r * nb + b];
            __m256 qv[4];
            unpack8(blk, qv);
            const __m256 s01 = _mm256_fmadd_ps(x1, qv[1], _mm256_mul_ps(x0, qv[0]));
            const __m256 s23 = _mm256_fmadd_ps(x3, qv[3], _mm256_mul_ps(x2, qv[2]));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_fp32(blk.d)), _mm256_add_ps(s01, s23), acc[r]);
            minpart[r] += block_min(blk) * xsum[b];
        }
    }
    for (int r = 0; r < 4; r++) y[r] = hsum(acc[r]) + minpart[r];
}
#endif

template <typename Block>
void gguf_gemm(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nb = K / QK;
    const Block* blocks = reinterpret_cast<const Block*>(w);
    std::vector<float> xsum(M * nb);  // per-block sums of x, for the Q4_1 minimum term
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.f;
            for (int k = 0; k < QK; k++) s += x[m * K + b * QK + k];
            xsum[m * nb + b] = s;
        }
#ifdef PAGEDLLM_AVX2
    std::vector<float> xperm;
    if (permutes_x(blocks)) {  // the lane order unpack8 produces (see there)
        xperm.resize(M * K);
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++)
                for (int g = 0; g < 4; g++)
                    for (int i = 0; i < 4; i++)
                        for (int h = 0; h < 2; h++)
                            xperm[m * K + b * QK + 8 * g + 2 * i + h] = x[m * K + b * QK + 4 * g + i + 16 * h];
        x = xperm.data();
    }
#endif
    // Rows of W in chunks: each chunk is read from memory once and applied to all of x.
    constexpr int64_t NC = 16;
    const int64_t chunks = (N + NC - 1) / NC;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n_end = std::min(N, (c + 1) * NC);
#ifdef PAGEDLLM_AVX2
        if (M == 1) {
            int64_t n = c * NC;
            for (; n + 4 <= n_end; n += 4) gemv_rows4(y + n, x, xsum.data(), blocks + n * nb, nb);
            for (; n < n_end; n++) gemm_row<Block, 1>(y, x, xsum.data(), blocks + n * nb, 0, n, N, K);
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mt = std::min<int64_t>(MT, M - m0);
            for (int64_t n = c * NC; n < n_end; n++) {
                const Block* wrow = blocks + n * nb;
                switch (mt) {
                    case 1: gemm_row<Block, 1>(y, x, xsum.data(), wrow, m0, n, N, K); break;
                    case 2: gemm_row<Block, 2>(y, x, xsum.data(), wrow, m0, n, N, K); break;
                    case 3: gemm_row<Block, 3>(y, x, xsum.data(), wrow, m0, n, N, K); break;
                    default: gemm_row<Block, 4>(y, x, xsum.data(), wrow, m0, n, N, K); break;
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// y: [M, N] fp32, x: [M, K] fp32 contiguous, w: [N, K/32] blocks. K must be a multiple of 32.
void gguf_gemm_q4_1(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads) {
    gguf_gemm<BlockQ4_1>(y, x, w, M, N, K, nthreads);
}

void gguf_gemm_q8_0(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads) {
    gguf_gemm<BlockQ8_0>(y, x, w, M, N, K, nthreads);
}

// Which instruction set this build used, for logs and tests.
const char* pagedllm_kernels_isa() {
#ifdef PAGEDLLM_AVX2
    return "avx2";
#else
    return "generic";
#endif
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------
// Small fused element-wise ops. At one token per step each torch op costs more in dispatch than
// in arithmetic, so the layer's glue runs here as one call each. Rows run in parallel only
// when there are enough of them to pay for waking the team.

extern "C" {

// RMS norm of x (or of residual + x, written back to residual) times weight, into out.
// x/out: [T, D] with row strides; residual: [T, D] contiguous or null.
void rms_norm_f32(float* out, const float* x, int64_t x_stride, float* residual, const float* weight, float eps,
                  int64_t T, int64_t D, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T >= 8) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* xr = x + t * x_stride;
        float* o = out + t * D;
        const float* src = xr;
        if (residual != nullptr) {
            float* r = residual + t * D;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) r[i] += xr[i];
            src = r;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; i++) ss += src[i] * src[i];
        const float inv = 1.f / std::sqrt(ss / float(D) + eps);
#pragma omp simd
        for (int64_t i = 0; i < D; i++) o[i] = weight[i] * (src[i] * inv);
    }
}

// Rotary embedding, "rotate half" layout, in place on q [T, H, D] and k [T, Hkv, D] whose rows
// (tokens) are q_stride / k_stride floats apart; cos/sin: [max_positions, D].
void rope_f32(float* q, int64_t q_stride, float* k, int64_t k_stride, const int64_t* positions, const float* cos_table,
              const float* sin_table, int64_t T, int64_t H, int64_t Hkv, int64_t D, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) if (T >= 8) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos_table + positions[t] * D;
        const float* s = sin_table + positions[t] * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float* x = h < H ? q + t * q_stride + h * D : k + t * k_stride + (h - H) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

// Copy each token's K and V rows ([T, Hkv*D], rows row_stride apart) into its cache slot.
void write_kv_f32(const float* k, const float* v, int64_t row_stride, float* key_cache, float* value_cache,
                  const int64_t* slot_mapping, int64_t T, int64_t width) {
    for (int64_t t = 0; t < T; t++) {
        std::memcpy(key_cache + slot_mapping[t] * width, k + t * row_stride, sizeof(float) * width);
        std::memcpy(value_cache + slot_mapping[t] * width, v + t * row_stride, sizeof(float) * width);
    }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]
void silu_and_mul_f32(float* out, const float* gate_up, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T >= 8) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* g = gate_up + t * 2 * I;
        const float* u = g + I;
        float* o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
}

}  // extern "C"

extern "C" {
// The size of the OpenMP team a kernel gets when it asks for n threads (for tests and logs).
int pagedllm_team_size(int n) {
    int size = 0;
#pragma omp parallel num_threads(n)
    {
#pragma omp single
        size = omp_get_num_threads();
    }
    return size;
}
}  // extern "C"
