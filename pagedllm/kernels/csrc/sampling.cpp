// Drawing a token from each row of logits: temperature, min-p, top-k, top-p and the inverse-CDF
// draw, in a few passes over the row and with no sort of the vocabulary; the penalties, touching
// only the tokens a row's history holds; and the argmax of greedy rows.
//
// Why native: the torch path (pagedllm/sampler/sampler.py, Sampler.probs + inverse_cdf, the
// reference the tests compare this with) runs ~10 full-vocabulary ops per row (softmax, a float64
// copy and cumulative sum, top-k for the nucleus, masks), each on cold caches right after the LM
// head has streamed 30 MB: ~0.2-0.5 ms a row. Here a row's 49,152 weights stay in L2.
//
// Per row, with w_i = exp((l_i - max) / T) (0 for masked tokens, -inf logits):
// - min-p keeps w_i >= min_p x max w (the max weight is the top token's);
// - top-k keeps w_i >= the k-th largest weight (ties with it stay, as the torch rule);
// - top-p keeps w_i >= the weight of the nucleus's last token: the most likely tokens whose mass
//   first reaches top_p of what min-p and top-k left. It is found by a histogram of the weights'
//   float bits (positive floats order as their bit patterns), so only the tokens of the one
//   bucket where the mass crosses top_p are sorted;
// - the draw: the first token whose cumulative weight (float64, in vocabulary order) exceeds
//   u x the total. Zero weights never advance the sum, so the token found has a positive weight.

#include "common.h"

// C-API-BEGIN
extern "C" {
void sample_rows_f32(int64_t* out, const float* logits, int64_t logits_stride, int64_t rows, int64_t vocab,
                     const float* temperature, const float* min_p, const int64_t* top_k, const float* top_p,
                     const double* u, int nthreads);
void verify_rows_f32(int64_t* out, const float* logits, int64_t logits_stride, int64_t vocab,
                     const int64_t* first_row, const int64_t* num_rows, int64_t num_requests, const int64_t* draft,
                     const float* temperature, const float* min_p, const int64_t* top_k, const float* top_p,
                     const double* u, int nthreads);
void apply_penalties_f32(float* logits, int64_t logits_stride, int64_t vocab, const int64_t* rows, int64_t num_rows,
                         const int64_t* output_ids, const int64_t* output_offsets, const int64_t* prompt_ids,
                         const int64_t* prompt_offsets, const float* presence, const float* frequency,
                         const float* repetition, int nthreads);
void argmax_rows_f32(int64_t* out, const float* x, int64_t stride, int64_t rows, int64_t n, int nthreads);
void logprobs_rows_f32(float* token_logprob, int64_t* token_rank, int64_t* top_ids, float* top_logprobs,
                       const float* logits, int64_t logits_stride, const int64_t* rows, int64_t num_rows,
                       int64_t vocab, const int64_t* token_ids, int64_t k, int nthreads);
}
// C-API-END

namespace {

constexpr int BUCKET_SHIFT = 20;  // 2^11 buckets: the 8 exponent bits and the top 3 mantissa bits
constexpr int NUM_BUCKETS = 1 << (31 - BUCKET_SHIFT);
constexpr float EXP_FLOOR = -87.3f;  // below this exp(x) is subnormal: taken as 0, as for -inf

inline uint32_t float_bits(float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

inline float row_max(const float* x, int64_t n) { return range_max(x, n, -std::numeric_limits<float>::infinity()); }

// w[j] = exp((x[j] - m) * inv_t), 0 where that is below EXP_FLOOR (masked tokens included).
inline void weights(float* w, const float* x, int64_t n, float m, float inv_t) {
    int64_t j = 0;
#ifdef PAGEDLLM_AVX2
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), floor = _mm256_set1_ps(EXP_FLOOR);
    for (; j + 8 <= n; j += 8) {
        const __m256 z = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vt);
        const __m256 keep = _mm256_cmp_ps(z, floor, _CMP_GE_OQ);  // false for -inf and NaN
        _mm256_storeu_ps(w + j, _mm256_and_ps(exp256(z), keep));
    }
#endif
    for (; j < n; j++) {
        const float z = (x[j] - m) * inv_t;
        w[j] = z >= EXP_FLOOR ? std::exp(z) : 0.f;
    }
}

