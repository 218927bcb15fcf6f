// Native CPU kernels for pagedllm, loaded through ctypes (see pagedllm/kernels/build.py).
//
// - paged_attention_{f32,bf16}, paged_attention_kv_f16: causal attention for a flattened batch
//   (decodes and prefill chunks) that reads K/V in place from the paged cache through the block
//   tables - no gather copy; a sliding window skips the blocks before it. The bf16 and fp16
//   variants read a 16-bit cache (half the bytes), widen it in registers and compute in fp32.
// - grouped_gemm_{q4_1,q8_0}: y = x @ W^T with W kept in GGUF blocks (regrouped), so a step reads
//   0.6-1.1 bytes per weight instead of 4. Activations and accumulation stay fp32, so the
//   result equals x @ dequantize(W)^T up to summation order.
// - panel_gemm_f32: dense fp32 y = x @ W^T on weights repacked into 16-row panels (bigger steps).
// - rms_norm_f32, rope_f32, write_kv_f32, silu_and_mul_f32: one layer's fused glue.
// - decoder_stack_f32: all decoder layers of a step in one call (the kernels above; the int8
//   GEMM of int8_gemm.cpp for the fast modes' weights).
//
// Every kernel has a pure-torch twin in pagedllm/kernels/reference.py; the tests compare them.
// Instruction sets (common.h): each kernel has a portable path and an AVX2 one; the two GEMMs
// also have an AVX-512 one (PAGEDLLM_AVX512, compiled in when build.py's -march=native finds
// AVX-512 on this CPU), which sums every output in the same k order with the same FMAs, so the
// AVX2 and AVX-512 builds give the same bits (tests/kernels: test_each_simd_build_...). The
// attention's AVX-512 path (Intel only, g_wide_fma) runs two query rows per zmm with each lane
// doing its ymm lane's arithmetic, so it too keeps the bits; on Zen 4, which runs a 512-bit op
// as two 256-bit halves, zmm scores/softmax/V sums measured no faster than the AVX2 loop, and
// the same row pairs go as two ymm rows side by side instead (`twin`: 32 ymm registers).
// Threads: each call runs an OpenMP team of `nthreads` (the caller passes torch's setting).
// Sizes: callers pass the pool sizes (num_blocks, num_slots, max_positions); Python checks the
// step's block tables, slots and positions against them once per step, and a build with
// -DPAGEDLLM_DEBUG (PAGEDLLM_KERNEL_DEBUG=1) checks every access here too. Built without
// -ffast-math: with GCC it would link crtfastmath.o, which flushes denormals to zero for the
// whole process (torch included).

#include "common.h"

#include <type_traits>

// ============================================================================================
// The C API: every symbol build.py loads is declared here and only here. build.py reads these
// prototypes to set the ctypes signatures, and the compiler checks every definition below
// against them (a C-linkage function cannot be overloaded), so the two cannot drift apart.
// C-API-BEGIN
extern "C" {
void paged_attention_f32(float* out, const float* q, const float* key_cache, const float* value_cache,
                         const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                         const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t window, float scale,
                         int nthreads);
void paged_attention_bf16(float* out, const float* q, const uint16_t* key_cache, const uint16_t* value_cache,
                          const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                          const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t window, float scale,
                          int nthreads);
void paged_attention_kv_f16(float* out, const float* q, const uint16_t* key_cache, const uint16_t* value_cache,
                            const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                            const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale, int64_t window,
                            int nthreads);
void grouped_gemm_q4_1(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads);
void grouped_gemm_q8_0(float* y, const float* x, const uint8_t* w, int64_t M, int64_t N, int64_t K, int nthreads);
void panel_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const float* panels, int64_t M, int64_t N,
                    int64_t K, int nthreads);
void pagedllm_set_wide_fma(int on);
int pagedllm_wide_fma();
void rms_norm_f32(float* out, const float* x, int64_t x_stride, float* residual, const float* weight, float eps,
                  int64_t T, int64_t D, int nthreads);
void rope_f32(float* q, int64_t q_stride, float* k, int64_t k_stride, const int64_t* positions, const float* cos_table,
              const float* sin_table, int64_t max_positions, int64_t T, int64_t H, int64_t Hkv, int64_t D,
              int nthreads);
void write_kv_f32(const float* k, const float* v, int64_t row_stride, float* key_cache, float* value_cache,
                  const int64_t* slot_mapping, int64_t num_slots, int64_t T, int64_t width, int nthreads);
void write_kv_f16(const float* k, const float* v, int64_t row_stride, uint16_t* key_cache, uint16_t* value_cache,
                  const int64_t* slot_mapping, int64_t num_slots, int64_t T, int64_t width, int nthreads);
void write_kv_bf16(const float* k, const float* v, int64_t row_stride, uint16_t* key_cache, uint16_t* value_cache,
                   const int64_t* slot_mapping, int64_t num_slots, int64_t T, int64_t width, int nthreads);
void silu_and_mul_f32(float* out, const float* gate_up, int64_t T, int64_t I, int nthreads);
void apply_token_bitmask_f32(float* logits, int64_t logits_stride, const int64_t* rows, int64_t num_rows,
                             const int32_t* bitmask, int64_t bitmask_stride, int64_t vocab, int nthreads);
int decoder_stack_f32(float* out, float* residual, const int64_t* layer_ptrs, const int32_t* layer_qtypes,
                      int64_t num_layers, const float* final_norm, float eps, int64_t T, int64_t hidden,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                      const int64_t* positions, const float* cos_table, const float* sin_table, int64_t max_positions,
                      const int64_t* slot_mapping, const int64_t* block_tables, int64_t block_table_stride,
                      const int64_t* seq_lens, const int64_t* query_start_loc, int64_t num_seqs, int64_t block_size,
                      int64_t num_blocks, float scale, int32_t kv_dtype, int32_t act_bits, int nthreads);
const char* pagedllm_kernels_isa();
int pagedllm_team_size(int n);
int pagedllm_debug_checks();
}
// C-API-END

// The core runs 512-bit FMAs at full width on two units (Intel; Zen 4 splits each into two
// 256-bit halves), set once at load by kernels/build.py. AVX-512 builds then take the tile
// shapes measured faster there: two panels per dense GEMM tile, the zmm tile for one- and
// two-row Q4_1 steps, and attention rows in pairs. Every tile sums each output in the same
// order: the bits do not change.
namespace {
int g_wide_fma = 0;
}  // namespace

