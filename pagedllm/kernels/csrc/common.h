// What every kernel source file shares: includes, the instruction-set switch, debug checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include <algorithm>
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
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

// The dense GEMM's micro-kernel driver (cpu_kernels.cpp): y[rows, cols] (row stride ldy) =
// x[rows, K] (row stride ldx) @ panel, one 16-column panel stored k-major ([K][16], 32-byte
// aligned), as reference.pack_panels lays it out.
constexpr int PAGEDLLM_PANEL = 16;
void pagedllm_panel_tiles(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                          int64_t rows);
