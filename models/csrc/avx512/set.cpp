// The AVX-512 sets' entry point: `avx512` where built with BF16 (and AMX), else `avx512vnni`; the
// CPU must have the subsets the build uses (AMX is checked at run time, by the linear).
#include "avx512.h"

namespace {

bool cpu_runs_this_build() {
  const bool base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                    __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
#ifdef __AVX512BF16__
  return base && __builtin_cpu_supports("avx512bf16");
#else
  return base;
#endif
}

}  // namespace

#ifdef __AVX512BF16__
#define KV_SET_NAME avx512
#else
#define KV_SET_NAME avx512vnni
#endif
#define KV_ENTRY2(name) kvserve_kernels_##name
#define KV_ENTRY(name) KV_ENTRY2(name)
#define KV_QUOTE2(name) #name
#define KV_QUOTE(name) KV_QUOTE2(name)

KV_EXPORT const kvserve::KernelSet* KV_ENTRY(KV_SET_NAME)(const kvserve::Host* h) {
  using namespace kvserve;
  if (!cpu_runs_this_build()) return nullptr;
  host() = h;
  avx512::prefetch_streams() = !__builtin_cpu_is("amd");
  return avx512::kernel_table(KV_QUOTE(KV_SET_NAME), avx512::has_amx, avx512::set_amx);
}
