// What every kernel source file shares: includes, the instruction-set switch, debug checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#include <algorithm>
#include <omp.h>
#include <cstdio>
#include <cstdlib>

// max |x[i]| over n values, NaN if any x[i] is NaN: std::max alone would drop it, and a row
// holding a NaN must not quantise to finite numbers (its twins in torch give NaN).
inline float absmax_keep_nan(const float* x, int64_t n) {
    float m = 0.f;
    bool nan = false;
    for (int64_t i = 0; i < n; i++) {
        const float a = std::fabs(x[i]);
        nan |= a != a;
        m = std::max(m, a);
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Software prefetches for the attention loops: cache lines `n` rows of `row_bytes` each,
// `stride_bytes` apart, into L1 (PREFETCH_L1: prefetcht0) or L2 (PREFETCH_L2: prefetcht1). As
// inline asm: GCC 12 deleted every __builtin_prefetch / _mm_prefetch of those loops at -O1 and
// up (seen in their assembly).
enum PrefetchLevel { PREFETCH_L1, PREFETCH_L2 };
template <PrefetchLevel LEVEL>
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    if constexpr (LEVEL == PREFETCH_L1) asm volatile("prefetcht0 %0" : : "m"(*p));
    else asm volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, LEVEL == PREFETCH_L1 ? 3 : 2);
#endif
}
template <PrefetchLevel LEVEL>
inline void prefetch_rows(const void* base, int64_t n, int64_t stride_bytes, int64_t row_bytes) {
    const char* p = static_cast<const char*>(base);
    for (int64_t r = 0; r < n; r++)
        for (int64_t off = 0; off < row_bytes; off += 64) prefetch_line<LEVEL>(p + r * stride_bytes + off);
}

// The instruction sets are chosen when the library is built for this CPU (build.py: -march=native
// on first use, cached per CPU): PAGEDLLM_AVX2 for AVX2 + FMA (Haswell, Zen), PAGEDLLM_AVX512 on
// top of it for AVX-512 F/BW/DQ/VL (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4). Every
// AVX-512 path has an AVX2 twin and a portable one that the tests build and compare.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define PAGEDLLM_AVX512 1
#endif
#endif

// In a -DPAGEDLLM_DEBUG build, every index is checked before use (a failure names it and aborts).
#ifdef PAGEDLLM_DEBUG
#define PAGEDLLM_CHECK(cond, ...)                                       \
    do {                                                                \
        if (!(cond)) {                                                  \
            std::fprintf(stderr, "pagedllm kernel check failed: " __VA_ARGS__); \
            std::fprintf(stderr, "\n");                                 \
            std::abort();                                               \
        }                                                               \
    } while (0)
#else
#define PAGEDLLM_CHECK(cond, ...) ((void)0)
#endif

// bf16 is the top half of an fp32: widening is exact.
inline float pagedllm_bf16_to_f32(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// IEEE fp16 -> fp32 (exact; subnormals, infinities and NaN included).
inline float pagedllm_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// fp32 -> IEEE fp16, rounded to nearest even as torch's .to(torch.float16): overflow gives an
// infinity, a NaN stays a NaN (quiet), tiny values become fp16 subnormals or zero.
inline uint16_t pagedllm_f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00 | uint16_t((ax >> 13) & 0x3FF);  // NaN
    if (ax >= 0x477FF000u) return sign | 0x7C00;  // rounds to >= 65520: infinity
    if (ax < 0x38800000u) {  // below fp16's smallest normal: a multiple of 2^-24
        if (ax < 0x33000000u) return sign;  // at most half of 2^-24 (a tie goes to even: 0)
        const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
        const int shift = 126 - int(ax >> 23);  // 14..24 bits dropped
        const uint32_t kept = mant >> shift, rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        return sign | uint16_t(kept + (rest > half || (rest == half && (kept & 1))));
    }
    // Normal: rebias the exponent, round the 13 dropped mantissa bits (a carry may bump it).
    const uint32_t rebased = ax - 0x38000000u;
    const uint32_t rest = rebased & 0x1FFFu, kept = rebased >> 13;
    return sign | uint16_t(kept + (rest > 0x1000u || (rest == 0x1000u && (kept & 1))));
#endif
}

