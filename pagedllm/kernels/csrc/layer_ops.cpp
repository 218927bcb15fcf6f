// A layer's glue between its GEMMs and its attention, as small fused ops: rms_norm_f32,
// rope_f32, write_kv_{f32,f16,bf16}, silu_and_mul_f32 (and the grammar masks'
// apply_token_bitmask_f32). At one token per step each torch op costs more in dispatch than in
// arithmetic, so the glue runs here as one call each. Rows run in parallel only when there are
// enough of them to pay for waking the team.

#include "common.h"
#include "kernels.h"

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