void pagedllm_set_wide_fma(int on) {
#ifdef PAGEDLLM_AVX512
    g_wide_fma = on != 0;
#else
    (void)on;
#endif
}

int pagedllm_wide_fma() { return g_wide_fma; }


// Defined in int8_gemm.cpp (its C API); the decoder stack calls it for int8-panel weights.
extern "C" int int8_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int32_t ggml_type,
                             int64_t M, int64_t N, int64_t K, int32_t act_bits, int nthreads);

namespace {

constexpr int MAX_ITEM_HEADS = 16;  // query heads of one attention work item (more: split into items)

// bf16 is the top half of an fp32: widening is exact.
using bf16_t = uint16_t;
inline float to_f32(float x) { return x; }
// IEEE fp16, as the float16 KV cache (--kv-cache-dtype float16) stores it; also exact to widen.
struct f16_t {
    uint16_t bits;
};
inline float to_f32(f16_t x) { return pagedllm_f16_to_f32(x.bits); }
inline float to_f32(bf16_t x) {
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <typename T>
inline float dot(const float* a, const T* b, int n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * to_f32(b[i]);
    return s;
}

template <typename T>
inline void axpy(float* y, float alpha, const T* x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += alpha * to_f32(x[i]);
}

}  // namespace

#ifdef PAGEDLLM_AVX2
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const f16_t* p) { return pagedllm_load_f16x8(&p->bits); }
inline __m256 load8(const bf16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

#ifdef PAGEDLLM_AVX512
// Two attention rows side by side in one zmm (lanes 0-7 row A, 8-15 row B) for CPUs with
// full-width 512-bit FMAs (g_wide_fma): every lane does the arithmetic of its row's ymm lane
// in attend_heads, so a pair gives the bits of two single rows at half the FMA count. The K/V
// row both use is loaded once into both halves.
inline __m512 load8x2(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
inline __m512 load8x2(const f16_t* p) {
    return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p->bits))));
}
inline __m512 load8x2(const bf16_t* p) {
    const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 join(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
// _mm256_hadd_ps on each 256-bit half: the same pairs summed.
inline __m512 hadd2(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
// hsum8 (common.h) on each 256-bit half, with the same tree of adds.
inline __m512 hsum8x2(const __m512 acc[8]) {
    const __m512 a = hadd2(acc[0], acc[1]), b = hadd2(acc[2], acc[3]);
    const __m512 c = hadd2(acc[4], acc[5]), d = hadd2(acc[6], acc[7]);
    const __m512 ab = hadd2(a, b), cd = hadd2(c, d);
    // permute2f128(ab, cd, 0x20 / 0x31) within each half: 128-bit quarters (ab0 cd0 | ab2 cd2), (ab1 cd1 | ab3 cd3).
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi_idx = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(ab, lo_idx, cd), _mm512_permutex2var_ps(ab, hi_idx, cd));
}
#endif

// The rows (row_elems from `head_offset`: some adjacent KV heads) of block slots slot0..slot0+n-1,
// into L2 (measured faster here than into L1, which these loops' working set would churn).
template <typename T>
inline void prefetch_block(const T* cache, int64_t slot0, int64_t n, int64_t token_stride, int64_t head_offset,
                           int64_t row_elems) {
    prefetch_rows<PREFETCH_L2>(cache + slot0 * token_stride + head_offset, n, token_stride * int64_t(sizeof(T)),
                               row_elems * int64_t(sizeof(T)));
}

// Attention of NQ consecutive query tokens of one sequence (contexts ctx, ctx + 1, ...,
// ctx + NQ - 1: a prefill chunk's tokens, or one decode token), each with the query heads of NKV
// consecutive KV heads (G query heads each; NQ * NKV * G <= MAX_ITEM_HEADS rows). Token i's
// head h = k * G + g (KV head k) is q[i * q_stride + h * HD]; out likewise. Keys start..ctx-1+i
// (start > 0: a sliding window, one start for all - callers pass NQ = 1 then; the blocks before
// start's are never read - they may already belong to another request).
//
// Memory: a block's rows of all NKV heads are adjacent in the cache, so an item covering every
// KV head of its token reads each K/V block as one contiguous run, and the next block (scattered
// elsewhere in the pool) is prefetched while this one is computed: DRAM, not latency, then bounds
// decode. Each K/V row is fetched once for all the rows that use it (the first brings it into
// L1): the G heads sharing it and, in a prefill tile, the NQ tokens. Two passes: scores of 8
// keys at a time into `scores` (one row of `sstride` floats per (token, head)), softmax, then
// the weighted sum of V rows block by block, with each row's DV accumulators parked in `accbuf`
// between blocks. Each row's arithmetic - its keys, their order, its sums - does not depend on
// NQ or NKV (a token's chunk lanes past its own context are computed but never used), so how
// the work is split into items never changes a result.
//
// Score chunks start at `a`: start rounded down to 8 when blocks are multiples of 8 (so a
// chunk's 8 keys are consecutive slots of one block - start's own block), else start itself:
//
//     key positions:  a        start                               ctx
//                     |  off   |<------------ L keys ------------->|
//     scores[r]:      [masked  | softmax over these               ] (index = position - a)
template <int DV, typename T>
void attend_heads(float* out, const float* q, int64_t q_stride, int NQ, int NKV, int G, const T* key_cache,
                  const T* value_cache, const int64_t* table, int64_t start, int64_t ctx0, int64_t block_size,
                  int64_t token_stride, int64_t head_offset, float scale, float* scores, int64_t sstride) {
    constexpr int HD = DV * 8;  // head_dim
    const int NH = NKV * G, NR = NQ * NH;  // rows: r = i * NH + h
    alignas(32) float qs[MAX_ITEM_HEADS][HD];
    alignas(32) float accbuf[MAX_ITEM_HEADS][HD];
    __m256 vmax8[MAX_ITEM_HEADS];  // running maxima per lane (a max is exact in any order)
    for (int r = 0; r < NR; r++) {
        const float* qr = q + (r / NH) * q_stride + (r % NH) * HD;
        for (int i = 0; i < HD; i++) qs[r][i] = qr[i] * scale;
        vmax8[r] = _mm256_set1_ps(-3.0e38f);
    }
    const __m256 lane_index = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    const int64_t ctx = ctx0 + NQ - 1;  // the last token's: the keys any row reads
    const int64_t row_elems = int64_t(NKV) * HD;  // one slot's elements for these heads
    const bool aligned = block_size % 8 == 0;
    const int64_t a = aligned ? start - start % 8 : start;
    const int off = int(start - a);  // leading lanes of the first chunk that precede the window
    const int64_t last_block = (ctx - 1) / block_size;
#ifdef PAGEDLLM_AVX512
    // Rows r and r + 1 go as a pair when they read the same KV head. Rows are ordered by token,
    // so r + 1's context is never shorter than r's.
    auto same_kv_head = [&](int r) { return r + 1 < NR && (r % NH) / G == ((r + 1) % NH) / G; };
    auto paired = [&](int r) { return g_wide_fma && same_kv_head(r); };
    // Without full-width FMAs (Zen 4 splits a zmm op in two), the same pairs go as two ymm rows
    // side by side: each K / V load (and fp16 / bf16 widening) then feeds both rows, and the
    // two rows' chains interleave. Every row's own operations are unchanged. With 32 ymm
    // registers, head_dim 64 only (two rows' 16 accumulators; 128 would spill).
    auto twin = [&](int r) { return DV <= 8 && !g_wide_fma && same_kv_head(r); };
#endif
    auto block_slot = [&](int64_t b) { return table[b] * block_size; };
    prefetch_block(key_cache, block_slot(a / block_size) + a % block_size,
                   std::min(block_size - a % block_size, ctx - a), token_stride, head_offset, row_elems);
    const T* krow[8];
    for (int64_t j0 = a; j0 < ctx; j0 += 8) {
        const int n = int(std::min<int64_t>(8, ctx - j0));
        // Prefetch (blocks of 8-aligned chunks only): the K rows one block ahead and this chunk's
        // V rows (pass 2 then finds them in L2), a few rows before each row r's dot products
        // rather than all 16 at the chunk's start: a burst of ~190 line requests left the
        // decode attention at 18-19 GB/s from DRAM, spread out it reads 24-26 GB/s (64 x 320
        // tokens, 30 layers' caches; contiguous streaming is ~32 GB/s here).
        const int64_t pk = j0 + block_size;
        const int64_t pk_rows = aligned && pk < ctx ? std::min<int64_t>(8, ctx - pk) : 0;
        const int64_t pv_rows = aligned ? n : 0;
        const int rows_per_r = (8 + NR - 1) / NR;
        auto prefetch_share = [&](int r) {
            for (int64_t i = int64_t(r) * rows_per_r; i < int64_t(r + 1) * rows_per_r; i++) {
                if (i < pk_rows)
                    prefetch_block(key_cache, block_slot(pk / block_size) + pk % block_size + i, 1, token_stride,
                                   head_offset, row_elems);
                if (i < pv_rows)
                    prefetch_block(value_cache, block_slot(j0 / block_size) + j0 % block_size + i, 1, token_stride,
                                   head_offset, row_elems);
            }
        };
        if (aligned) {  // the 8 keys are consecutive slots of one block
            const int64_t slot = table[j0 / block_size] * block_size + j0 % block_size;
            for (int j = 0; j < 8; j++) krow[j] = key_cache + (slot + std::min(j, n - 1)) * token_stride + head_offset;
        } else {
            for (int j = 0; j < 8; j++) {
                const int64_t pos = j0 + std::min(j, n - 1);  // tail lanes repeat the last key
                krow[j] = key_cache + (table[pos / block_size] * block_size + pos % block_size) * token_stride + head_offset;
            }
        }
        const int first_lane = j0 == a ? off : 0;  // lanes before the window stay out of the max
        auto take_scores = [&](int r, __m256 sv) {
            const int64_t own = ctx0 + r / NH - j0;  // this row's keys in the chunk (lanes past it: unused)
            _mm256_storeu_ps(scores + r * sstride + (j0 - a), sv);
            if (first_lane == 0 && own >= 8) {
                vmax8[r] = _mm256_max_ps(vmax8[r], sv);
            } else {  // lanes before the window or past this row's context stay out of the max
                const __m256 in = _mm256_and_ps(_mm256_cmp_ps(lane_index, _mm256_set1_ps(float(first_lane)), _CMP_GE_OQ),
                                                _mm256_cmp_ps(lane_index, _mm256_set1_ps(float(std::min<int64_t>(8, own))), _CMP_LT_OQ));
                vmax8[r] = _mm256_max_ps(vmax8[r], _mm256_blendv_ps(_mm256_set1_ps(-3.0e38f), sv, in));
            }
        };
        for (int r = 0; r < NR;) {
            prefetch_share(r);
            const int64_t own = ctx0 + r / NH - j0;  // this row's keys in the chunk (lanes past it: unused)
            if (own <= 0) { r++; continue; }
            const int64_t ko = int64_t((r % NH) / G) * HD;  // this head's KV head within the row
#ifdef PAGEDLLM_AVX512
            if (paired(r)) {  // rows r and r + 1 (same KV head) in one zmm
                prefetch_share(r + 1);
                __m512 dots[8];
                const __m512 q0 = join(_mm256_load_ps(qs[r]), _mm256_load_ps(qs[r + 1]));
                for (int j = 0; j < 8; j++) dots[j] = _mm512_mul_ps(q0, load8x2(krow[j] + ko));
                for (int c = 1; c < DV; c++) {
                    const __m512 qc = join(_mm256_load_ps(qs[r] + 8 * c), _mm256_load_ps(qs[r + 1] + 8 * c));
                    for (int j = 0; j < 8; j++) dots[j] = _mm512_fmadd_ps(qc, load8x2(krow[j] + ko + 8 * c), dots[j]);
                }
                const __m512 sv = hsum8x2(dots);
                take_scores(r, _mm512_castps512_ps256(sv));
                take_scores(r + 1, _mm512_extractf32x8_ps(sv, 1));  // r + 1 sees at least r's keys
                r += 2;
                continue;
            }
            if (twin(r)) {  // rows r and r + 1 (same KV head): one K load for both
                prefetch_share(r + 1);
                __m256 d0[8], d1[8];
                const __m256 a0 = _mm256_load_ps(qs[r]), b0 = _mm256_load_ps(qs[r + 1]);
                for (int j = 0; j < 8; j++) {
                    const __m256 k = load8(krow[j] + ko);
                    d0[j] = _mm256_mul_ps(a0, k);
                    d1[j] = _mm256_mul_ps(b0, k);
                }
                for (int c = 1; c < DV; c++) {
                    const __m256 ac = _mm256_load_ps(qs[r] + 8 * c), bc = _mm256_load_ps(qs[r + 1] + 8 * c);
                    for (int j = 0; j < 8; j++) {
                        const __m256 k = load8(krow[j] + ko + 8 * c);
                        d0[j] = _mm256_fmadd_ps(ac, k, d0[j]);
                        d1[j] = _mm256_fmadd_ps(bc, k, d1[j]);
                    }
                }
                take_scores(r, hsum8(d0));
                take_scores(r + 1, hsum8(d1));  // r + 1 sees at least r's keys
                r += 2;
                continue;
            }
#endif
            __m256 dots[8];
            const __m256 q0 = _mm256_load_ps(qs[r]);
            for (int j = 0; j < 8; j++) dots[j] = _mm256_mul_ps(q0, load8(krow[j] + ko));
            for (int c = 1; c < DV; c++) {
                const __m256 qc = _mm256_load_ps(qs[r] + 8 * c);
                for (int j = 0; j < 8; j++) dots[j] = _mm256_fmadd_ps(qc, load8(krow[j] + ko + 8 * c), dots[j]);
            }
            take_scores(r, hsum8(dots));
            r++;
        }
    }
    float vmaxs[MAX_ITEM_HEADS];
    for (int r = 0; r < NR; r++) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vmax8[r]);
        vmaxs[r] = lanes[0];
        for (int j = 1; j < 8; j++) vmaxs[r] = std::max(vmaxs[r], lanes[j]);
    }
    prefetch_block(value_cache, block_slot(start / block_size) + start % block_size,
                   std::min(block_size - start % block_size, ctx - start), token_stride, head_offset, row_elems);
    // Softmax of each row's scores (those of keys start..its context - 1).
    float sums[MAX_ITEM_HEADS];
    for (int r = 0; r < NR; r++) {
        const int64_t L = ctx0 + r / NH - start;
        float* sc = scores + r * sstride + off;
        const __m256 mx = _mm256_set1_ps(vmaxs[r]);
        __m256 vsum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= L; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mx));
            vsum = _mm256_add_ps(vsum, e);
            _mm256_storeu_ps(sc + j, e);
        }
        sums[r] = hsum(vsum);
        for (; j < L; j++) { sc[j] = std::exp(sc[j] - vmaxs[r]); sums[r] += sc[j]; }
        for (int i = 0; i < HD; i++) accbuf[r][i] = 0.f;
    }
    // Weighted sum of V rows, a block (or the window's part of the first one) at a time.
    for (int64_t j0 = start; j0 < ctx;) {
        const int64_t in_block = j0 % block_size;
        const T* vb = value_cache + (table[j0 / block_size] * block_size + in_block) * token_stride + head_offset;
        const int64_t n = std::min(block_size - in_block, ctx - j0);
        if (j0 / block_size < last_block) {
            const int64_t nb = j0 / block_size + 1;
            prefetch_block(value_cache, block_slot(nb), std::min(block_size, ctx - nb * block_size), token_stride,
                           head_offset, row_elems);
        }
        for (int r = 0; r < NR;) {
            const int64_t nr = std::min(n, ctx0 + r / NH - j0);  // this row's keys in the block
            if (nr <= 0) { r++; continue; }
            const float* p = scores + r * sstride + (j0 - a);
            const T* vh = vb + int64_t((r % NH) / G) * HD;
#ifdef PAGEDLLM_AVX512
            if (paired(r)) {  // rows r and r + 1 (same KV head, r + 1 sees at least r's keys)
                const int64_t nr1 = std::min(n, ctx0 + (r + 1) / NH - j0);
                const float* p1 = scores + (r + 1) * sstride + (j0 - a);
                __m512 acc[DV];
                for (int c = 0; c < DV; c++) acc[c] = join(_mm256_load_ps(accbuf[r] + 8 * c), _mm256_load_ps(accbuf[r + 1] + 8 * c));
                int64_t jj = 0;
                for (; jj < nr; jj++) {
                    const __m512 pj = join(_mm256_set1_ps(p[jj]), _mm256_set1_ps(p1[jj]));
                    const T* vr = vh + jj * token_stride;
                    for (int c = 0; c < DV; c++) acc[c] = _mm512_fmadd_ps(pj, load8x2(vr + 8 * c), acc[c]);
                }
                for (; jj < nr1; jj++) {  // keys only row r + 1 sees: row r's lanes stay as they are
                    const __m512 pj = _mm512_set1_ps(p1[jj]);
                    const T* vr = vh + jj * token_stride;
                    for (int c = 0; c < DV; c++) acc[c] = _mm512_mask3_fmadd_ps(pj, load8x2(vr + 8 * c), acc[c], 0xFF00);
                }
                for (int c = 0; c < DV; c++) {
                    _mm256_store_ps(accbuf[r] + 8 * c, _mm512_castps512_ps256(acc[c]));
                    _mm256_store_ps(accbuf[r + 1] + 8 * c, _mm512_extractf32x8_ps(acc[c], 1));
                }
                r += 2;
                continue;
            }
            if (twin(r)) {  // rows r and r + 1 (same KV head): one V load for both
                const int64_t nr1 = std::min(n, ctx0 + (r + 1) / NH - j0);
                const float* p1 = scores + (r + 1) * sstride + (j0 - a);
                __m256 acc0[DV], acc1[DV];
                for (int c = 0; c < DV; c++) {
                    acc0[c] = _mm256_load_ps(accbuf[r] + 8 * c);
                    acc1[c] = _mm256_load_ps(accbuf[r + 1] + 8 * c);
                }
                int64_t jj = 0;
                for (; jj < nr; jj++) {
                    const __m256 pa = _mm256_set1_ps(p[jj]), pb = _mm256_set1_ps(p1[jj]);
                    const T* vr = vh + jj * token_stride;
                    for (int c = 0; c < DV; c++) {
                        const __m256 v = load8(vr + 8 * c);
                        acc0[c] = _mm256_fmadd_ps(pa, v, acc0[c]);
                        acc1[c] = _mm256_fmadd_ps(pb, v, acc1[c]);
                    }
                }
                for (; jj < nr1; jj++) {  // keys only row r + 1 sees
                    const __m256 pb = _mm256_set1_ps(p1[jj]);
                    const T* vr = vh + jj * token_stride;
                    for (int c = 0; c < DV; c++) acc1[c] = _mm256_fmadd_ps(pb, load8(vr + 8 * c), acc1[c]);
                }
                for (int c = 0; c < DV; c++) {
                    _mm256_store_ps(accbuf[r] + 8 * c, acc0[c]);
                    _mm256_store_ps(accbuf[r + 1] + 8 * c, acc1[c]);
                }
                r += 2;
                continue;
            }
#endif
            __m256 acc[DV];
            for (int c = 0; c < DV; c++) acc[c] = _mm256_load_ps(accbuf[r] + 8 * c);
            for (int64_t jj = 0; jj < nr; jj++) {
                const __m256 pj = _mm256_set1_ps(p[jj]);
                const T* vr = vh + jj * token_stride;
                for (int c = 0; c < DV; c++) acc[c] = _mm256_fmadd_ps(pj, load8(vr + 8 * c), acc[c]);
            }
            for (int c = 0; c < DV; c++) _mm256_store_ps(accbuf[r] + 8 * c, acc[c]);
            r++;
        }
        j0 += n;
    }
    for (int r = 0; r < NR; r++) {
        const __m256 inv = _mm256_set1_ps(1.f / sums[r]);
        float* o = out + (r / NH) * q_stride + (r % NH) * HD;
        for (int c = 0; c < DV; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_load_ps(accbuf[r] + 8 * c), inv));
    }
}

}  // namespace
#endif