// Whether the core runs 512-bit FMAs at full width (cpu_kernels.cpp, pagedllm_set_wide_fma):
// AVX-512 builds then take the tile shapes measured faster on such cores. Never the bits.
extern int g_wide_fma;

// The 16-bit KV cache elements, widened exactly to fp32: bf16 is the top half of an fp32; f16_t
// is IEEE fp16, as the float16 KV cache (--kv-cache-dtype float16) stores it.
using bf16_t = uint16_t;
struct f16_t {
    uint16_t bits;
};
inline float to_f32(float x) { return x; }
inline float to_f32(f16_t x) { return pagedllm_f16_to_f32(x.bits); }
inline float to_f32(bf16_t x) {
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// fp32 -> bf16, rounded to nearest even as torch's .to(torch.bfloat16) (a NaN: its 0x7FC0).
inline uint16_t pagedllm_f32_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return uint16_t((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

// The dense GEMM's micro-kernel driver (panel_gemm.cpp): y[rows, cols] (row stride ldy) =
// x[rows, K] (row stride ldx) @ panel, one 16-column panel stored k-major ([K][16], 32-byte
// aligned), as reference.pack_panels lays it out.
constexpr int PAGEDLLM_PANEL = 16;
void pagedllm_panel_tiles(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                          int64_t rows);

#ifdef PAGEDLLM_AVX2
// 8 fp16 values widened (exactly) to fp32: the GGUF and int8 GEMMs' scales, fp16 KV caches.
inline __m256 pagedllm_load_f16x8(const uint16_t* h) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; i++) f[i] = pagedllm_f16_to_f32(h[i]);
    return _mm256_load_ps(f);
#endif
}

// The sum of v's eight lanes.
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Eight dot products finished at once: lane j of the result = the sum of acc[j]'s lanes.
inline __m256 hsum8(const __m256 acc[8]) {
    const __m256 a = _mm256_hadd_ps(acc[0], acc[1]), b = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 c = _mm256_hadd_ps(acc[4], acc[5]), d = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    // ab = [s0 s1 s2 s3 | s0' s1' s2' s3'] (halves of the same sums), likewise cd for s4..s7.
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

// exp for 8 lanes: 2^n * p(r) with x = n*ln2 + r, |r| <= ln2/2, p of degree 6 (rel. error ~2e-7).
// Below -87.3 the result is 0 (softmax inputs are scores - max <= 0); NaN stays NaN (maxps
// returns its second operand when one is NaN: x goes second).
inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
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
#endif

// max(m, x[0..n)): four vector chains (a max waits 4 cycles for the one before), then the tail.
inline float range_max(const float* x, int64_t n, float m) {
    int64_t j = 0;
#ifdef PAGEDLLM_AVX2
    if (n >= 8) {
        __m256 v0 = _mm256_set1_ps(m), v1 = v0, v2 = v0, v3 = v0;
        for (; j + 32 <= n; j += 32) {
            v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + j));
            v1 = _mm256_max_ps(v1, _mm256_loadu_ps(x + j + 8));
            v2 = _mm256_max_ps(v2, _mm256_loadu_ps(x + j + 16));
            v3 = _mm256_max_ps(v3, _mm256_loadu_ps(x + j + 24));
        }
        v0 = _mm256_max_ps(_mm256_max_ps(v0, v1), _mm256_max_ps(v2, v3));
        for (; j + 8 <= n; j += 8) v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + j));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, v0);
        for (float l : lanes) m = std::max(m, l);
    }
#endif
    for (; j < n; j++) m = std::max(m, x[j]);
    return m;
}
