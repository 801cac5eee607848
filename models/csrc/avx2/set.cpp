// The AVX2 set's entry point: the CPU must have AVX2, FMA and F16C (the flags it was built with).
#include "avx2.h"

KV_EXPORT const kvserve::KernelSet* kvserve_kernels_avx2(const kvserve::Host* h) {
  using namespace kvserve;
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
    return nullptr;
  host() = h;
  return avx2::kernel_table("avx2");
}