namespace {

// Portable attention of one query head (any head_dim) over keys start..ctx-1: scores, softmax,
// weighted sum (scores[j - start] belongs to key j).
template <typename T>
void attend_one_generic(float* out, const float* q, const T* key_cache, const T* value_cache,
                        const int64_t* table, int64_t start, int64_t ctx, int64_t block_size, int64_t token_stride,
                        int64_t head_offset, int64_t head_dim, float scale, std::vector<float>& scores) {
    scores.resize(ctx - start);
    float m = -3.0e38f;
    for (int64_t j = start; j < ctx; j++) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        scores[j - start] = dot(q, key_cache + slot * token_stride + head_offset, int(head_dim)) * scale;
        m = std::max(m, scores[j - start]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < ctx - start; j++) { scores[j] = std::exp(scores[j] - m); sum += scores[j]; }
    std::fill(out, out + head_dim, 0.f);
    for (int64_t j = start; j < ctx; j++) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        axpy(out, scores[j - start] / sum, value_cache + slot * token_stride + head_offset, int(head_dim));
    }
}


// out/q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
// Sequence s owns tokens query_start_loc[s] .. query_start_loc[s+1]-1, which are the last
// positions of its seq_lens[s]-token context; token t at position p attends to positions 0..p,
// or with a sliding `window` > 0 to max(0, p - window + 1)..p (transformers' sliding mask).
// Table entries of blocks wholly before a sequence's first query's window are never read.
template <typename T>
void paged_attention(float* out, const float* q, const T* key_cache, const T* value_cache,
                     const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                     const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t window, float scale,
                     int nthreads) {
    const int64_t num_tokens = query_start_loc[num_seqs];
#ifdef PAGEDLLM_DEBUG
    for (int64_t s = 0; s < num_seqs; s++) {
        PAGEDLLM_CHECK(query_start_loc[s] <= query_start_loc[s + 1], "query_start_loc not increasing at %ld", long(s));
        const int64_t used = (seq_lens[s] + block_size - 1) / block_size;
        PAGEDLLM_CHECK(used <= block_table_stride, "seq %ld needs %ld blocks, table has %ld", long(s), long(used),
                       long(block_table_stride));
        const int64_t first_query = seq_lens[s] - (query_start_loc[s + 1] - query_start_loc[s]);
        const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_query - window + 1) : 0;
        for (int64_t j = first_key / block_size; j < used; j++) {
            const int64_t b = block_tables[s * block_table_stride + j];
            PAGEDLLM_CHECK(0 <= b && b < num_blocks, "seq %ld block %ld = %ld outside [0, %ld)", long(s), long(j),
                           long(b), long(num_blocks));
        }
    }
