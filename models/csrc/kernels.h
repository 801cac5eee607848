// The interface between the host library (host/: the ops' C API and the decoder stack) and one
// kernel set (avx512/, avx2/, neon/). Both are shared libraries of plain C++ (no torch headers, so
// they compile in seconds, cross-compile, and a set runs in a test driver without torch);
// models/cpu_ops.py checks shapes and dtypes and allocates, and the host calls the set's kernels
// on raw pointers.
//
// Conventions for every kernel:
//  * bf16 is passed as uint16_t (its bits); arithmetic is fp32; results are rounded to bf16
//    with round-to-nearest-even (as PyTorch does).
//  * rows are `ld` elements apart; a row's elements are contiguous.
//  * work is split over the host's threads with kvserve::parallel_for (kernel_common.h).
//  * no kernel allocates per call on the hot path beyond thread-local scratch, none throws,
//    none checks its arguments (models/cpu_ops.py did).
#pragma once

#include <cstdint>

namespace kvserve {

// What the host gives a kernel set: its thread pool (torch's in the host library, a serial loop in
// the C++ test driver).
struct Host {
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, void (*body)(void* ctx, int64_t b, int64_t e),
                       void* ctx);
  int (*num_threads)();
};

// Paged decode attention: for request b and KV head h, the G = H / KvH query heads
// h*G .. h*G+G-1 attend over keys [start, seq_len) (start = seq_len - window with a sliding
// window, else 0), read through the block table; caches are [blocks, block_size, KvH, D].
struct DecodeArgs {
  int64_t num_kv_heads, group, head_dim, block_size;
  int64_t q_stride_req, q_stride_head;             // q[b, head, d] strides (d contiguous)
  int64_t cache_stride_block, cache_stride_token;  // within one K or V cache
  int64_t table_stride, window;
  float scale;
  // Optional additive score bias by distance from the query (T5's relative bias): key t of a
  // request of length s gets bias[head * bias_stride + bias_len - s + t] (the table's last
  // column is distance 0), so a row of it lines up with the keys. nullptr: none.
  const float* bias = nullptr;
  int64_t bias_stride = 0, bias_len = 0;
  // Gemma 2's logit soft-capping: each scaled score s becomes softcap * tanh(s / softcap) before
  // the softmax (not combined with `bias`). 0: none.
  float softcap = 0.f;
};

// Paged prefill attention: one request's new tokens (positions num_cached .. seq_len - 1)
// attend causally (within `window` when > 0) over its keys in the paged cache.
struct PrefillArgs {
  int64_t group, head_dim, block_size, q_stride_tok, q_stride_head, cache_stride_block, cache_stride_token;
  int64_t num_cached, seq_len, window;
  float scale;
  float softcap = 0.f;  // as DecodeArgs::softcap
};

constexpr int kKernelAbi = 2;  // bumped whenever this struct or a signature changes

struct KernelSet {
  int abi;           // kKernelAbi
  const char* name;  // "avx512", "avx2", "neon"

  // y[m, n] = x[m, 2 half_k] @ W.T (+ bias[n], float32, or nullptr), bf16 in and out (y's rows
  // n apart). W is packed [col_blocks][half_k][64][2] bf16 (models/cpu_ops.pack_linear_weight):
  // per block of 64 output columns, each pair of input features holds the columns' two weights
  // side by side; columns past n are zero.
  void (*linear_bf16)(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t half_k,
                      int64_t col_blocks, const float* bias, uint16_t* y, int64_t n);

  // The int8 / int4 linear (models/quantization.py's packed layout, see avx512/quant_linear.cpp):
  // x [m, k] bf16 (x_bf16) or float32 rows ldx apart; y [m, n] in x's dtype, rows n apart.
  // w: [col_blocks][k / 4][256 (int8) or 128 (int4)] bytes; scales [col_blocks][k / group][64] fp16.
  void (*quant_linear)(const void* x, bool x_bf16, int64_t ldx, int64_t m, int64_t k, const uint8_t* w,
                       const uint16_t* scales, int64_t bits, int64_t group, const float* bias, void* y,
                       int64_t n, int64_t col_blocks);

  // q [B, H, D] bf16, head_dim a multiple of 32 up to 256; table [B, table_stride] int64,
  // seq_lens [B] (>= 1) -> out [B, H * D] bf16 (rows H * D apart).
  void (*decode_attention)(const DecodeArgs& a, const uint16_t* q, const uint16_t* k_cache,
                           const uint16_t* v_cache, const int64_t* table, const int64_t* seq_lens,
                           int64_t num_reqs, uint16_t* out);

  // q [lq, H, D] bf16 for positions a.num_cached .. a.seq_len - 1 of one request whose block
  // table row is `table` -> out [lq, H * D] (rows out_stride apart).
  void (*prefill_attention)(const PrefillArgs& a, const uint16_t* q, const uint16_t* k_cache,
                            const uint16_t* v_cache, const int64_t* table, int64_t num_kv_heads, int64_t lq,
                            uint16_t* out, int64_t out_stride);

  // Fused per-layer ops on bf16 rows, with the roundings of the PyTorch code they replace
  // (models/layers.py): see avx512/small_ops.cpp for each one's exact arithmetic.
  void (*rms_norm_bf16)(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows,
                        int64_t n, float eps);
  // residual [rows, n] contiguous += x (rounded), then out = rms_norm(residual)
  void (*add_rms_norm_bf16)(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w,
                            uint16_t* out, int64_t rows, int64_t n, float eps);
  // neox rotary in place on the first num_heads heads of each row; cos_sin [rows, 2, d]; d % 32 == 0
  void (*rotary_bf16)(uint16_t* x, int64_t ldx, const uint16_t* cos_sin, int64_t rows, int64_t num_heads,
                      int64_t d);
  // out [rows, n] = silu(x[:, :n]) * x[:, n:]
  void (*silu_and_mul_bf16)(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t rows, int64_t n);
  // out[r] = the first index of row r's maximum (rows without NaN), v < 2^31
  void (*argmax_bf16)(const uint16_t* logits, int64_t ld, int64_t rows, int64_t v, int64_t* out);
  // Per row of logits (bf16 if x_bf16, else float32): the log-softmax at tokens[r] into
  // sampled[r], the k largest log-probabilities (descending, ties to the lower id) into
  // top_vals[r * k ..] and their ids into top_ids[r * k ..].
  void (*logprobs_topk)(const void* x, bool x_bf16, int64_t ld, int64_t rows, int64_t v, const int64_t* tokens,
                        int64_t k, float* sampled, float* top_vals, int64_t* top_ids);

  // AMX tiles for linear_bf16 from a few rows on (avx512 only; nullptr elsewhere): whether the
  // CPU and the OS allow them, and turning them on or off (-> the previous setting).
  bool (*has_amx)();
  bool (*set_amx)(bool enabled);
};

}  // namespace kvserve

// Each set's library exports one entry point, named after the set: it returns nullptr when
// the CPU lacks an instruction the set was compiled for, else the set (host kept for its calls).
#define KV_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
const kvserve::KernelSet* kvserve_kernels_avx512(const kvserve::Host* host);
const kvserve::KernelSet* kvserve_kernels_avx2(const kvserve::Host* host);
const kvserve::KernelSet* kvserve_kernels_neon(const kvserve::Host* host);
}