// Zero every weight below `floor`.
inline void cut_below(float* w, int64_t n, float floor) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) w[j] = w[j] < floor ? 0.f : w[j];
}

// pool = the weights of w in bucket b.
void bucket_members(const float* w, int64_t n, int b, std::vector<float>& pool) {
    pool.clear();
    for (int64_t j = 0; j < n; j++)
        if (int(float_bits(w[j]) >> BUCKET_SHIFT) == b) pool.push_back(w[j]);
}

// The k-th largest of w (1 <= k <= n): count per bucket, then select inside the bucket reached.
float kth_largest(const float* w, int64_t n, int64_t k, std::vector<int64_t>& counts, std::vector<float>& pool) {
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t j = 0; j < n; j++) counts[float_bits(w[j]) >> BUCKET_SHIFT]++;
    int64_t above = 0;
    int b = NUM_BUCKETS - 1;
    for (; b > 0 && above + counts[b] < k; b--) above += counts[b];
    bucket_members(w, n, b, pool);
    const int64_t nth = k - above - 1;  // 0-based, descending, inside the bucket
    std::nth_element(pool.begin(), pool.begin() + nth, pool.end(), std::greater<float>());
    return pool[nth];
}

// The smallest weight top-p keeps: the weight of the token at which the descending cumulative
// mass first reaches top_p x the total; 0 (keep all) when rounding leaves the total short.
float nucleus_floor(const float* w, int64_t n, double top_p, std::vector<double>& mass, std::vector<float>& pool) {
    std::fill(mass.begin(), mass.end(), 0.0);
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) {
        mass[float_bits(w[j]) >> BUCKET_SHIFT] += w[j];
        total += w[j];
    }
    const double target = top_p * total;
    double acc = 0.0;
    int b = NUM_BUCKETS - 1;
    for (; b >= 0 && acc + mass[b] < target; b--) acc += mass[b];
    if (b < 0) return 0.f;
    bucket_members(w, n, b, pool);
    std::sort(pool.begin(), pool.end(), std::greater<float>());
    for (float x : pool) {
        acc += x;
        if (acc >= target) return x;
    }
    return pool.empty() ? 0.f : pool.back();  // rounding between the bucket sums and the tokens'
}

// The first token whose cumulative weight exceeds u x the total (the last positive one if
// rounding leaves every partial sum at or below it).
int64_t draw(const float* w, int64_t n, double u) {
    constexpr int64_t CHUNK = 512;
    double total = 0.0;
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    thread_local std::vector<double> sums;  // small: 96 chunks for 49,152 tokens
    sums.resize(chunks);
    for (int64_t c = 0; c < chunks; c++) {
        double s = 0.0;
        const int64_t end = std::min(n, (c + 1) * CHUNK);
#pragma omp simd reduction(+ : s)
        for (int64_t j = c * CHUNK; j < end; j++) s += w[j];
        sums[c] = s;
        total += s;
    }
    const double target = u * total;
    double acc = 0.0;
    int64_t last = -1;
    for (int64_t c = 0; c < chunks; c++) {
        if (acc + sums[c] <= target) {
            acc += sums[c];
            continue;
        }
        const int64_t end = std::min(n, (c + 1) * CHUNK);
        for (int64_t j = c * CHUNK; j < end; j++) {
            if (w[j] <= 0.f) continue;
            acc += w[j];
            last = j;
            if (acc > target) return j;
        }
    }
    if (last >= 0) return last;
    for (int64_t j = n - 1; j >= 0; j--)
        if (w[j] > 0.f) return j;
    return 0;
}

