// Paged attention over reduced-precision KV caches (``--kv-cache-dtype``), and their write path.
//
// - paged_attention_kv_{i8,fp8}: the attention of paged_attention_f32 (paged_attention.cpp) for
//   caches stored as int8 or fp8 e4m3 (float8_e4m3fn), with one fp32 scale per written token and
//   KV head ([num_blocks, block_size, num_kv_heads]): value = scale * stored. q, out and all
//   arithmetic stay fp32. A sliding `window` (0 = none) lets a query at position p see keys
//   p - window + 1 .. p. (An fp16 cache needs no scale and widens in registers: paged_attention.cpp
//   runs it through the fp32 kernel, paged_attention_kv_f16.)
// - write_kv_{i8,fp8}: quantize this step's K/V rows (one scale per token and head: absmax/127,
//   or absmax/448 for e4m3) into their slots. No block is ever requantised as it fills.
//
// How the kernel reads: for one (query token, KV head) work item it walks the block table; each
// block's rows of that head are first dequantised (scale applied) into a small fp32 tile in L1,
// and the fp32 loops (8 keys per horizontal sum, G query heads sharing each tile) run on the
// tile. So each stored byte is read and converted once per work item whatever the group size,
// and the next block's rows are prefetched while this one is computed (the blocks of a
// sequence are scattered, so the hardware prefetchers cannot guess them).
//
// Every kernel has a torch twin in pagedllm/kernels/kv_ops.py; the tests compare them, also for
// a -march=x86-64 build (the portable paths below).

#include "common.h"

#include <type_traits>

// C-API-BEGIN
extern "C" {
void paged_attention_kv_i8(float* out, const float* q, const int8_t* key_cache, const int8_t* value_cache,
                           const float* key_scales, const float* value_scales, const int64_t* block_tables,
                           int64_t block_table_stride, const int64_t* seq_lens, const int64_t* query_start_loc,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t num_blocks, float scale, int64_t window, int nthreads);
void paged_attention_kv_fp8(float* out, const float* q, const uint8_t* key_cache, const uint8_t* value_cache,
                            const float* key_scales, const float* value_scales, const int64_t* block_tables,
                            int64_t block_table_stride, const int64_t* seq_lens, const int64_t* query_start_loc,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t num_blocks, float scale, int64_t window, int nthreads);
void write_kv_i8(const float* k, const float* v, int64_t row_stride, int8_t* key_cache, int8_t* value_cache,
                 float* key_scales, float* value_scales, const int64_t* slot_mapping, int64_t num_slots, int64_t T,
                 int64_t num_kv_heads, int64_t head_dim, int nthreads);
void write_kv_fp8(const float* k, const float* v, int64_t row_stride, uint8_t* key_cache, uint8_t* value_cache,
                  float* key_scales, float* value_scales, const int64_t* slot_mapping, int64_t num_slots, int64_t T,
                  int64_t num_kv_heads, int64_t head_dim, int nthreads);
}
// C-API-END

namespace {

constexpr int KVQ_MAX_GROUP = 8;  // query heads attended together (more are split into rounds)

// ---------------------------------------------------------------------------- element codecs
// fp8 e4m3 (float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN) -> fp32, all 256 codes.
struct E4M3Table {
    float v[256];
    E4M3Table() {
        for (int c = 0; c < 256; c++) {
            const int e = (c >> 3) & 0xF, m = c & 7;
            float x = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + float(m) / 8.f, e - 7);
            if ((c & 0x7F) == 0x7F) x = std::numeric_limits<float>::quiet_NaN();
            v[c] = (c & 0x80) ? -x : x;
        }
    }
};
const E4M3Table kE4M3;