#else
    (void)num_blocks;
#endif
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots
    std::vector<int64_t> token_seq(num_tokens);
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) token_seq[t] = s;
    // Work items (built once per call):
    // - a token's query heads for a run of KV heads. Decode-sized steps with enough tokens to
    //   keep every thread busy take all KV heads of a token in one item (its K/V blocks are then
    //   read as contiguous runs); otherwise one KV head per item, so even one token spreads over
    //   the threads. A group wider than MAX_ITEM_HEADS is split into rounds.
    // - a prefill chunk (several tokens of one sequence, no window): tiles of NQ consecutive
    //   tokens for one KV head, so each K/V row read from L2 serves NQ tokens' G heads.
    struct Item {
        int64_t t, kv0, h0;  // first token, first KV head, first query head (of the first token)
        int nq, nkv, g;
    };
    const int64_t rounds = (group + MAX_ITEM_HEADS - 1) / MAX_ITEM_HEADS;
    const int64_t kv_per_item =
        rounds > 1 || num_tokens < 4 * int64_t(nthreads) ? 1 : std::min<int64_t>(num_kv_heads, MAX_ITEM_HEADS / group);
    const int tile_tokens = rounds > 1 || window > 0 ? 1 : int(MAX_ITEM_HEADS / group);
    std::vector<Item> items;
    items.reserve(num_tokens * num_kv_heads);
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t t0 = query_start_loc[s], t1 = query_start_loc[s + 1];
        if (t1 - t0 > 1 && tile_tokens > 1) {
            for (int64_t t = t0; t < t1; t += tile_tokens)
                for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
                    items.push_back({t, kvh, kvh * group, int(std::min<int64_t>(tile_tokens, t1 - t)), 1, int(group)});
            continue;
        }
        for (int64_t t = t0; t < t1; t++)
            for (int64_t kv0 = 0; kv0 < num_kv_heads; kv0 += kv_per_item) {
                const int nkv = int(std::min(kv_per_item, num_kv_heads - kv0));
                for (int64_t r = 0; r < rounds; r++) {
                    const int g = nkv > 1 ? int(group) : int(std::min<int64_t>(MAX_ITEM_HEADS, group - r * MAX_ITEM_HEADS));
                    items.push_back({t, kv0, kv0 * group + r * MAX_ITEM_HEADS, 1, nkv, g});
                }
            }
    }
    const int64_t work = int64_t(items.size());
    int64_t max_ctx = 0;
    for (int64_t s = 0; s < num_seqs; s++) max_ctx = std::max(max_ctx, seq_lens[s]);
    const int64_t sstride = (max_ctx + 15) / 8 * 8;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> scores(sstride * MAX_ITEM_HEADS);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; w++) {
            const Item& it = items[w];
            const int64_t t = it.t, s = token_seq[t];
            const int64_t ctx = seq_lens[s] - (query_start_loc[s + 1] - 1 - t);  // token t's keys: 0..ctx-1
            const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // ..or start..ctx-1
            const int64_t* table = block_tables + s * block_table_stride;
            const int64_t offset = it.kv0 * head_dim;
            const int64_t q_stride = num_heads * head_dim;
            const float* qh = q + t * q_stride + it.h0 * head_dim;
            float* oh = out + t * q_stride + it.h0 * head_dim;
            if (ctx <= 0) {  // nothing to attend to (a malformed step): zeros, never a division by 0
                for (int i = 0; i < it.nq; i++) std::fill(oh + i * q_stride, oh + i * q_stride + int64_t(it.nkv) * it.g * head_dim, 0.f);
                continue;
            }
#ifdef PAGEDLLM_AVX2
            if (head_dim == 64) {
                attend_heads<8>(oh, qh, q_stride, it.nq, it.nkv, it.g, key_cache, value_cache, table, start, ctx,
                                block_size, token_stride, offset, scale, scores.data(), sstride);
                continue;
            }
            if (head_dim == 128) {
                attend_heads<16>(oh, qh, q_stride, it.nq, it.nkv, it.g, key_cache, value_cache, table, start, ctx,
                                 block_size, token_stride, offset, scale, scores.data(), sstride);
                continue;
            }
#endif
            for (int i = 0; i < it.nq; i++)
                for (int k = 0; k < it.nkv; k++)
                    for (int j = 0; j < it.g; j++) {
                        const int64_t at = i * q_stride + (k * it.g + j) * head_dim;
                        attend_one_generic(oh + at, qh + at, key_cache, value_cache, table, start, ctx + i, block_size,
                                           token_stride, offset + k * head_dim, head_dim, scale, scores);
                    }
        }
    }
}

}  // namespace