// A thread's buffers for filtering rows, kept across calls: a fresh 200 KB buffer would be new
// pages every step.
struct RowScratch {
    std::vector<float> w, pool;
    std::vector<int64_t> counts = std::vector<int64_t>(NUM_BUCKETS);
    std::vector<double> mass = std::vector<double>(NUM_BUCKETS);
};

RowScratch& row_scratch(int64_t vocab) {
    thread_local RowScratch s;
    if (int64_t(s.w.size()) < vocab) s.w.resize(vocab);
    return s;
}

// The weights of row x after temperature, min-p, top-k and top-p (into s.w); false when the row
// allows no token at all.
bool filtered_weights(RowScratch& s, const float* x, int64_t vocab, float temperature, float min_p, int64_t top_k,
                      float top_p) {
    float* w = s.w.data();
    const float m = row_max(x, vocab);
    if (!(m > -std::numeric_limits<float>::infinity())) return false;
    weights(w, x, vocab, m, 1.f / temperature);
    if (min_p > 0.f) cut_below(w, vocab, min_p * row_max(w, vocab));
    if (top_k > 0 && top_k < vocab) cut_below(w, vocab, kth_largest(w, vocab, top_k, s.counts, s.pool));
    if (top_p < 1.f) cut_below(w, vocab, nucleus_floor(w, vocab, top_p, s.mass, s.pool));
    return true;
}

}  // namespace

// One token per row of `logits` (rows x vocab, row stride `logits_stride`), every temperature
// > 0; min_p 0, top_k 0 and top_p 1 mean "off"; u[r] in [0, 1) is row r's uniform.
void sample_rows_f32(int64_t* out, const float* logits, int64_t logits_stride, int64_t rows, int64_t vocab,
                     const float* temperature, const float* min_p, const int64_t* top_k, const float* top_p,
                     const double* u, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 2) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        RowScratch& s = row_scratch(vocab);
        const float* x = logits + r * logits_stride;
        out[r] = filtered_weights(s, x, vocab, temperature[r], min_p[r], top_k[r], top_p[r])
                     ? draw(s.w.data(), vocab, u[r])
                     : 0;  // nothing allowed: never asked for
    }
}

// Speculative verification of sampled requests (the rule of pagedllm/spec_decode/rejection.py,
// whose torch code is the reference). Request i owns rows first_row[i] .. + num_rows[i] - 1 of
// `logits`; draft[r] is the token drafted at row r (every row but a request's last). Each row
// draws its token from its filtered distribution p_r with its own uniform u[r], as
// sample_rows_f32 does; the draft is accepted when the draw equals it (probability p_r(d); a
// rejection's draw is then distributed as p_r with d removed). out[r] is the token emitted at
// row r, -1 for the rows after the first rejection, which are never filtered at all.
void verify_rows_f32(int64_t* out, const float* logits, int64_t logits_stride, int64_t vocab,
                     const int64_t* first_row, const int64_t* num_rows, int64_t num_requests, const int64_t* draft,
                     const float* temperature, const float* min_p, const int64_t* top_k, const float* top_p,
                     const double* u, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (num_requests >= 2) schedule(dynamic)
    for (int64_t i = 0; i < num_requests; i++) {
        RowScratch& s = row_scratch(vocab);
        float* w = s.w.data();
        const int64_t first = first_row[i], last = first + num_rows[i] - 1;
        for (int64_t r = first; r <= last; r++) out[r] = -1;
        for (int64_t r = first; r <= last; r++) {
            const float* x = logits + r * logits_stride;
            if (!filtered_weights(s, x, vocab, temperature[r], min_p[r], top_k[r], top_p[r])) {
                out[r] = 0;  // nothing allowed: never asked for
                break;
            }
            out[r] = draw(w, vocab, u[r]);
            if (r == last) break;
            const int64_t d = draft[r];
            PAGEDLLM_CHECK(d >= 0 && d < vocab, "draft token %lld outside the vocabulary", (long long)d);
            if (out[r] != d) break;
        }
    }
}