// fp32 -> e4m3, round to nearest even; |x| <= 448 (the caller clamps), finite.
inline uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    const uint8_t sign = uint8_t((u >> 24) & 0x80);
    const float a = std::fabs(x);
    if (a < 0.015625f) {  // below the smallest normal 2^-6: multiples of 2^-9 (code 8 = 2^-6)
        return uint8_t(sign | uint8_t(std::nearbyint(a * 512.f)));
    }
    uint32_t exp = ((u >> 23) & 0xFF) - 127 + 7, mant = (u & 0x7FFFFF) >> 20;
    const uint32_t rem = u & 0xFFFFF;
    if (rem > 0x80000 || (rem == 0x80000 && (mant & 1))) mant++;
    if (mant == 8) { mant = 0; exp++; }
    return uint8_t(sign | (exp << 3) | mant);
}

inline float widen(int8_t x) { return float(x); }
inline float widen(uint8_t c) { return kE4M3.v[c]; }

// dst[0..D) = s * src[0..D): one cached row (one token, one head) in fp32. dst is 32-byte
// aligned (the tile is), so the stores are aligned: GCC splits unaligned 256-bit stores in two
// when tuning for AMD CPUs, and a row read back whole would then miss store forwarding (no
// measurable change at 64 x 320 here, but no cost either).
template <typename T>
inline void dequant_row(float* dst, const T* src, float s, int64_t D) {
    int64_t i = 0;
#if defined(PAGEDLLM_AVX2) && defined(__F16C__)
    const __m256 vs = _mm256_set1_ps(s);
    if (reinterpret_cast<uintptr_t>(dst) % 32 != 0) goto tail;
    if constexpr (std::is_same_v<T, int8_t>) {
        for (; i + 8 <= D; i += 8) {
            const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
            _mm256_store_ps(dst + i, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
        }
    } else {
        // e4m3 S.EEEE.MMM placed in fp16 bits as S.0EEEE.MMM0000000 is the same number times
        // 2^-8 (the biases are 15 and 7), subnormals included: the hardware converts it exactly
        // and 256 * s undoes the 2^-8. Sign-extending to 16 bits, shifting left by 7 and
        // clearing bit 14 builds that pattern. (NaN codes are never written.)
        const __m256 vs256 = _mm256_set1_ps(s * 256.f);
        const __m128i mask = _mm_set1_epi16(int16_t(0xBF80));
        for (; i + 8 <= D; i += 8) {
            const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
            const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), mask);
            _mm256_store_ps(dst + i, _mm256_mul_ps(vs256, _mm256_cvtph_ps(h)));
        }
    }
tail:
#endif
    for (; i < D; i++) dst[i] = s * widen(src[i]);
}


#ifdef PAGEDLLM_AVX2
// scores[j] = q . tile[j] for rows j in [lo, hi) of a tile (rows of DV*8 floats). Eight rows per
// horizontal sum; lanes outside [lo, hi) repeat a valid row and are not stored.
template <int DV>
inline void tile_scores(float* scores, const float* q, const float* tile, int64_t lo, int64_t hi) {
    for (int64_t j0 = lo; j0 < hi; j0 += 8) {
        const int n = int(std::min<int64_t>(8, hi - j0));
        const float* row[8];
        for (int j = 0; j < 8; j++) row[j] = tile + (j0 + std::min(j, n - 1)) * DV * 8;
        __m256 dots[8];
        const __m256 q0 = _mm256_loadu_ps(q);
        for (int j = 0; j < 8; j++) dots[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(row[j]));
        for (int c = 1; c < DV; c++) {
            const __m256 qc = _mm256_loadu_ps(q + 8 * c);
            for (int j = 0; j < 8; j++) dots[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(row[j] + 8 * c), dots[j]);
        }
        const __m256 sv = hsum8(dots);
        if (n == 8) {
            _mm256_storeu_ps(scores + j0, sv);
        } else {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, sv);
            for (int j = 0; j < n; j++) scores[j0 + j] = lanes[j];
        }
    }
}

// acc (DV*8 floats) += sum over rows j in [lo, hi) of p[j] * tile[j].
template <int DV>
inline void tile_weighted_sum(float* acc, const float* p, const float* tile, int64_t lo, int64_t hi) {
    __m256 a[DV];
    for (int c = 0; c < DV; c++) a[c] = _mm256_loadu_ps(acc + 8 * c);
    for (int64_t j = lo; j < hi; j++) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float* r = tile + j * DV * 8;
        for (int c = 0; c < DV; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(r + 8 * c), a[c]);
    }
    for (int c = 0; c < DV; c++) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