void paged_attention_f32(float* out, const float* q, const float* key_cache, const float* value_cache,
                         const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                         const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t window, float scale,
                         int nthreads) {
    paged_attention(out, q, key_cache, value_cache, block_tables, block_table_stride, seq_lens, query_start_loc,
                    num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, window, scale, nthreads);
}

// The same over a bf16 cache; q and out stay fp32.
void paged_attention_bf16(float* out, const float* q, const bf16_t* key_cache, const bf16_t* value_cache,
                          const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                          const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t window, float scale,
                          int nthreads) {
    paged_attention(out, q, key_cache, value_cache, block_tables, block_table_stride, seq_lens, query_start_loc,
                    num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, window, scale, nthreads);
}

// The same over an fp16 cache (the float16 KV cache dtype; kv_ops.paged_attention_kv calls it):
// each row widens exactly in registers, so the result is fp32 attention over the stored values.
void paged_attention_kv_f16(float* out, const float* q, const uint16_t* key_cache, const uint16_t* value_cache,
                            const int64_t* block_tables, int64_t block_table_stride, const int64_t* seq_lens,
                            const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale, int64_t window,
                            int nthreads) {
    static_assert(sizeof(f16_t) == 2, "f16_t is the stored half");
    paged_attention(out, q, reinterpret_cast<const f16_t*>(key_cache), reinterpret_cast<const f16_t*>(value_cache),
                    block_tables, block_table_stride, seq_lens, query_start_loc, num_seqs, num_heads, num_kv_heads,
                    head_dim, block_size, num_blocks, window, scale, nthreads);
}

