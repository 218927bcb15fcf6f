// Native CPU kernels for pagedllm, loaded through ctypes (see pagedllm/kernels/build.py). The
// core kernels' C API is kernels.h; each of the other files declares its own:
//
// - paged_attention.cpp: causal attention for a flattened batch, reading K/V in place from the
//   paged cache through the block tables (fp32, fp16 and bf16 caches);
//   kv_quant_attention.cpp: the same over int8 / fp8 caches with scales.
// - grouped_gemm.cpp: y = x @ W^T on GGUF blocks (Q4_1, Q8_0) for steps of a few tokens;
//   panel_gemm.cpp: the dense fp32 GEMM on 16-row panels for bigger steps. Both sum every output
//   in the same k order, so a row's result does not depend on the step size.
// - gguf_gemm.cpp: the same product on any GGUF block type (weights kept in the file's blocks);
//   int8_gemm.cpp: the fast modes' integer GEMM (activation_dtype int8 / int16).
// - layer_ops.cpp: one layer's glue (RMS norm, RoPE, K/V writes, SiLU-and-mul, grammar masks).
// - decoder_stack.cpp: all decoder layers of a step in one call, with the kernels above.
// - sampling.cpp: temperature, min-p, top-k, top-p and the draw, one pass per row.
// - this file: the build's switches (instruction set, full-width 512-bit FMAs, debug checks).
//
// Every kernel has a pure-torch twin in pagedllm/kernels/reference.py; the tests compare them.
// Instruction sets (common.h): each kernel has a portable path and an AVX2 one; the GEMMs and
// the attention also have an AVX-512 one (PAGEDLLM_AVX512, compiled in when build.py's
// -march=native finds AVX-512 on this CPU), which sums every output in the same order with the
// same FMAs, so the AVX2 and AVX-512 builds give the same bits (tests/kernels:
// test_each_simd_build_...).
// Threads: each call runs an OpenMP team of `nthreads` (the caller passes torch's setting).
// Sizes: callers pass the pool sizes (num_blocks, num_slots, max_positions); Python checks the
// step's block tables, slots and positions against them once per step, and a build with
// -DPAGEDLLM_DEBUG (PAGEDLLM_KERNEL_DEBUG=1) checks every access here too. Built without
// -ffast-math: with GCC it would link crtfastmath.o, which flushes denormals to zero for the
// whole process (torch included).

#include "common.h"
#include "kernels.h"

// The core runs 512-bit FMAs at full width on two units (Intel; Zen 4 splits each into two
// 256-bit halves), set once at load by kernels/build.py. AVX-512 builds then take the tile
// shapes measured faster there: two panels per dense GEMM tile, the zmm tile for one- and
// two-row Q4_1 steps, and attention rows in pairs. Every tile sums each output in the same
// order: the bits do not change. (Declared in common.h.)
int g_wide_fma = 0;

void pagedllm_set_wide_fma(int on) {
#ifdef PAGEDLLM_AVX512
    g_wide_fma = on != 0;
#else
    (void)on;
#endif
}

int pagedllm_wide_fma() { return g_wide_fma; }

// Which instruction set this build used, for logs and tests.
const char* pagedllm_kernels_isa() {
#if defined(PAGEDLLM_AVX512)
    return "avx512";
#elif defined(PAGEDLLM_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}

// 1 in a -DPAGEDLLM_DEBUG build (every index checked), else 0.
int pagedllm_debug_checks() {
#ifdef PAGEDLLM_DEBUG
    return 1;
#else
    return 0;
#endif
}

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
