// The C API of the core kernels: paged attention, the two fp32 GEMMs, one layer's glue, the
// whole decoder stack, and the build's switches. Every symbol build.py loads from these files is
// declared here and only here: build.py reads the prototypes below to set the ctypes signatures,
// and every source file that defines one includes this header, so the compiler checks each
// definition against its prototype (a C-linkage function cannot be overloaded).
#pragma once

#include <cstdint>

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
