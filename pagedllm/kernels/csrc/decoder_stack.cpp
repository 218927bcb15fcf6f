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

#include "common.h"
#include "kernels.h"

// Defined in int8_gemm.cpp (its C API); the decoder stack calls it for int8-panel weights.
extern "C" int int8_gemm_f32(float* y, int64_t ldy, const float* x, int64_t ldx, const uint8_t* w, int32_t ggml_type,
                             int64_t M, int64_t N, int64_t K, int32_t act_bits, int nthreads);

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
