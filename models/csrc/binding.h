// The torch side of kvserve's CPU kernels: the loaded kernel set (kernels.h) and the tensor-level
// ops that check their arguments and call it (ops.cpp); decoder_stack.cpp runs a model's layers
// through the same ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "kernels.h"

namespace kvserve {

// The set loaded by load_kernel_set (ops.cpp); a TORCH_CHECK error when none is.
const KernelSet& kernels();
bool has_kernel_set();

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& bias, int64_t n, int64_t bits, int64_t group);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const c10::optional<at::Tensor>& bias = c10::nullopt);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t seq_len, double scale, int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_(const at::Tensor& x, const at::Tensor& cos_sin, int64_t num_heads, int64_t head_dim);
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slots);

}  // namespace kvserve