// In place, on logits[rows[i]]: the repetition penalty (HF: x / r if x > 0 else x * r) on every
// token of the row's prompt or output, then frequency and presence (OpenAI: x - f * count - p)
// on every token of its output. The same float operations in the same order as the torch twin
// (sampler.apply_penalties, which computes them over the whole vocabulary, where an unseen
// token's result is its own value), so the results are bit for bit the same; but only the
// tokens of the history are touched. Row i's ids are [offsets[i], offsets[i + 1]).
void apply_penalties_f32(float* logits, int64_t logits_stride, int64_t vocab, const int64_t* rows, int64_t num_rows,
                         const int64_t* output_ids, const int64_t* output_offsets, const int64_t* prompt_ids,
                         const int64_t* prompt_offsets, const float* presence, const float* frequency,
                         const float* repetition, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (num_rows >= 4)
    {
        // Per token: its count in the output; -1 = seen in the prompt only.
        thread_local std::vector<int32_t> counts;
        if (int64_t(counts.size()) < vocab) counts.assign(vocab, 0);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_rows; i++) {
            float* x = logits + rows[i] * logits_stride;
            const int64_t* out = output_ids + output_offsets[i];
            const int64_t* prompt = prompt_ids + prompt_offsets[i];
            const int64_t n_out = output_offsets[i + 1] - output_offsets[i];
            const int64_t n_prompt = prompt_offsets[i + 1] - prompt_offsets[i];
            for (int64_t j = 0; j < n_out; j++) {
                PAGEDLLM_CHECK(out[j] >= 0 && out[j] < vocab, "output token %lld outside the vocabulary",
                               (long long)out[j]);
                counts[out[j]] = std::max(counts[out[j]], 0) + 1;
            }
            for (int64_t j = 0; j < n_prompt; j++) {
                PAGEDLLM_CHECK(prompt[j] >= 0 && prompt[j] < vocab, "prompt token %lld outside the vocabulary",
                               (long long)prompt[j]);
                if (counts[prompt[j]] == 0) counts[prompt[j]] = -1;
            }
            const float rep = repetition[i], freq = frequency[i], pres = presence[i];
            // Each seen token once: its count is reset (to 0) as it is done.
            auto penalize = [&](int64_t t) {
                const int32_t c = counts[t];
                if (c == 0) return;
                float v = x[t];
                if (rep != 1.f) v = v > 0.f ? v / rep : v * rep;
                if (c > 0) v = (v - freq * float(c)) - pres * 1.f;
                x[t] = v;
                counts[t] = 0;
            };
            for (int64_t j = 0; j < n_out; j++) penalize(out[j]);
            for (int64_t j = 0; j < n_prompt; j++) penalize(prompt[j]);
        }
    }
}

// out[r] = the index of the first maximum of row r (or of its first NaN: torch.argmax counts NaN
// as the maximum). torch's CPU argmax walks a row one element at a time (~42 us for 49,152
// logits here); this is a vector max, then a vector search for its first occurrence.
namespace {

// The first j in [0, n) with x[j] == target, or with x[j] a NaN when nan; -1 if none.
int64_t find_first(const float* x, int64_t n, float target, bool nan) {
    int64_t j = 0;
#ifdef PAGEDLLM_AVX2
    const __m256 t = _mm256_set1_ps(target);
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz(unsigned(hit));
    }
#endif
    for (; j < n; j++)
        if (nan ? x[j] != x[j] : x[j] == target) return j;
    return -1;
}

bool has_nan(const float* x, int64_t n) {
    int64_t j = 0;
#ifdef PAGEDLLM_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        acc = _mm256_or_ps(acc, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(acc)) return true;
#endif
    for (; j < n; j++)
        if (x[j] != x[j]) return true;
    return false;
}

}  // namespace

