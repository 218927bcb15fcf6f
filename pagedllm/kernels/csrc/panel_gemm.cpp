// Dense fp32 GEMM y = x @ W^T for steps of more than a few tokens. W is packed once at load
// (pagedllm/kernels/reference.py: pack_panels) into panels of 16 rows stored k-major,
// panel[p][k][j] = W[16p + j][k], so a micro-kernel streams one 16-wide row of the panel per k
// and keeps a 6 x 16 tile of y in 12 registers: 12 FMAs per 2 loads and 6 broadcasts (AVX-512:
// an 8 x 16 tile in 8 registers, 8 FMAs per load). x is cut into chunks of rows that stay in
// L2 while all panels pass over them.

#include "common.h"
#include "kernels.h"

namespace {

constexpr int PANEL = 16;
constexpr int MR_MAX = 6;
constexpr int64_t M_CHUNK = 96;
// The first tile over a panel streams it from memory (the later ones of the chunk find it in
// cache): it asks for the panel row PANEL_PREFETCH ahead (one cache line per k; past the panel's
// end, the next panel, which the thread takes next) into L2 (prefetcht1). Measured on Zen 4,
// the model's 121 linears in turn (513 MiB of panels), alternated in one process: 64 rows
// 88-90 -> 79.5 ms (AVX2 build 99.6 -> 86.9), 16 rows 31.8 -> 23.9, 2048 rows 2630 -> 2573 ms;
// 16 lines ahead gained nothing, 64 half of it.
constexpr int64_t PANEL_PREFETCH = 128;

// One 6 x 16 tile of y over the whole K. Named accumulators: with arrays GCC spilled them to
// the stack on every k (half the speed). Rows past `rows` read row 0 again and are not stored.
inline void panel_tile(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                       int rows, bool stream) {
    const float* xr[MR_MAX];
    for (int i = 0; i < MR_MAX; i++) xr[i] = x + (i < rows ? i : 0) * ldx;
#ifdef PAGEDLLM_AVX2
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0;
    __m256 a3 = a0, b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
    const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[3], *x4 = xr[4], *x5 = xr[5];
    for (int64_t k = 0; k < K; k++) {
        if (stream) __builtin_prefetch(panel + (k + PANEL_PREFETCH) * PANEL, 0, 2);
        const __m256 w0 = _mm256_load_ps(panel + k * PANEL), w1 = _mm256_load_ps(panel + k * PANEL + 8);
        __m256 v = _mm256_broadcast_ss(x0 + k);
        a0 = _mm256_fmadd_ps(v, w0, a0); b0 = _mm256_fmadd_ps(v, w1, b0);
        v = _mm256_broadcast_ss(x1 + k);
        a1 = _mm256_fmadd_ps(v, w0, a1); b1 = _mm256_fmadd_ps(v, w1, b1);
        v = _mm256_broadcast_ss(x2 + k);
        a2 = _mm256_fmadd_ps(v, w0, a2); b2 = _mm256_fmadd_ps(v, w1, b2);
        v = _mm256_broadcast_ss(x3 + k);
        a3 = _mm256_fmadd_ps(v, w0, a3); b3 = _mm256_fmadd_ps(v, w1, b3);
        v = _mm256_broadcast_ss(x4 + k);
        a4 = _mm256_fmadd_ps(v, w0, a4); b4 = _mm256_fmadd_ps(v, w1, b4);
        v = _mm256_broadcast_ss(x5 + k);
        a5 = _mm256_fmadd_ps(v, w0, a5); b5 = _mm256_fmadd_ps(v, w1, b5);
    }
    alignas(32) float tile[MR_MAX][PANEL];
    _mm256_store_ps(tile[0], a0); _mm256_store_ps(tile[0] + 8, b0);
    _mm256_store_ps(tile[1], a1); _mm256_store_ps(tile[1] + 8, b1);
    _mm256_store_ps(tile[2], a2); _mm256_store_ps(tile[2] + 8, b2);
    _mm256_store_ps(tile[3], a3); _mm256_store_ps(tile[3] + 8, b3);
    _mm256_store_ps(tile[4], a4); _mm256_store_ps(tile[4] + 8, b4);
    _mm256_store_ps(tile[5], a5); _mm256_store_ps(tile[5] + 8, b5);
#else
    (void)stream;  // no prefetch in the portable code
    float tile[MR_MAX][PANEL] = {};
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < MR_MAX; i++) {
            const float v = xr[i][k];
#pragma omp simd
            for (int j = 0; j < PANEL; j++) tile[i][j] += v * panel[k * PANEL + j];
        }
#endif
    for (int i = 0; i < rows; i++) std::memcpy(y + i * ldy, tile[i], cols * sizeof(float));
}