// int8 keys: scores from integer dot products. The query head is quantised like a cached row
// (int8, scale absmax / 127), so q . k is an exact int32 sum and the score is that sum times
// the two scales: no key is ever widened to fp32. Eight keys at a time (rows[j]; lanes past
// the valid ones repeat a valid row), 32 bytes per step: |q| (unsigned) times k with q's sign
// (vpsignb), summed in pairs to int16 (|q k| <= 127 * 127, two fit), then to int32.
template <int NC>  // head_dim / 32
inline __m256 scores8_i8(const int8_t* const rows[8], const int8_t* q8, const __m256 scale8) {
    __m256i aq[NC], sq[NC];
    for (int c = 0; c < NC; c++) {
        sq[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 32 * c));
        aq[c] = _mm256_abs_epi8(sq[c]);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[8];
    for (int j = 0; j < 8; j++) {
        __m256i a = _mm256_setzero_si256();
        for (int c = 0; c < NC; c++) {
            const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + 32 * c));
            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(aq[c], _mm256_sign_epi8(k, sq[c])), ones));
        }
        acc[j] = a;
    }
    const __m256i a01 = _mm256_hadd_epi32(acc[0], acc[1]), a23 = _mm256_hadd_epi32(acc[2], acc[3]);
    const __m256i a45 = _mm256_hadd_epi32(acc[4], acc[5]), a67 = _mm256_hadd_epi32(acc[6], acc[7]);
    const __m256i ab = _mm256_hadd_epi32(a01, a23), cd = _mm256_hadd_epi32(a45, a67);
    const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale8);
}

// int8 values: acc[g] (G heads, DV*8 floats each, D floats apart) += sum over the n rows of
// pw[g * n + j] * rows[j], where pw already holds p * the row's scale. The int8 row is widened
// in registers and meets every head there: no fp32 tile is written and read back. Chunks of 8
// outer, rows inner, so each head's accumulator stays in one register.
template <int DV, int G>
inline void weighted_sum_i8(float* acc, const float* pw, const int8_t* const* rows, int n) {
    constexpr int CH = G <= 3 ? 4 : G <= 6 ? 2 : 1;  // chunks of 8 per pass: G * CH accumulators
    for (int c0 = 0; c0 < DV; c0 += CH) {
        __m256 a[G][CH];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) a[g][c] = _mm256_loadu_ps(acc + g * DV * 8 + 8 * (c0 + c));
        for (int j = 0; j < n; j++) {
            __m256 v[CH];
            for (int c = 0; c < CH; c++)
                v[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[j] + 8 * (c0 + c)))));
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_broadcast_ss(pw + g * n + j);
                for (int c = 0; c < CH; c++) a[g][c] = _mm256_fmadd_ps(p, v[c], a[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) _mm256_storeu_ps(acc + g * DV * 8 + 8 * (c0 + c), a[g][c]);
    }
}

// The group size as a compile-time constant, so the accumulators stay in registers.
template <int DV>
inline void weighted_sum_i8(float* acc, int G, const float* pw, const int8_t* const* rows, int n) {
    switch (G) {
        case 1: return weighted_sum_i8<DV, 1>(acc, pw, rows, n);
        case 2: return weighted_sum_i8<DV, 2>(acc, pw, rows, n);
        case 3: return weighted_sum_i8<DV, 3>(acc, pw, rows, n);
        case 4: return weighted_sum_i8<DV, 4>(acc, pw, rows, n);
        case 5: return weighted_sum_i8<DV, 5>(acc, pw, rows, n);
        case 6: return weighted_sum_i8<DV, 6>(acc, pw, rows, n);
        case 7: return weighted_sum_i8<DV, 7>(acc, pw, rows, n);
        default: return weighted_sum_i8<DV, 8>(acc, pw, rows, n);
    }
}
#endif