void argmax_rows_f32(int64_t* out, const float* x, int64_t stride, int64_t rows, int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 4) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * stride;
        const bool nan = has_nan(row, n);
        const int64_t j = find_first(row, n, nan ? 0.f : row_max(row, n), nan);
        out[r] = j < 0 ? 0 : j;
    }
}

// Log-probabilities of rows[i] of `logits`: lp_j = (x_j - max) - log(sum_j exp(x_j - max)), the
// torch formula (log_softmax), with the sum in float64. For each row: the log-probability of
// token_ids[i], its rank (1 + how many lp_j are greater) and the k largest lp_j, largest first
// (ties: the lower token id first), into top_ids / top_logprobs[i * k ..]. The torch code it
// replaces (sampler.gather_logprobs' fallback) ran log_softmax over the whole row, topk and a
// comparison: ~0.25 ms a row after the LM head; here three passes over the row while it is in L2.
namespace {

double exp_sum(const float* x, int64_t n, float m) {
    double total = 0.0;
    int64_t j = 0;
#ifdef PAGEDLLM_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    constexpr int64_t CHUNK = 512;  // float lanes for a chunk, then the chunk's sum in float64
    const int64_t vec_end = n - n % 8;
    for (; j < vec_end;) {
        __m256 acc = _mm256_setzero_ps();
        for (const int64_t end = std::min(vec_end, j + CHUNK); j < end; j += 8)
            acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
        total += double(hsum(acc));
    }
#endif
    for (; j < n; j++) total += std::exp(double(x[j] - m));
    return total;
}

}  // namespace

void logprobs_rows_f32(float* token_logprob, int64_t* token_rank, int64_t* top_ids, float* top_logprobs,
                       const float* logits, int64_t logits_stride, const int64_t* rows, int64_t num_rows,
                       int64_t vocab, const int64_t* token_ids, int64_t k, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (num_rows >= 2) schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        const float* x = logits + rows[i] * logits_stride;
        const float m = row_max(x, vocab);
        const float lse = float(std::log(exp_sum(x, vocab, m)));
        auto lp = [&](int64_t j) { return (x[j] - m) - lse; };
        const float chosen = lp(token_ids[i]);
        token_logprob[i] = chosen;
        // Rank and top-k in one pass: a vector compare finds the lanes above the current k-th
        // best (rarely any, once the list fills) and above the chosen token's log-probability.
        int64_t above = 0, filled = 0;
        int64_t* ids = top_ids + i * k;
        float* vals = top_logprobs + i * k;
        float kth = -std::numeric_limits<float>::infinity();  // admits every value until k are held
        auto offer = [&](int64_t j, float v) {
            if (filled == k && !(v > kth)) return;  // a tie with the k-th stays out: lower ids first
            int64_t at = filled < k ? filled++ : k - 1;
            while (at > 0 && vals[at - 1] < v) {  // after the equal ones: stable
                vals[at] = vals[at - 1];
                ids[at] = ids[at - 1];
                at--;
            }
            vals[at] = v;
            ids[at] = j;
            if (filled == k) kth = vals[k - 1];
        };
        int64_t j = 0;
#ifdef PAGEDLLM_AVX2
        const __m256 vm = _mm256_set1_ps(m), vl = _mm256_set1_ps(lse), vc = _mm256_set1_ps(chosen);
        for (; j + 8 <= vocab; j += 8) {
            const __m256 v = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vl);
            above += __builtin_popcount(unsigned(_mm256_movemask_ps(_mm256_cmp_ps(v, vc, _CMP_GT_OQ))));
            if (k == 0) continue;
            if (filled == k && !_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(kth), _CMP_GT_OQ))) continue;
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, v);
            for (int l = 0; l < 8; l++) offer(j + l, lanes[l]);  // offer re-checks against the moving k-th
        }
#endif
        for (; j < vocab; j++) {
            const float v = lp(j);
            above += v > chosen;
            if (k > 0) offer(j, v);
        }
        token_rank[i] = above + 1;
    }
}