#ifdef PAGEDLLM_AVX512
// AVX-512: a panel row is one zmm, so a tile of MR rows x NP adjacent panels is MR * NP
// accumulators, each FMA taking its x value as an embedded broadcast: MR * NP FMAs per NP
// panel loads. Each y element is the same k chain as the AVX2 tile's, so the bits are the
// same, whatever MR and NP. One panel, 8 rows (96 = 12 tiles) was measured best on Zen 4: 6
// and 10 about as fast, 12 and 14 slower (5-10%).
constexpr int MR512 = 8;
// Two panels (32 columns), 12 rows: 14 loads per 24 FMAs against one panel's 9 per 8. A core
// with two 512-bit FMA units (Intel) is bound by loads with one panel; measured on an Intel
// Xeon (family 6 model 207, AVX-512 without bf16/AMX), 2 threads, the model's linears: 64 rows
// 183 -> 193, 256 rows 134 -> 206, 2048 rows 125 -> 213 GFLOP/s (8 and 14 rows were slower,
// 10 as fast). Zen 4 (one 512-bit FMA per cycle) was not measured with it, so it stays on one
// panel: the engine turns this on for Intel CPUs (g_wide_fma).
constexpr int MR512X2 = 12;

// `cols`: the columns of the last of the NP panels (the others are full).
template <int MR, int NP>
inline void panel_tile512(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                          bool stream) {
    __m512 acc[NP][MR];
#pragma GCC unroll 2
    for (int p = 0; p < NP; p++)
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) acc[p][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w[NP];
#pragma GCC unroll 2
        for (int p = 0; p < NP; p++) {
            if (stream) __builtin_prefetch(panel + p * K * PANEL + (k + PANEL_PREFETCH) * PANEL, 0, 2);
            w[p] = _mm512_loadu_ps(panel + p * K * PANEL + k * PANEL);
        }
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            const __m512 v = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 2
            for (int p = 0; p < NP; p++) acc[p][i] = _mm512_fmadd_ps(v, w[p], acc[p][i]);
        }
    }
    const __mmask16 mask = __mmask16((1u << cols) - 1);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
#pragma GCC unroll 2
        for (int p = 0; p + 1 < NP; p++) _mm512_storeu_ps(y + i * ldy + p * PANEL, acc[p][i]);
        _mm512_mask_storeu_ps(y + i * ldy + (NP - 1) * PANEL, mask, acc[NP - 1][i]);
    }
}

// The rows left after the full tiles, in one tile of their own size.
template <int MR, int NP>
inline void panel_tail512(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                          int rows, bool stream) {
    if constexpr (MR > 0) {
        if (rows == MR) return panel_tile512<MR, NP>(y, ldy, x, ldx, panel, K, cols, stream);
        panel_tail512<MR - 1, NP>(y, ldy, x, ldx, panel, K, cols, rows, stream);
    }
}

// `rows` rows of x times NP adjacent panels, in tiles of MR rows and one tile for the rest.
template <int MR, int NP>
void panel_rows512(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                   int64_t rows) {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) panel_tile512<MR, NP>(y + m * ldy, ldy, x + m * ldx, ldx, panel, K, cols, m == 0);
    if (m < rows) panel_tail512<MR - 1, NP>(y + m * ldy, ldy, x + m * ldx, ldx, panel, K, cols, int(rows - m), m == 0);
}
#endif

void panel_tiles(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                 int64_t rows) {
#ifdef PAGEDLLM_AVX512
    panel_rows512<MR512, 1>(y, ldy, x, ldx, panel, K, cols, rows);
#else
    for (int64_t m = 0; m < rows; m += MR_MAX)
        panel_tile(y + m * ldy, ldy, x + m * ldx, ldx, panel, K, cols, int(std::min<int64_t>(MR_MAX, rows - m)), m == 0);
#endif
}

}  // namespace

// For the other source files (common.h): `rows` rows of x times one panel of `cols` columns.
void pagedllm_panel_tiles(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panel, int64_t K, int cols,
                          int64_t rows) {
    panel_tiles(y, ldy, x, ldx, panel, K, cols, rows);
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W packed by pack_panels.
void panel_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panels, int64_t M, int64_t N,
                    int64_t K, int nthreads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    // A work item is one panel, or two adjacent ones with g_wide_fma (the last alone when the
    // count is odd).
#ifdef PAGEDLLM_AVX512
    const int64_t per_item = g_wide_fma ? 2 : 1;
#else
    const int64_t per_item = 1;
#endif
    const int64_t items = (num_panels + per_item - 1) / per_item;
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t rows = std::min(M_CHUNK, M - m0);
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t p = it * per_item;
            float* yp = y + m0 * ldy + p * PANEL;
            const float* xp = x + m0 * ldx;
            const float* panel = panels + p * K * PANEL;
#ifdef PAGEDLLM_AVX512
            if (per_item == 2 && p + 1 < num_panels) {
                panel_rows512<MR512X2, 2>(yp, ldy, xp, ldx, panel, K, int(std::min<int64_t>(PANEL, N - (p + 1) * PANEL)), rows);
                continue;
            }
#endif
            panel_tiles(yp, ldy, xp, ldx, panel, K, int(std::min<int64_t>(PANEL, N - p * PANEL)), rows);
        }
    }
}