// The portable twin of scores8_i8 for one key: the same exact integer sum, the same scaling.
inline float score_i8(const int8_t* k, const int8_t* q8, float qk_scale, int64_t D) {
    int32_t s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < D; i++) s += int32_t(q8[i]) * int32_t(k[i]);
    return float(s) * qk_scale;
}

// Portable versions of the three tile loops (any head_dim).
inline void tile_scores_generic(float* scores, const float* q, const float* tile, int64_t lo, int64_t hi, int64_t D) {
    for (int64_t j = lo; j < hi; j++) {
        const float* r = tile + j * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < D; i++) s += q[i] * r[i];
        scores[j] = s;
    }
}

inline void tile_weighted_sum_generic(float* acc, const float* p, const float* tile, int64_t lo, int64_t hi, int64_t D) {
    for (int64_t j = lo; j < hi; j++) {
        const float* r = tile + j * D;
        const float pj = p[j];
#pragma omp simd
        for (int64_t i = 0; i < D; i++) acc[i] += pj * r[i];
    }
}

// exp(x - m) in place over [0, n); returns the sum.
inline float softmax_exp(float* x, int64_t n, float m) {
    int64_t j = 0;
    float sum = 0.f;
#ifdef PAGEDLLM_AVX2
    const __m256 mx = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), mx));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(x + j, e);
    }
    sum = hsum(vsum);
#endif
    for (; j < n; j++) { x[j] = std::exp(x[j] - m); sum += x[j]; }
    return sum;
}

// Per-thread buffers: the dequantised tile, the scores of each head, the accumulators.
struct Scratch {
    std::vector<float> tile, scores, acc, qs;
    std::vector<int8_t> q8;  // int8 keys: the query heads quantised
    std::vector<float> pw;   // int8 values: p times each row's scale, per head
    float q8_scale[KVQ_MAX_GROUP];
};

