// The kernels every set defines in its own namespace (kernels.h's signatures, one translation
// unit per family), and the table a set's entry point hands out. Included inside the namespace.

void linear_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* w, int64_t half_k, int64_t col_blocks,
                 const float* bias, uint16_t* y, int64_t n);
void quant_linear(const void* x, bool x_bf16, int64_t ldx, int64_t m, int64_t k, const uint8_t* w,
                  const uint16_t* scales, int64_t bits, int64_t group, const float* bias, void* y, int64_t n,
                  int64_t col_blocks);
void decode_attention(const DecodeArgs& a, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                      const int64_t* table, const int64_t* seq_lens, int64_t num_reqs, uint16_t* out);
void prefill_attention(const PrefillArgs& a, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* table, int64_t num_kv_heads, int64_t lq, uint16_t* out, int64_t out_stride);
void rms_norm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n,
                   float eps);
void add_rms_norm_bf16(uint16_t* residual, const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                       int64_t rows, int64_t n, float eps);
void rotary_bf16(uint16_t* x, int64_t ldx, const uint16_t* cos_sin, int64_t rows, int64_t num_heads, int64_t d);
void silu_and_mul_bf16(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t rows, int64_t n);
void argmax_bf16(const uint16_t* logits, int64_t ld, int64_t rows, int64_t v, int64_t* out);
void logprobs_topk(const void* x, bool x_bf16, int64_t ld, int64_t rows, int64_t v, const int64_t* tokens, int64_t k,
                   float* sampled, float* top_vals, int64_t* top_ids);

// The set's table: its kernels above, and its AMX switches (nullptr where it has none).
inline const KernelSet* kernel_table(const char* name, bool (*has_amx)() = nullptr, bool (*set_amx)(bool) = nullptr) {
  static const KernelSet set{kKernelAbi,        name,          linear_bf16,       quant_linear,
                             decode_attention,  prefill_attention, rms_norm_bf16, add_rms_norm_bf16,
                             rotary_bf16,       silu_and_mul_bf16, argmax_bf16,   logprobs_topk,
                             has_amx,           set_amx};
  return &set;
}
