// Paged attention (paged_attention_f32 / _bf16 / _kv_f16): causal attention for a flattened
// batch (decodes and prefill chunks) that reads K/V in place from the paged cache through the
// block tables - no gather copy; a sliding window skips the blocks before it. The bf16 and fp16
// variants read a 16-bit cache (half the bytes), widen it in registers and compute in fp32.
// The AVX-512 path (Intel only, g_wide_fma) runs two query rows per zmm with each lane doing
// its ymm lane's arithmetic, so it keeps the bits; on Zen 4, which runs a 512-bit op as two
// 256-bit halves, zmm scores/softmax/V sums measured no faster than the AVX2 loop, and the same
// row pairs go as two ymm rows side by side instead (`twin`: 32 ymm registers).

#include "common.h"
#include "kernels.h"

namespace {

constexpr int MAX_ITEM_HEADS = 16;  // query heads of one attention work item (more: split into items)

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