// Attention of G query heads sharing one KV head, for one query token whose visible keys are
// positions [lo, ctx). Scores are kept per head for positions [base, ctx), base = the first
// visible block's start, so they are indexed by (position - base).
template <typename T>
void attend_group_kv(float* out, const float* q, int G, const T* key_cache, const T* value_cache,
                     const float* key_scales, const float* value_scales, const int64_t* table, int64_t lo, int64_t ctx,
                     int64_t block_size, int64_t num_kv_heads, int64_t kvh, int64_t D, float scale, Scratch& buf,
                     int64_t prefetch_heads) {
    // Where row r (this head's) of physical block `blk` and its scale live. (A head-major block
    // layout, each head's rows contiguous, measured no faster: 4.86 vs 4.98 ms at 64 x 320.)
    const int64_t row_stride = num_kv_heads * D;  // [num_blocks, block_size, num_kv_heads, D]
    auto row_index = [&](int64_t blk, int64_t r) { return (blk * block_size + r) * num_kv_heads + kvh; };
    auto row_of = [&](const T* cache, int64_t blk, int64_t r) { return cache + row_index(blk, r) * D; };
    const int64_t b_lo = lo / block_size, b_hi = (ctx + block_size - 1) / block_size;
    const int64_t base = b_lo * block_size, span = ctx - base;
    const int64_t sstride = (span + 15) / 8 * 8;
    buf.tile.resize(block_size * D + 8);
    buf.scores.resize(sstride * G);
    buf.acc.assign(G * D, 0.f);
    buf.qs.resize(G * D);
    buf.pw.resize(KVQ_MAX_GROUP * 64);
    for (int g = 0; g < G; g++)
        for (int64_t i = 0; i < D; i++) buf.qs[g * D + i] = q[g * D + i] * scale;
    float* tile = buf.tile.data();  // 32-byte aligned: see dequant_row
    tile += (32 - reinterpret_cast<uintptr_t>(tile) % 32) % 32 / sizeof(float);
    const int64_t row_bytes = D * int64_t(sizeof(T));
    auto rows_of = [&](const T* cache, const float* scales, int64_t b, int64_t r0, int64_t r1) {
        // Dequantise rows r0..r1-1 of block b (this head) into tile rows r0..r1-1.
        const int64_t blk = table[b];
        for (int64_t r = r0; r < r1; r++) {
            const float s = scales != nullptr ? scales[row_index(blk, r)] : 1.f;
            dequant_row(tile + r * D, row_of(cache, blk, r), s, D);
        }
    };
    // Part i of `parts` of a block's rows of this head (and of the next prefetch_heads - 1,
    // adjacent in each slot: the item's first head fetches them for the others into L2), and
    // with part 0 the block's scales (all heads'). The whole block: part 0 of 1.
    auto prefetch_part = [&](const T* cache, const float* scales, int64_t b, int64_t i = 0, int64_t parts = 1) {
        if (b >= b_hi) return;
        const int64_t lo_row = block_size * i / parts, hi_row = block_size * (i + 1) / parts;
        prefetch_rows<PREFETCH_L1>(row_of(cache, table[b], lo_row), hi_row - lo_row, row_stride * int64_t(sizeof(T)),
                                   row_bytes * prefetch_heads);
        if (scales != nullptr && i == 0)
            prefetch_rows<PREFETCH_L1>(scales + row_index(table[b], 0), 1, 0, block_size * num_kv_heads * int64_t(sizeof(float)));
    };
    // Pass 1: scores, block by block.
    float vmax[KVQ_MAX_GROUP];
    std::fill(vmax, vmax + G, -3.0e38f);
    constexpr bool int8_cache = std::is_same_v<T, int8_t>;
    if constexpr (int8_cache) {  // quantise each head's (scaled) query as a cached row is
        buf.q8.resize(G * D);
        for (int g = 0; g < G; g++) {
            const float* x = buf.qs.data() + g * D;
            const float s = absmax_keep_nan(x, D) / 127.f;  // NaN or inf: zeros, and every score is not finite
            buf.q8_scale[g] = s;
            for (int64_t i = 0; i < D; i++)
                buf.q8[g * D + i] = s > 0.f && std::isfinite(s) ? int8_t(std::nearbyint(std::min(127.f, std::max(-127.f, x[i] / s)))) : 0;
        }
    }
    // Memory latency, not arithmetic, bounds this loop (the blocks are scattered, so hardware
    // prefetchers cannot follow): the next block's K rows are requested while this one's are
    // used, and each block's V rows too, so pass 2 finds them in L2 (a sequence's V rows of one
    // head are 20 KiB at 320 int8 tokens). A few rows at a time as the block's keys are scored
    // (prefetch_share), not all at once: as in attend_heads (paged_attention.cpp), bursts left
    // DRAM idle between them.
    auto prefetch_share = [&](int64_t b, int64_t i, int64_t parts) {  // part i of `parts`: K of b + 1, V of b
        prefetch_part(key_cache, key_scales, b + 1, i, parts);
        prefetch_part(value_cache, value_scales, b, i, parts);
    };
    prefetch_part(key_cache, key_scales, b_lo);
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t r0 = std::max<int64_t>(lo - b * block_size, 0), r1 = std::min(block_size, ctx - b * block_size);
        if constexpr (int8_cache) {
            const int64_t blk = table[b];
            const int64_t parts = G * ((block_size + 7) / 8);  // one share per (head, 8 keys)
            int64_t part = 0;
            for (int g = 0; g < G; g++) {
                float* sc = buf.scores.data() + g * sstride + (b * block_size - base);
                const int8_t* qg = buf.q8.data() + g * D;
                const float qs = buf.q8_scale[g];
                int64_t r = r0;
#ifdef PAGEDLLM_AVX2
                if (D == 64 || D == 128) {
                    for (; r < r1; r += 8) {
                        if (part < parts) prefetch_share(b, part++, parts);
                        const int n = int(std::min<int64_t>(8, r1 - r));
                        const int8_t* rows[8];
                        alignas(32) float ks[8];
                        for (int j = 0; j < 8; j++) {
                            const int64_t rj = r + std::min(j, n - 1);
                            rows[j] = row_of(key_cache, blk, rj);
                            ks[j] = key_scales[row_index(blk, rj)] * qs;
                        }
                        const __m256 ks8 = _mm256_load_ps(ks);
                        const __m256 sv = D == 64 ? scores8_i8<2>(rows, qg, ks8) : scores8_i8<4>(rows, qg, ks8);
                        alignas(32) float lanes[8];
                        _mm256_store_ps(lanes, sv);
                        for (int j = 0; j < n; j++) sc[r + j] = lanes[j];
                    }
                }
#endif
                for (; r < r1; r++) {
                    sc[r] = score_i8(row_of(key_cache, blk, r), qg, key_scales[row_index(blk, r)] * qs, D);
                }
                vmax[g] = range_max(sc + r0, r1 - r0, vmax[g]);
            }
            while (part < parts) prefetch_share(b, part++, parts);  // what the loops did not ask for
            continue;
        }
        for (int64_t r = r0; r < r1; r++) {  // one share per row dequantised
            prefetch_share(b, r - r0, r1 - r0);
            rows_of(key_cache, key_scales, b, r, r + 1);
        }
        for (int g = 0; g < G; g++) {
            float* sc = buf.scores.data() + g * sstride + (b * block_size - base);
            const float* qg = buf.qs.data() + g * D;
#ifdef PAGEDLLM_AVX2
            if (D == 64) tile_scores<8>(sc, qg, tile, r0, r1);
            else if (D == 128) tile_scores<16>(sc, qg, tile, r0, r1);
            else tile_scores_generic(sc, qg, tile, r0, r1, D);
#else
            tile_scores_generic(sc, qg, tile, r0, r1, D);
#endif
            vmax[g] = range_max(sc + r0, r1 - r0, vmax[g]);
        }
    }
    // Softmax over the visible positions only.
    float inv[KVQ_MAX_GROUP];
    for (int g = 0; g < G; g++) inv[g] = 1.f / softmax_exp(buf.scores.data() + g * sstride + (lo - base), ctx - lo, vmax[g]);
    // Pass 2: weighted sum of V rows, block by block, every head on the same tile. The V rows
    // prefetched in pass 1 may have left L1 since: the next block's are requested again.
    prefetch_part(value_cache, value_scales, b_lo + 1);
    for (int64_t b = b_lo; b < b_hi; b++) {
        prefetch_part(value_cache, value_scales, b + 2);
        const int64_t r0 = std::max<int64_t>(lo - b * block_size, 0), r1 = std::min(block_size, ctx - b * block_size);
#ifdef PAGEDLLM_AVX2
        if constexpr (int8_cache) {
            if (D == 64 || D == 128) {  // int8 rows widened in registers, scales folded into p
                const int64_t blk = table[b];
                const int8_t* rows[64];
                for (int64_t r0c = r0; r0c < r1; r0c += 64) {  // at most 64 rows per call
                    const int nc = int(std::min<int64_t>(64, r1 - r0c));
                    float* pw = buf.pw.data();
                    for (int j = 0; j < nc; j++) {
                        rows[j] = row_of(value_cache, blk, r0c + j);
                        const float s = value_scales[row_index(blk, r0c + j)];
                        for (int g = 0; g < G; g++) pw[g * nc + j] = buf.scores[g * sstride + (b * block_size - base) + r0c + j] * s;
                    }
                    if (D == 64) weighted_sum_i8<8>(buf.acc.data(), G, pw, rows, nc);
                    else weighted_sum_i8<16>(buf.acc.data(), G, pw, rows, nc);
                }
                continue;
            }
        }
#endif
        rows_of(value_cache, value_scales, b, r0, r1);
        for (int g = 0; g < G; g++) {
            const float* p = buf.scores.data() + g * sstride + (b * block_size - base);
            float* acc = buf.acc.data() + g * D;
#ifdef PAGEDLLM_AVX2
            if (D == 64) tile_weighted_sum<8>(acc, p, tile, r0, r1);
            else if (D == 128) tile_weighted_sum<16>(acc, p, tile, r0, r1);
            else tile_weighted_sum_generic(acc, p, tile, r0, r1, D);
#else
            tile_weighted_sum_generic(acc, p, tile, r0, r1, D);
#endif
        }
    }
    for (int g = 0; g < G; g++)
        for (int64_t i = 0; i < D; i++) out[g * D + i] = buf.acc[g * D + i] * inv[g];
}