// ---------------------------------------------------------------------------------------------
// GGUF weight-only GEMM for steps of a few tokens. GGUF stores 32-weight blocks along K:
//   Q4_1: fp16 d, fp16 m, 16 bytes: weight i = d * nibble_i + m; byte j holds i=j (low) and i=j+16 (high)
//   Q8_0: fp16 d, 32 int8:          weight i = d * q_i
// At load time the blocks are regrouped (pagedllm/kernels/reference.py: group_blocks): output
// rows in groups of 16 and, per block index, the 16 rows' fp16 scales (and minima), then the
// 16 rows' quants of every k (Q4_1: in chunks of 4 k, one 32-bit word per row pair, below).
// The kernel vectorises over output columns and keeps k sequential: each y[m, n] is
// acc = fma(x[m, k], w[n, k], acc) for k = 0, 1, ..., K-1 from 0,
// exactly the dense GEMM's order below, and w = d * q + m is exact in its product (an fp16
// scale times a 4- or 8-bit integer fits fp32's mantissa), so it equals the fp32 copy's weight.
// Both kernels therefore give bit-identical rows, whatever the number of rows in the step:
// this is what makes a request's logits independent of what it is batched with.

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

// ---------------------------------------------------------------------------------------------
// Dense fp32 GEMM y = x @ W^T for steps of more than a few tokens. W is packed once at load
// (pagedllm/kernels/reference.py: pack_panels) into panels of 16 rows stored k-major,
// panel[p][k][j] = W[16p + j][k], so a micro-kernel streams one 16-wide row of the panel per k
// and keeps a 6 x 16 tile of y in 12 registers: 12 FMAs per 2 loads and 6 broadcasts (AVX-512:
// an 8 x 16 tile in 8 registers, 8 FMAs per load). x is cut into chunks of rows that stay in
// L2 while all panels pass over them.

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

