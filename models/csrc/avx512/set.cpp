// The AVX512-BF16 set's entry point: the CPU must have the AVX-512 subsets, BF16 and VNNI it
// was built for (AMX is checked at run time, by the linear).
#include "avx512.h"

KV_EXPORT const kvserve::KernelSet* kvserve_kernels_avx512(const kvserve::Host* h) {
  using namespace kvserve;
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
                  __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (!ok) return nullptr;
  host() = h;
  return avx512::kernel_table("avx512", avx512::has_amx, avx512::set_amx);
}