// out/q: [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads,
// head_dim]; scales [num_blocks, block_size, num_kv_heads] or null (fp16). Sequence s owns
// tokens query_start_loc[s] .. query_start_loc[s+1]-1, the last positions of its
// seq_lens[s]-token context; a token at position p sees keys max(0, p - window + 1) .. p.
template <typename T>
void paged_attention_kv(float* out, const float* q, const T* key_cache, const T* value_cache, const float* key_scales,
                        const float* value_scales, const int64_t* block_tables, int64_t block_table_stride,
                        const int64_t* seq_lens, const int64_t* query_start_loc, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, float scale,
                        int64_t window, int nthreads) {
    const int64_t num_tokens = query_start_loc[num_seqs];
#ifdef PAGEDLLM_DEBUG
    for (int64_t s = 0; s < num_seqs; s++) {
        PAGEDLLM_CHECK(query_start_loc[s] <= query_start_loc[s + 1], "query_start_loc not increasing at %ld", long(s));
        const int64_t used = (seq_lens[s] + block_size - 1) / block_size;
        PAGEDLLM_CHECK(used <= block_table_stride, "seq %ld needs %ld blocks, table has %ld", long(s), long(used),
                       long(block_table_stride));
        for (int64_t j = 0; j < used; j++) {
            const int64_t b = block_tables[s * block_table_stride + j];
            PAGEDLLM_CHECK(0 <= b && b < num_blocks, "seq %ld block %ld = %ld outside [0, %ld)", long(s), long(j),
                           long(b), long(num_blocks));
        }
    }
#else
    (void)num_blocks;
#endif
    const int64_t group = num_heads / num_kv_heads;
    std::vector<int64_t> token_seq(num_tokens);
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) token_seq[t] = s;
    // Work items: (token, KV head), or every KV head of a token once the step has enough tokens
    // to keep the threads busy: its first head then prefetches the whole slot rows (all heads'
    // rows of a slot are adjacent), so the blocks stream as contiguous runs and the other heads
    // find their rows in L2. Each head's arithmetic is the same either way.
    const int64_t kv_per_item = num_tokens >= 4 * int64_t(nthreads) ? num_kv_heads : 1;
    const int64_t work = num_tokens * (num_kv_heads / kv_per_item);
