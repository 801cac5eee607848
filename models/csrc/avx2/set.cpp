// The AVX2 set's entry point: the CPU must have AVX2, FMA and F16C (the flags it was built with).
#include "avx2.h"

KV_EXPORT const kvserve::KernelSet* kvserve_kernels_avx2(const kvserve::Host* h) {
  using namespace kvserve;
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
    return nullptr;
  host() = h;
  static const KernelSet set{kKernelAbi,          "avx2",           avx2::linear_bf16,       avx2::quant_linear,
                             avx2::decode_attention, avx2::prefill_attention, avx2::rms_norm_bf16,
                             avx2::add_rms_norm_bf16, avx2::rotary_bf16, avx2::silu_and_mul_bf16, avx2::argmax_bf16,
                             avx2::logprobs_topk,  nullptr,          nullptr};
  return &set;
}