// ---------------------------------------------------------------------------------------------
// Small fused element-wise ops. At one token per step each torch op costs more in dispatch than
// in arithmetic, so the layer's glue runs here as one call each. Rows run in parallel only
// when there are enough of them to pay for waking the team.

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
              const float* sin_table, int64_t max_positions, int64_t T, int64_t H, int64_t Hkv, int64_t D,
              int nthreads) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++)
        PAGEDLLM_CHECK(0 <= positions[t] && positions[t] < max_positions, "position %ld outside [0, %ld)",
                       long(positions[t]), long(max_positions));
    (void)max_positions;
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

namespace {
// One K or V row into the cache's element type: a copy, or rounding to nearest even as torch's
// .to() (so the twin, reference.write_kv, stores the same bytes).
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }
inline void store_row(f16_t* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) dst[i].bits = pagedllm_f32_to_f16(src[i]);
}
inline void store_row(bf16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = pagedllm_f32_to_bf16(src[i]);
}

// Each token's K and V rows ([T, Hkv*D], rows row_stride apart) into its cache slot. Prefill
// chunks write their rows on all threads: the first write to a pool page faults it in (the
// pool is committed on first touch), and faults taken in parallel cost half the wall time.
template <typename T>
void write_kv(const float* k, const float* v, int64_t row_stride, T* key_cache, T* value_cache,
              const int64_t* slot_mapping, int64_t num_slots, int64_t T_, int64_t width, int nthreads) {
    (void)num_slots;
#pragma omp parallel for num_threads(nthreads) if (T_ >= 64) schedule(static)
    for (int64_t t = 0; t < T_; t++) {
        PAGEDLLM_CHECK(0 <= slot_mapping[t] && slot_mapping[t] < num_slots, "slot %ld outside [0, %ld)",
                       long(slot_mapping[t]), long(num_slots));
        store_row(key_cache + slot_mapping[t] * width, k + t * row_stride, width);
        store_row(value_cache + slot_mapping[t] * width, v + t * row_stride, width);
    }
}
}  // namespace

void write_kv_f32(const float* k, const float* v, int64_t row_stride, float* key_cache, float* value_cache,
                  const int64_t* slot_mapping, int64_t num_slots, int64_t T, int64_t width, int nthreads) {
    write_kv(k, v, row_stride, key_cache, value_cache, slot_mapping, num_slots, T, width, nthreads);
}

void write_kv_f16(const float* k, const float* v, int64_t row_stride, uint16_t* key_cache, uint16_t* value_cache,
                  const int64_t* slot_mapping, int64_t num_slots, int64_t T, int64_t width, int nthreads) {
    static_assert(sizeof(f16_t) == 2, "f16_t is the stored half");
    write_kv(k, v, row_stride, reinterpret_cast<f16_t*>(key_cache), reinterpret_cast<f16_t*>(value_cache),
             slot_mapping, num_slots, T, width, nthreads);
}

void write_kv_bf16(const float* k, const float* v, int64_t row_stride, uint16_t* key_cache, uint16_t* value_cache,
                   const int64_t* slot_mapping, int64_t num_slots, int64_t T, int64_t width, int nthreads) {
    write_kv(k, v, row_stride, key_cache, value_cache, slot_mapping, num_slots, T, width, nthreads);
}

// logits[rows[r], t] = -inf where bit t % 32 of bitmask[r, t / 32] is clear (structured outputs).
// Grammar masks are mostly whole words: all-allowed words are skipped, all-banned ones filled.
void apply_token_bitmask_f32(float* logits, int64_t logits_stride, const int64_t* rows, int64_t num_rows,
                             const int32_t* bitmask, int64_t bitmask_stride, int64_t vocab, int nthreads) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for num_threads(nthreads) if (num_rows >= 8) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float* row = logits + rows[r] * logits_stride;
        const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + r * bitmask_stride);
        for (int64_t w = 0; w < words; w++) {
            const uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t n = std::min<int64_t>(32, vocab - base);
            if (bits == 0) {
                for (int64_t i = 0; i < n; i++) row[base + i] = neg_inf;
                continue;
            }
            for (int64_t i = 0; i < n; i++)
                if (!((bits >> i) & 1u)) row[base + i] = neg_inf;
        }
    }
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]
void silu_and_mul_f32(float* out, const float* gate_up, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T >= 8) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* g = gate_up + t * 2 * I;
        const float* u = g + I;
        float* o = out + t * I;
        int64_t i = 0;
#ifdef PAGEDLLM_AVX2
        // exp256 instead of std::exp, which the compiler does not vectorise without -ffast-math.
        const __m256 one = _mm256_set1_ps(1.f), cap = _mm256_set1_ps(88.f);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), cap));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
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