#pragma omp parallel num_threads(nthreads)
    {
        Scratch buf;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; w++) {
            const int64_t t = w * kv_per_item / num_kv_heads, kv_first = (w * kv_per_item) % num_kv_heads;
            const int64_t s = token_seq[t];
            const int64_t ctx = seq_lens[s] - (query_start_loc[s + 1] - 1 - t);  // keys 0..ctx-1
            const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
            const int64_t* table = block_tables + s * block_table_stride;
            for (int64_t kvh = kv_first; kvh < kv_first + kv_per_item; kvh++) {
                float* o = out + (t * num_heads + kvh * group) * head_dim;
                if (ctx <= 0) {  // nothing to attend to (a malformed step): zeros, never a division by 0
                    std::fill(o, o + group * head_dim, 0.f);
                    continue;
                }
                for (int64_t h0 = 0; h0 < group; h0 += KVQ_MAX_GROUP) {
                    const int g = int(std::min<int64_t>(KVQ_MAX_GROUP, group - h0));
                    attend_group_kv(o + h0 * head_dim, q + (t * num_heads + kvh * group + h0) * head_dim, g, key_cache,
                                    value_cache, key_scales, value_scales, table, lo, ctx, block_size, num_kv_heads, kvh,
                                    head_dim, scale, buf, kvh == kv_first ? kv_per_item : 1);
                }
            }
        }
    }
}

