// The NEON set's entry point: the CPU must have the dot-product instructions (sdot) it was built
// for; ASIMD itself is part of every ARMv8-A CPU.
#include "neon.h"

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)  // <asm/hwcap.h>'s bit, for C libraries whose headers lack it
#endif
#endif

namespace {

bool has_dotprod() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
  return true;  // macOS: every Apple silicon CPU has it
#endif
}

}  // namespace

KV_EXPORT const kvserve::KernelSet* kvserve_kernels_neon(const kvserve::Host* h) {
  using namespace kvserve;
  if (!has_dotprod()) return nullptr;
  host() = h;
  return neon::kernel_table("neon");
}