// ---------------------------------------------------------------------------------------------
// The whole decoder stack of a step, in one call. With a handful of tokens every layer is ten
// short kernels, and from Python each costs more to dispatch than to run; with many, the ~300
// dispatches of a step still cost milliseconds. This runs the same kernels, in the same order,
// on the same buffer layout, without leaving C++.
// Per layer l, `layer_ptrs[l * 8 + i]` holds: 0 input-norm weight, 1 post-attention-norm
// weight, 2 qkv weight, 3 o weight, 4 gate_up weight, 5 down weight, 6 key cache, 7 value
// cache; `layer_qtypes[l * 4 + j]` the form of linear j's weight (qkv, o, gate_up, down):
// 0 = Q4_1 group-blocks, 1 = Q8_0 group-blocks (small steps), 2 = fp32 panels (big steps),
// 3 / 4 / 5 = int8 panels of Q4_0 / Q4_1 / Q8_0 weights, multiplied on `act_bits`-bit integer
// activations (activation_dtype int8 / int16: int8_gemm.cpp, every step size).
// `kv_dtype`: the caches' element, 0 = fp32, 1 = fp16, 2 = bf16 (written and read by the
// kernels the attention backend calls for that cache).
// `residual` [T, hidden] holds the embeddings in and the residual stream out; `out` [T, hidden]
// gets the final norm's output. Returns 0; 1 (having done nothing) when a form or the KV dtype
// is unknown; 2 when the int8 GEMM refused a weight (a shape that is not whole blocks).
int decoder_stack_f32(float* out, float* residual, const int64_t* layer_ptrs, const int32_t* layer_qtypes,
                      int64_t num_layers, const float* final_norm, float eps, int64_t T, int64_t hidden,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                      const int64_t* positions, const float* cos_table, const float* sin_table, int64_t max_positions,
                      const int64_t* slot_mapping, const int64_t* block_tables, int64_t block_table_stride,
                      const int64_t* seq_lens, const int64_t* query_start_loc, int64_t num_seqs, int64_t block_size,
                      int64_t num_blocks, float scale, int32_t kv_dtype, int32_t act_bits, int nthreads) {
    for (int64_t i = 0; i < num_layers * 4; i++)
        if (layer_qtypes[i] < 0 || layer_qtypes[i] > 5) return 1;
    if (kv_dtype < 0 || kv_dtype > 2) return 1;
    const int64_t num_slots = num_blocks * block_size;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    // Every element is written before it is read: no zero-filling (tens of MB at 2,048 tokens).
    auto buffer = [](int64_t n) { return std::unique_ptr<float[]>(new float[n]); };
    auto x = buffer(T * hidden), qkv = buffer(T * qkv_size), q = buffer(T * q_size), attn = buffer(T * q_size);
    auto proj = buffer(T * hidden), gate_up = buffer(T * 2 * intermediate), act = buffer(T * intermediate);
    static constexpr int32_t INT8_GGML_TYPE[3] = {2, 3, 8};  // codes 3..5: GGML Q4_0, Q4_1, Q8_0
    int status = 0;
    auto gemm = [&](int32_t qtype, float* y, const float* in, const void* w, int64_t N, int64_t K) {
        const uint8_t* wb = static_cast<const uint8_t*>(w);
        if (qtype >= 3) {
            if (int8_gemm_f32(y, N, in, K, wb, INT8_GGML_TYPE[qtype - 3], T, N, K, act_bits, nthreads) != 0)
                status = 2;
        } else if (qtype == 2) {
            panel_gemm_f32(y, N, in, K, static_cast<const float*>(w), T, N, K, nthreads);
        } else if (qtype == 0) {
            grouped_gemm_q4_1(y, in, wb, T, N, K, nthreads);
        } else {
            grouped_gemm_q8_0(y, in, wb, T, N, K, nthreads);
        }
    };
    auto ptr = [&](int64_t l, int i) { return reinterpret_cast<void*>(layer_ptrs[l * 8 + i]); };
    auto write_kv = [&](int64_t l, const float* kp, const float* vp) {
        void *kc = ptr(l, 6), *vc = ptr(l, 7);
        if (kv_dtype == 0)
            write_kv_f32(kp, vp, qkv_size, static_cast<float*>(kc), static_cast<float*>(vc), slot_mapping, num_slots,
                         T, kv_size, nthreads);
        else
            (kv_dtype == 1 ? write_kv_f16 : write_kv_bf16)(kp, vp, qkv_size, static_cast<uint16_t*>(kc),
                                                           static_cast<uint16_t*>(vc), slot_mapping, num_slots, T,
                                                           kv_size, nthreads);
    };
    auto attention = [&](int64_t l) {
        const void *kc = ptr(l, 6), *vc = ptr(l, 7);
        if (kv_dtype == 0)
            paged_attention_f32(attn.get(), q.get(), static_cast<const float*>(kc), static_cast<const float*>(vc),
                                block_tables, block_table_stride, seq_lens, query_start_loc, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, num_blocks, /*window=*/0, scale, nthreads);
        else if (kv_dtype == 1)
            paged_attention_kv_f16(attn.get(), q.get(), static_cast<const uint16_t*>(kc),
                                   static_cast<const uint16_t*>(vc), block_tables, block_table_stride, seq_lens,
                                   query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                   num_blocks, scale, /*window=*/0, nthreads);
        else
            paged_attention_bf16(attn.get(), q.get(), static_cast<const uint16_t*>(kc),
                                 static_cast<const uint16_t*>(vc), block_tables, block_table_stride, seq_lens,
                                 query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                 num_blocks, /*window=*/0, scale, nthreads);
    };
    rms_norm_f32(x.get(), residual, hidden, nullptr, static_cast<const float*>(ptr(0, 0)), eps, T, hidden, nthreads);
    for (int64_t l = 0; l < num_layers && status == 0; l++) {
        const int32_t* qt = layer_qtypes + l * 4;
        gemm(qt[0], qkv.get(), x.get(), ptr(l, 2), qkv_size, hidden);
        float* kp = qkv.get() + q_size;
        float* vp = kp + kv_size;
        rope_f32(qkv.get(), qkv_size, kp, qkv_size, positions, cos_table, sin_table, max_positions, T, num_heads,
                 num_kv_heads, head_dim, nthreads);
        write_kv(l, kp, vp);
        for (int64_t t = 0; t < T; t++)  // the attention kernel takes contiguous q rows
            std::memcpy(q.get() + t * q_size, qkv.get() + t * qkv_size, sizeof(float) * q_size);
        attention(l);
        gemm(qt[1], proj.get(), attn.get(), ptr(l, 3), hidden, q_size);
        rms_norm_f32(x.get(), proj.get(), hidden, residual, static_cast<const float*>(ptr(l, 1)), eps, T, hidden,
                     nthreads);
        gemm(qt[2], gate_up.get(), x.get(), ptr(l, 4), 2 * intermediate, hidden);
        silu_and_mul_f32(act.get(), gate_up.get(), T, intermediate, nthreads);
        gemm(qt[3], proj.get(), act.get(), ptr(l, 5), hidden, intermediate);
        const float* next_norm = l + 1 < num_layers ? static_cast<const float*>(ptr(l + 1, 0)) : final_norm;
        rms_norm_f32(l + 1 < num_layers ? x.get() : out, proj.get(), hidden, residual, next_norm, eps, T, hidden,
                     nthreads);
    }
    return status;
}