// Quantise each token's K and V rows ([T, Hkv * D], rows row_stride floats apart) into their
// slots: per (token, head) s = absmax / qmax, stored = encode(x / s) (0 and s = 0 for a zero row).
template <typename T, typename Encode>
void write_kv_quant(const float* k, const float* v, int64_t row_stride, T* key_cache, T* value_cache, float* key_scales,
                    float* value_scales, const int64_t* slot_mapping, int64_t num_slots, int64_t T_, int64_t Hkv,
                    int64_t D, float qmax, Encode encode, int nthreads) {
    (void)num_slots;
    for (int64_t t = 0; t < T_; t++)
        PAGEDLLM_CHECK(0 <= slot_mapping[t] && slot_mapping[t] < num_slots, "slot %ld outside [0, %ld)",
                       long(slot_mapping[t]), long(num_slots));
#pragma omp parallel for num_threads(nthreads) if (T_ * Hkv >= 512) schedule(static)
    for (int64_t w = 0; w < T_ * Hkv * 2; w++) {
        const int64_t t = w / (Hkv * 2), h = (w / 2) % Hkv;
        const bool is_v = w % 2;
        const float* x = (is_v ? v : k) + t * row_stride + h * D;
        const int64_t slot = slot_mapping[t];
        T* dst = (is_v ? value_cache : key_cache) + (slot * Hkv + h) * D;
        // A row holding a NaN or an inf stores zeros under a NaN / inf scale: it reads back not finite.
        const float s = absmax_keep_nan(x, D) / qmax;
        (is_v ? value_scales : key_scales)[slot * Hkv + h] = s;
        const bool scaled = s > 0.f && std::isfinite(s);
        for (int64_t i = 0; i < D; i++) dst[i] = scaled ? encode(x[i] / s) : encode(0.f);
    }
}

}  // namespace

void paged_attention_kv_i8(float* out, const float* q, const int8_t* key_cache, const int8_t* value_cache,
                           const float* key_scales, const float* value_scales, const int64_t* block_tables,
                           int64_t block_table_stride, const int64_t* seq_lens, const int64_t* query_start_loc,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t num_blocks, float scale, int64_t window, int nthreads) {
    paged_attention_kv(out, q, key_cache, value_cache, key_scales, value_scales, block_tables, block_table_stride,
                       seq_lens, query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                       scale, window, nthreads);
}

void paged_attention_kv_fp8(float* out, const float* q, const uint8_t* key_cache, const uint8_t* value_cache,
                            const float* key_scales, const float* value_scales, const int64_t* block_tables,
                            int64_t block_table_stride, const int64_t* seq_lens, const int64_t* query_start_loc,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t num_blocks, float scale, int64_t window, int nthreads) {
    paged_attention_kv(out, q, key_cache, value_cache, key_scales, value_scales, block_tables, block_table_stride,
                       seq_lens, query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                       scale, window, nthreads);
}

void write_kv_i8(const float* k, const float* v, int64_t row_stride, int8_t* key_cache, int8_t* value_cache,
                 float* key_scales, float* value_scales, const int64_t* slot_mapping, int64_t num_slots, int64_t T,
                 int64_t num_kv_heads, int64_t head_dim, int nthreads) {
    // x / s lies in [-127, 127] by construction; rounding is to nearest even, as torch.round.
    auto encode = [](float y) { return int8_t(std::nearbyint(std::min(127.f, std::max(-127.f, y)))); };
    write_kv_quant(k, v, row_stride, key_cache, value_cache, key_scales, value_scales, slot_mapping, num_slots, T,
                   num_kv_heads, head_dim, 127.f, encode, nthreads);
}

void write_kv_fp8(const float* k, const float* v, int64_t row_stride, uint8_t* key_cache, uint8_t* value_cache,
                  float* key_scales, float* value_scales, const int64_t* slot_mapping, int64_t num_slots, int64_t T,
                  int64_t num_kv_heads, int64_t head_dim, int nthreads) {
    auto encode = [](float y) { return f32_to_e4m3(std::min(448.f, std::max(-448.f, y))); };
    write_kv_quant(k, v, row_stride, key_cache, value_cache, key_scales, value_scales, slot_mapping, num_slots, T,
                   num_kv_heads, head_dim, 448.f, encode, nthreads);
}
